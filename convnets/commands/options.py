"""Command-line options shared by every command: one spelling, one meaning, one parser each.

Each ``add_*`` function adds options to a parser or argument group, and is the one definition of
those options: ``--model``, ``--weights``, ``--precision``, ``--engine``, ``--device``,
``--compile``, ``--image-size``, ``--memory-format``, ``--output``, ``--json``, ... (``convnets
train`` adds them through the ``shared`` metadata of :class:`convnets.train.TrainConfig` fields,
with upstream's spellings ``--arch``, ``--pretrained-from-file`` as aliases). A command passes what
differs (a default, what its ``--output`` names). The ``*_from_args`` functions hand the parsed
values to the library inside a command's ``run()``, in command-line words: the model is built by
:func:`convnets.registry.choose_model`. Nothing here imports PyTorch when the options are added or
parsed (so ``--help`` and usage errors answer at once); the ``*_from_args`` functions import it.
The ``check_*`` functions check the paths that options name (inputs exist, outputs can be written)
inside a command's ``prepare`` (see :mod:`convnets.cli`), also before PyTorch; under
:func:`usage_errors` what they refuse is a usage error.
Engine and export format choices come from their registries (:mod:`convnets.deploy.engines`,
:mod:`convnets.deploy.formats`), which import nothing heavy either.

The model options (:func:`add_model_arguments`) mean the same in every command:

* ``--weights FILE`` loads a checkpoint (any layout :func:`convnets.load_model` reads). The file
  defines the architecture (recorded in it, or read off its tensor shapes); ``--model`` is then
  optional and, when given, must name that same architecture: a check, never a conversion.
* otherwise ``--model NAME`` picks a registered architecture, with NVIDIA's pretrained weights
  (``--pretrained``) or random weights (``--random-init``: no download, meaningless outputs, for
  trying the tools offline and timing), whichever the command defaults to.
* ``--arch-kwargs JSON`` changes the architecture of ``--random-init`` models only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from convnets.constants import CACHE_DIR_ENV, CACHE_MAX_SIZE_ENV, DEFAULT_IMAGE_SIZE, MAX_BATCH_SIZE, MAX_IMAGE_SIZE
from convnets.errors import CheckpointError, InvalidArgumentError, message_for
from convnets.models.specs import MODEL_SPECS, list_models
from convnets.preprocessing.sources import is_url
from convnets.runtime import (MEMORY_FORMAT_ALIASES, MEMORY_FORMATS, PRECISIONS, check_precision, memory_format_name,
                              resolve_device)

if TYPE_CHECKING:
    import torch

    from convnets.registry import ChosenModel

__all__ = ["MODEL_OPTION_NAMES", "WEIGHT_SOURCES", "add_arch_kwargs_argument", "add_cache_argument",
           "add_compile_argument", "add_device_argument", "add_engine_argument", "add_image_size_argument", "add_json_argument",
           "add_memory_format_argument", "add_model_argument", "add_model_arguments", "add_output_argument",
           "add_precision_argument", "add_pretrained_argument", "add_weights_argument", "batch_size", "bounded_int",
           "check_inputs_exist", "check_output_directory", "check_output_file", "device_from_args", "load_from_args",
           "model_name", "non_negative_int", "parse_arch_kwargs", "pixels", "positive_int", "positive_seconds",
           "usage_errors"]

#: What an ``add_*`` function adds options to: a parser or one of its argument groups.
Parser = Union[argparse.ArgumentParser, argparse._ArgumentGroup]

log = logging.getLogger(__name__)

#: Where a model's weights come from when no ``--weights`` file is given.
WEIGHT_SOURCES: tuple[str, ...] = ("pretrained", "random-init")

_DEVICE = re.compile(r"auto|[a-z_]+(:\d+)?")


def _argparse_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type=``: its :class:`InvalidArgumentError` becomes a usage error
    that shows the message itself (argparse replaces a plain ``ValueError``'s with its own)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidArgumentError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    convert.__name__ = name
    return convert


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count such as ``--batch-size``: an integer of at least 1 (else a
    usage error that names the option: ``argument --batch-size: must be a positive integer, got '0'``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def bounded_int(text: str, limit: int) -> int:
    """``text`` as an integer from 1 to ``limit``, else an :class:`argparse.ArgumentTypeError` that
    states the limit (argparse adds the option's name: ``argument --image-size: must be a positive
    integer of at most 4096, got '100000'``).

    The text is checked before it is converted, so a thousand-digit number costs nothing either.
    """
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else 0
    if not 1 <= value <= limit:
        raise argparse.ArgumentTypeError(f"must be a positive integer of at most {limit}, got {text[:40]!r}")
    return value


def pixels(text: str) -> int:
    """argparse ``type=`` for ``--image-size``: a number of pixels from 1 to
    :data:`~convnets.constants.MAX_IMAGE_SIZE` (a larger one would exhaust memory)."""
    return bounded_int(text, MAX_IMAGE_SIZE)


def batch_size(text: str) -> int:
    """argparse ``type=`` for ``--batch-size`` and other batch counts: an integer from 1 to
    :data:`~convnets.constants.MAX_BATCH_SIZE` (a larger batch of large images would exhaust memory)."""
    return bounded_int(text, MAX_BATCH_SIZE)


def positive_seconds(text: str) -> float:
    """argparse ``type=`` for a duration such as ``--timeout``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


# --- model and weights ---------------------------------------------------------------------------


def parse_arch_kwargs(text: str, *, option: str = "--arch-kwargs") -> dict[str, Any]:
    """The architecture overrides of ``--arch-kwargs``: a JSON object, e.g. ``'{"layers": [1, 1, 1, 1]}'``.

    Only the syntax is checked here; the field names and values when the model is built.

    Raises:
        InvalidArgumentError: not JSON, or not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{option} is not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{option} must be a JSON object such as '{{\"layers\": [1, 1, 1, 1]}}', "
                                   f"got {text!r}")
    return value


def model_name(text: str) -> str:
    """argparse ``type=`` of ``--model``: upstream's spelling (``se-resnext101-32x4d``) as the registry's
    (``se_resnext101_32x4d``); whether it is registered is the ``choices`` check's or the registry's."""
    key = text.strip().lower().replace("-", "_")
    return key if key in MODEL_SPECS else text


def add_model_argument(parser: Parser, *, aliases: Sequence[str] = (), dest: str = "model", default: str | None = None,
                       check: bool = True, help: str | None = None) -> None:
    """Add ``--model NAME``: one of :func:`convnets.list_models` (upstream's spellings accepted).

    Args:
        parser: a parser or argument group.
        aliases: other spellings of the same option (``train``: upstream's ``--arch``).
        dest: the attribute of the parsed namespace.
        default: the value when the option is not given.
        check: argparse checks the name (a usage error); ``False`` leaves it to the registry when
            the model is built (``train``, whose configuration is also built from Python).
        help: replaces the default help text.
    """
    names = list_models()
    parser.add_argument("--model", *aliases, dest=dest, type=model_name, choices=names if check else None,
                        default=default, metavar="NAME", help=help or f"architecture: {', '.join(names)}")


def add_weights_argument(parser: Parser, *, aliases: Sequence[str] = (), dest: str = "weights",
                         help: str | None = None) -> None:
    """Add ``--weights FILE``: a checkpoint in any layout :func:`convnets.load_model` reads.

    Args:
        parser: a parser or argument group.
        aliases: other spellings of the same option (``train``: upstream's ``--pretrained-from-file``).
        dest: the attribute of the parsed namespace.
        help: replaces the default help text.
    """
    parser.add_argument("--weights", *aliases, dest=dest, metavar="FILE", default=None,
                        help=help or "checkpoint to load: any layout convnets.load_model reads, including `convnets "
                                     "train` checkpoints with their class names and image size. It defines the "
                                     "architecture")


def add_pretrained_argument(parser: Parser, *, dest: str = "weight_source",
                            help: str = "NVIDIA's ImageNet weights (downloaded once and verified)") -> None:
    """Add ``--pretrained``: NVIDIA's ImageNet weights.

    Args:
        parser: a parser or argument group.
        dest: ``"weight_source"`` (stores ``"pretrained"``, beside ``--weights`` and ``--random-init``)
            or a flag of its own (stores ``True``, default ``False``: ``train``).
        help: replaces the default help text.
    """
    if dest == "weight_source":
        parser.add_argument("--pretrained", dest=dest, action="store_const", const="pretrained", help=help)
    else:
        parser.add_argument("--pretrained", dest=dest, action="store_true", help=help)


def add_arch_kwargs_argument(parser: Parser, *, help: str | None = None) -> None:
    """Add ``--arch-kwargs JSON`` (parsed by :func:`parse_arch_kwargs`; default ``{}``) as ``arch_kwargs``."""
    parser.add_argument("--arch-kwargs", type=_argparse_type(parse_arch_kwargs, "arch_kwargs"), default={},
                        metavar="JSON",
                        help=help or 'architecture overrides, e.g. \'{"layers": [1, 1, 1, 1], "widths": [32, 64, 128, '
                                     '256]}\'')


def add_model_arguments(parser: argparse.ArgumentParser, *, default_weights: str = "pretrained",
                        default_model: str | None = None) -> None:
    """Add the ``model`` group: ``--model``, ``--weights`` / ``--pretrained`` / ``--random-init``,
    ``--arch-kwargs``; :func:`load_from_args` builds the model they describe.

    Args:
        parser: the command's parser.
        default_weights: ``"pretrained"`` or ``"random-init"``: the weights without a weights option.
        default_model: the architecture without ``--model`` or ``--weights``; ``None``: one of
            them is required.
    """
    if default_weights not in WEIGHT_SOURCES:
        raise InvalidArgumentError(f"default_weights must be one of {', '.join(WEIGHT_SOURCES)}, "
                                   f"got {default_weights!r}")
    if default_model is not None and default_model not in MODEL_SPECS:
        raise InvalidArgumentError(f"default_model must be one of {', '.join(list_models())}, got {default_model!r}")
    group = parser.add_argument_group("model")
    fallback = f"default: {default_model}" if default_model else "required without --weights"
    add_model_argument(group, help=f"architecture: {', '.join(list_models())} ({fallback}; with --weights "
                                   "optional, and it must name the checkpoint's architecture)")
    source = group.add_mutually_exclusive_group()
    add_weights_argument(source)
    add_pretrained_argument(source, help="NVIDIA's ImageNet weights (downloaded once and verified)"
                                         + (" [default]" if default_weights == "pretrained" else ""))
    source.add_argument("--random-init", dest="weight_source", action="store_const", const="random-init",
                        help="random weights, BatchNorm statistics measured on random inputs: no download, "
                             "meaningless outputs (testing, timing)"
                             + (" [default]" if default_weights == "random-init" else ""))
    add_arch_kwargs_argument(group, help='architecture overrides with --random-init, e.g. \'{"layers": [1, 1, 1, 1]}\'')
    parser.set_defaults(weight_source=default_weights, default_model=default_model)


#: How the command line spells :func:`convnets.registry.choose_model`'s keywords in its messages.
MODEL_OPTION_NAMES: dict[str, str] = {"name": "--model", "path": "--weights", "arch_kwargs": "--arch-kwargs",
                                      "random_init": "--random-init"}


def load_from_args(args: argparse.Namespace, *, device: torch.device | str | None = None) -> ChosenModel:
    """The model that the options of :func:`add_model_arguments` describe, in eval mode
    (:func:`convnets.registry.choose_model`, its messages naming the options).

    Args:
        args: the parsed options.
        device: where the model goes (default: the CPU).

    Raises:
        InvalidArgumentError: inconsistent options (``--arch-kwargs`` with pretrained weights, a
            checkpoint whose architecture is not ``--model``'s, no model at all).
        CheckpointError, WeightsUnavailableError: from loading.
    """
    from convnets.registry import choose_model  # PyTorch only once a command runs

    try:
        # A --weights file defines the architecture: the command's default model is no check of it.
        name = args.model if args.weights else args.model or getattr(args, "default_model", None)
        return choose_model(name, path=args.weights,
                            pretrained=args.weight_source == "pretrained", arch_kwargs=args.arch_kwargs, device=device,
                            image_size=getattr(args, "image_size", None) or DEFAULT_IMAGE_SIZE,
                            names=MODEL_OPTION_NAMES)
    except CheckpointError as e:
        if e.architecture:  # the file records an architecture that its tensors are not
            e.add_cli_advice(f"Its recorded architecture is wrong, so no --model can load it; save it again "
                             f"with the {e.architecture} architecture recorded, or with none.")
        raise


# --- run settings --------------------------------------------------------------------------------


def _device_name(text: str) -> str:
    # Only the spelling here (no PyTorch while parsing); device_from_args checks that it exists.
    if not _DEVICE.fullmatch(text):
        raise InvalidArgumentError(f"--device {text!r} is not a device: use auto, cpu, cuda or cuda:N")
    return text


def add_device_argument(parser: Parser, *, default: str | None = "auto", help: str | None = None) -> None:
    """Add ``--device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.

    Args:
        parser: a parser or argument group.
        default: ``"auto"``; ``None`` means the same (for configurations that store "not given").
        help: replaces the default help text.
    """
    parser.add_argument("--device", type=_argparse_type(_device_name, "device"), default=default, metavar="DEVICE",
                        help=help or "auto (default): cuda when available, else cpu; or cpu, cuda, cuda:N")


def add_engine_argument(parser: Parser, *, extra_choices: Mapping[str, str] | None = None,
                        help: str | None = None) -> None:
    """Add ``--engine``: a registered inference engine or ``auto`` (the default); the choices and
    each engine's line of help come from the registry (:func:`convnets.deploy.engines.engines`).

    Args:
        parser: a parser or argument group.
        extra_choices: values this command adds and what each means (``benchmark``: ``all``).
        help: what the engine runs (default: "what runs the model"); the engines' lines follow it.
    """
    from convnets.deploy.engines import AUTO, engine_names, engines  # the engine modules import no torch

    extra = dict(extra_choices or {})
    lines = [e.help_line() for e in engines()]
    lines.append(f"{AUTO} (the fastest installed engine for the device and precision, checked against the model; "
                 "falls back to torch)")
    lines += [f"{name} ({meaning})" for name, meaning in extra.items()]
    parser.add_argument("--engine", choices=(*engine_names(), AUTO, *extra), default=AUTO,
                        help=f"{help or 'what runs the model'} (default: {AUTO}, which names its pick on stderr): "
                             + "; ".join(lines))


def add_cache_argument(parser: Parser) -> None:
    """Add ``--cache`` / ``--no-cache``: the engine cache (:mod:`convnets.deploy.cache`), on by default."""
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the graphs that engines other than torch convert, and auto's check of them, in "
                             f"the engine cache (${CACHE_DIR_ENV}, default $TORCH_HOME/hub/convnets-engines; at most "
                             f"${CACHE_MAX_SIZE_ENV}) and load them from there next time; --no-cache "
                             "converts again (default: on; see convnets cache list|trim|clear)")


def add_precision_argument(parser: Parser, *, choices: Sequence[str] = PRECISIONS, default: str | None = "fp32",
                           aliases: Sequence[str] = (), dest: str = "precision",
                           action: type[argparse.Action] | None = None, help: str | None = None) -> None:
    """Add ``--precision``: names from :data:`convnets.runtime.PRECISIONS` (a command may offer fewer).

    Args:
        parser: a parser or argument group.
        choices: the precisions this command offers, a subset of ``PRECISIONS``.
        default: the value when the option is not given (``None``: the command decides).
        aliases: other spellings of the same option.
        dest: the attribute of the parsed namespace.
        action: an argparse action that stores the value (``train``: into its AMP settings).
        help: replaces the default help text.
    """
    unknown = sorted(set(choices) - set(PRECISIONS))
    if unknown:
        raise InvalidArgumentError(f"choices {unknown} are not precisions; use some of {', '.join(PRECISIONS)}")
    extra: dict[str, Any] = {} if action is None else {"action": action}
    parser.add_argument("--precision", *aliases, dest=dest, choices=tuple(choices), default=default, **extra,
                        help=help or f"{default} (default); bf16 (GPUs, CPUs with AVX512-BF16 or AMX); fp16 (GPUs)")


def add_memory_format_argument(parser: Parser, *, default: str | None = "contiguous", help: str | None = None) -> None:
    """Add ``--memory-format``: ``contiguous`` or ``channels_last``; ``nchw`` / ``nhwc`` are accepted
    and stored as those (:func:`convnets.runtime.memory_format_name`).

    Args:
        parser: a parser or argument group.
        default: the value when the option is not given (``None``: the command decides).
        help: replaces the default help text.
    """
    aliases = ", ".join(f"{a} = {c}" for a, c in MEMORY_FORMAT_ALIASES.items())
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default=default,
                        type=_argparse_type(lambda text: memory_format_name(text, option="--memory-format"),
                                            "memory_format"),
                        help=help or f"layout of the model and its input batches (default: {default}; "
                                     f"aliases {aliases})")


def add_compile_argument(parser: Parser, *, default: bool, help: str) -> None:
    """Add ``--compile`` / ``--no-compile``: ``torch.compile`` the torch engine's model.

    Args:
        parser: a parser or argument group.
        default: on or off (``predict`` / ``embed``: off, the first batch would wait; ``benchmark``: on).
        help: what compiling costs and buys in this command; the default is added.
    """
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                        help=f"torch.compile the model: {help} (default: {'on' if default else 'off'})")


def add_image_size_argument(parser: Parser, *, default: int | None, help: str) -> None:
    """Add ``--image-size PX``: a number of pixels from 1 to :data:`~convnets.constants.MAX_IMAGE_SIZE`
    (:func:`pixels`).

    Args:
        parser: a parser or argument group.
        default: the value when the option is not given (``None``: the weights' own size).
        help: what the size is in this command, with its default.
    """
    parser.add_argument("--image-size", type=pixels, default=default, metavar="PX",
                        help=f"{help}; at most {MAX_IMAGE_SIZE}")


def add_output_argument(parser: Parser, *, metavar: str, help: str, required: bool = False) -> None:
    """Add ``--output``: what the command writes, named by ``metavar`` (``FILE``, ``DIR``, ``PNG``).

    ``predict`` and ``embed`` add it through :func:`convnets.commands.batch_options.add_output_arguments`
    (with ``--resume``).

    Args:
        parser: a parser or argument group.
        metavar: what kind of path it is.
        help: what is written there.
        required: the command writes nothing without it.
    """
    parser.add_argument("--output", metavar=metavar, default=None, required=required, help=help)


def add_json_argument(parser: Parser, *, help: str, file_option: str | None = None) -> None:
    """Add ``--json``: print the command's result as JSON on stdout (instead of its text).

    Args:
        parser: a parser or argument group.
        help: what the JSON holds.
        file_option: the option that writes the same JSON to a file, when ``--json FILE`` once did
            (``benchmark``): ``--json FILE`` is still accepted as its older spelling (the value is
            then the file name, else ``True`` / ``False``).
    """
    text = f"print {help} as JSON on stdout instead of text"
    if file_option is None:
        parser.add_argument("--json", action="store_true", help=text)
    else:
        parser.add_argument("--json", nargs="?", const=True, default=False, metavar="FILE",
                            help=f"{text} (--json FILE: the older spelling of {file_option} FILE)")


def device_from_args(args: argparse.Namespace) -> torch.device:
    """The device of ``--device``, checked to exist and, if the command has ``--precision``, to run it.

    Raises:
        InvalidArgumentError: a device this machine does not have.
        UnsupportedPrecisionError: a precision the device cannot run.
    """
    device = resolve_device(args.device, option="--device")
    if getattr(args, "precision", None) is not None:
        check_precision(args.precision, device, option="--precision")
    return device


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for a count that may be 0, such as ``--workers``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


# --- paths named on the command line -------------------------------------------------------------
#
# Checked by a command's prepare(args, stack) (see convnets.cli) before anything heavy is imported,
# so that a misspelt input or an output that cannot be written answers at once, as a usage error.


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Report the :class:`InvalidArgumentError` of the checks inside as a usage error
    (:class:`argparse.ArgumentError`): the command line prints its message in one line and exits
    with status 2, as for argparse's own errors."""
    try:
        yield
    except InvalidArgumentError as e:
        raise argparse.ArgumentError(None, message_for(e, "cli")) from e


def check_inputs_exist(name: str, *values: str | os.PathLike[str] | None) -> None:
    """Each of ``values`` that is a local path must exist; URLs and ``None`` are skipped (a
    download says what is wrong with a URL), and so are paths that cannot be looked at (a
    permission denied: the run reports it, naming the input).

    Args:
        name: the option as the command line spells it (``--weights``, ``INPUT``).
        values: its values.

    Raises:
        InvalidArgumentError: a path that does not exist.
    """
    for value in values:
        if value is None or is_url(value):
            continue
        try:
            os.stat(value)
        except (FileNotFoundError, NotADirectoryError):
            where = "" if os.path.isabs(value) else f" (in the working directory {os.getcwd()!r})"
            raise InvalidArgumentError(f"{name} {os.fspath(value)} does not exist{where}") from None
        except (OSError, ValueError):
            continue


def check_output_file(path: str | os.PathLike[str], *, option: str = "output",
                      formats: Mapping[str, str] | None = None, kind: str = "format") -> None:
    """The file ``path`` can be created: its suffix names one of ``formats``, it is not a
    directory, and its directory exists and can be written in.

    Args:
        path: the output file.
        option: the option without its dashes (``output`` names ``--output``).
        formats: suffix -> format (``None``: any suffix).
        kind: what the message calls a format (``"embedding format"``).

    Raises:
        InvalidArgumentError: what is wrong, naming the option.
    """
    from convnets.fileio import directory_problem
    from convnets.inference.outputs import suffix_format

    if formats is not None:
        suffix_format(path, dict(formats), option=option, kind=kind)
    if os.path.isdir(path):
        raise InvalidArgumentError(f"--{option} {os.fspath(path)} is a directory; give a file name")
    problem = directory_problem(os.path.dirname(path) or os.curdir)
    if problem is not None:
        raise InvalidArgumentError(f"--{option} {os.fspath(path)}: {problem}")


def check_output_directory(path: str | os.PathLike[str], *, option: str = "output") -> None:
    """The directory ``path`` can be written, or created with its missing parents (as the commands
    that take an ``--output DIR`` do): the nearest existing one of it and its parents is a
    directory that can be written in.

    Raises:
        InvalidArgumentError: what is wrong, naming the option.
    """
    from convnets.fileio import directory_problem

    existing = Path(path)
    while not os.path.lexists(existing) and existing.parent != existing:  # "a/b" -> "a" -> "."; "/a" -> "/"
        existing = existing.parent
    problem = directory_problem(existing)
    if problem is not None:
        raise InvalidArgumentError(f"--{option} {os.fspath(path)}: {problem}")
