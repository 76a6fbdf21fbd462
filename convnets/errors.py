"""Exceptions that convnets raises for problems a user can cause or fix.

Each subclasses :class:`ConvnetsError` and also the built-in type a caller would already catch
(``ValueError`` for bad arguments or files, ``OSError`` for missing resources), so that existing
``except ValueError`` code keeps working. Messages name the input and say what to do.
"""

from __future__ import annotations


class ConvnetsError(Exception):
    """Base class of every error that convnets raises on purpose."""


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
    """A checkpoint file cannot be read, or its tensors do not fit the requested model."""


class WeightsUnavailableError(ConvnetsError, OSError):
    """Pretrained weights could not be found in the cache, the mirror or downloaded."""


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
