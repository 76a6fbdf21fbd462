"""Exceptions that convnets raises for problems a user can cause or fix.

Each subclasses :class:`ConvnetsError` and also the built-in type a caller would already catch
(``ValueError`` for bad arguments or files, ``OSError`` for missing resources), so that existing
``except ValueError`` code keeps working. Messages name the input and say what to do.

One error, two interfaces
-------------------------
The message (``str(error)``) speaks Python: it names keywords (``timeout=10``) and calls
(``convnets.resnet50(...)``). The command line must never print that advice, so an error whose
message names a keyword or a call also carries its message in command-line words (``--timeout``,
``--arch resnet50``, or no advice where the command line has no such option): ``error.cli``,
passed as ``cli=`` when raised. Where only the command knows its own options (the same library error
can reach ``predict`` and ``export``, which offer different options), the raising code states the
problem in neutral words as ``cli`` and the facts a command needs as attributes
(``error.keyword``: the Python keyword the advice is about; ``CheckpointError.architecture``), and the
command adds its advice with :meth:`ConvnetsError.add_cli_advice`. The command line prints
:func:`message_for` ``(error, "cli")``; everything else prints ``str(error)``.

(Names of run settings are the other half of this: :mod:`convnets.runtime` functions take
``option`` and spell a setting ``--precision bf16`` or ``precision='bf16'`` accordingly.)
"""

from __future__ import annotations

import reprlib
from typing import Literal

__all__ = ["CheckpointError", "ConvnetsError", "DataError", "ExportError", "ImageDecodeError", "ImageDownloadError",
           "ImageLoadError", "ImageNotFoundError", "Interface", "InvalidArgumentError", "ManifestError",
           "MissingDependencyError", "ServeError", "TrainingDivergedError", "UnknownArgumentError", "UnknownModelError",
           "UnsupportedPrecisionError", "WeightsUnavailableError", "message_for", "short_repr"]

#: The interfaces a message can be written for: Python (keywords, calls) or the command line (options).
Interface = Literal["python", "cli"]


class ConvnetsError(Exception):
    """Base class of every error that convnets raises on purpose.

    Args:
        *args: as for :class:`Exception`; the first is the message, in Python's words.
        cli: the same message in command-line words, when the message names a keyword or a call
            (see the module docstring); ``None``: the message reads the same on the command line.
        keyword: the Python keyword whose value the message asks to change (e.g. ``"timeout"``), so
            that a command offering it as an option can say which option (``add_cli_advice``).
    """

    def __init__(self, *args: object, cli: str | None = None, keyword: str | None = None) -> None:
        super().__init__(*args)
        self.cli = cli
        self.keyword = keyword

    def message_for(self, interface: Interface) -> str:
        """The message in the words of ``interface``: ``"python"`` (``str(self)``) or ``"cli"``."""
        if interface == "cli" and self.cli is not None:
            return self.cli
        return str(self)

    def add_cli_advice(self, advice: str) -> None:
        """Append ``advice`` (command-line words, e.g. ``"Retry, or pass a larger --timeout."``) to
        the command-line message; the Python message is unchanged."""
        self.cli = f"{self.message_for('cli')} {advice}"


def message_for(error: BaseException, interface: Interface) -> str:
    """The message of any exception in the words of ``interface`` (``str(error)`` unless it is a
    :class:`ConvnetsError` that carries a command-line message)."""
    return error.message_for(interface) if isinstance(error, ConvnetsError) else str(error)


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 2, 8, 8, 8
        self.maxlong, self.maxstring, self.maxother = 24, 40, 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:  # repr() itself refuses ints of more than 4300 digits
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def short_repr(value: object) -> str:
    """``repr(value)`` abbreviated for a message: nested containers, long lists, long numbers and
    strings are cut with ``...``. Safe for values read from files (a million-entry or deeply nested
    list, an integer of thousands of digits): the result is short and never recurses deeply."""
    return _SHORT.repr(value)


class InvalidArgumentError(ConvnetsError, ValueError):
    """An argument, keyword or command-line option has a value that is not allowed.

    The message names the argument in the words of the interface it came through (a keyword in
    Python, an option on the command line), the value and what is allowed.
    """


class UnknownArgumentError(ConvnetsError, TypeError):
    """A keyword that the function does not take (a ``TypeError``, as Python raises for one)."""


class InvalidArgumentTypeError(ConvnetsError, TypeError):
    """An argument of the wrong type (a ``TypeError``, as Python raises for one).

    For instance a number where a list of images is expected, or a model with a layer type a
    training recipe has no rule for. The message names the argument and the accepted types.
    """


class UnknownModelError(ConvnetsError, ValueError):
    """A model name that is not in the registry; the message lists the valid names."""


class ManifestError(ConvnetsError, ValueError):
    """``weights_manifest.json`` is malformed; the message names the entry and field."""


class CheckpointError(ConvnetsError, ValueError):
    """A checkpoint file cannot be read, or its tensors do not fit the requested model.

    Args:
        *args, cli, keyword: as for :class:`ConvnetsError`.
        architecture: the registered model whose tensors the file holds, when that is not the
            model asked for (so that a command can say which ``--model`` / ``--arch`` to use).
    """

    def __init__(self, *args: object, cli: str | None = None, keyword: str | None = None,
                 architecture: str | None = None) -> None:
        super().__init__(*args, cli=cli, keyword=keyword)
        self.architecture = architecture


class WeightsUnavailableError(ConvnetsError, OSError):
    """Pretrained weights could not be found in the cache, the mirror or downloaded.

    Its advice names the builders' keyword for a checkpoint, ``pretrained_from_file=PATH``
    (``keyword``); a function whose keyword for it differs rewords it with :meth:`for_keyword`.
    """

    def for_keyword(self, keyword: str) -> WeightsUnavailableError:
        """The same error advising ``keyword=PATH`` (the caller's keyword for a checkpoint, e.g. ``weights``)
        where it advises ``self.keyword=PATH``."""
        if not self.keyword or self.keyword == keyword:
            return self
        reworded = WeightsUnavailableError(str(self).replace(f"{self.keyword}=PATH", f"{keyword}=PATH"),
                                           cli=self.cli, keyword=keyword)
        reworded.__cause__ = self.__cause__
        return reworded


class ImageLoadError(ConvnetsError, ValueError):
    """An input image cannot be loaded or decoded; base of every bad-image-input error.

    Raised as is for a path that exists but cannot be read as a file (a directory, no permission).
    The message names the input (abbreviated when long) and the reason.
    """


class ImageNotFoundError(ImageLoadError, FileNotFoundError):
    """A local image path does not exist (also a ``FileNotFoundError``)."""


class ImageDownloadError(ImageLoadError, OSError):
    """A URL could not be fetched as an image (also an ``OSError``).

    Reasons: unsupported scheme (only ``http``/``https``), invalid URL, connection failure, HTTP
    4xx/5xx status, the total ``timeout`` elapsed, the body exceeded ``max_bytes``, the server sent
    a non-image content type (e.g. an HTML page) or closed the connection before the whole body
    arrived.
    """


class ImageDecodeError(ImageLoadError):
    """Bytes that were read cannot be decoded as an image.

    Reasons: empty or non-image data (text, HTML), a corrupt or truncated file, a pixel count above
    the decompression-bomb limit, or an image mode that cannot be converted to RGB.
    """


class DataError(ConvnetsError, ValueError):
    """A training or validation data set is missing, empty, inconsistent or cannot be read."""


class TrainingDivergedError(ConvnetsError, RuntimeError):
    """Training stopped because the loss or the gradients stayed non-finite for too many steps."""


class UnsupportedPrecisionError(ConvnetsError, ValueError):
    """A precision that the device cannot run (e.g. fp16 on a CPU); the message says what can."""


class ExportError(ConvnetsError, RuntimeError):
    """An export failed, or the exported model disagrees with PyTorch beyond the tolerance."""


class MissingDependencyError(ConvnetsError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""


class ServeError(ConvnetsError, RuntimeError):
    """The inference server could not start (a port taken, the model failed to load in it) or stopped
    on its own; the message says which, with the server's own reason."""
