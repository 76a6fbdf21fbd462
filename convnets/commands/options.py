"""Command-line options shared by every command: one spelling, one meaning, one parser each.

Each ``add_*`` function adds options to a parser or argument group; the ``*_from_args`` functions
turn the parsed values into objects inside a command's ``run()``. Nothing here imports PyTorch
when the options are added or parsed (so ``--help`` and usage errors answer at once); the
``*_from_args`` functions import it.

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
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from convnets.errors import CheckpointError, InvalidArgumentError, message_for
from convnets.models.specs import MODEL_SPECS, list_models, registered_name
from convnets.runtime import (MEMORY_FORMAT_ALIASES, MEMORY_FORMATS, PRECISIONS, check_precision, memory_format_name,
                              resolve_device)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["WEIGHT_SOURCES", "LoadedModel", "add_arch_kwargs_argument",
           "add_device_argument", "add_engine_argument", "add_memory_format_argument",
           "add_model_argument", "add_model_arguments", "add_precision_argument",
           "device_from_args", "load_from_args", "non_negative_int",
           "parse_arch_kwargs", "positive_int", "positive_seconds"]

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


def add_model_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                       flags: Sequence[str] = ("--model",), dest: str = "model", default: str | None = None,
                       help: str | None = None) -> None:
    """Add ``--model NAME``: one of :func:`convnets.list_models` (checked by argparse).

    Args:
        parser: a parser or argument group.
        flags: the option strings, e.g. ``("--model", "--arch")`` to keep an older spelling too.
        dest: the attribute of the parsed namespace.
        default: the value when the option is not given.
        help: replaces the default help text.
    """
    names = list_models()
    parser.add_argument(*flags, dest=dest, choices=names, default=default, metavar="NAME",
                        help=help or f"architecture: {', '.join(names)}")


def add_arch_kwargs_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                             help: str | None = None) -> None:
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
    source.add_argument("--weights", metavar="FILE",
                        help="checkpoint to load: any layout convnets.load_model reads, including `convnets "
                             "train` checkpoints with their class names and image size. It defines the architecture")
    source.add_argument("--pretrained", dest="weight_source", action="store_const", const="pretrained",
                        help="NVIDIA's ImageNet weights (downloaded once and verified)"
                             + (" [default]" if default_weights == "pretrained" else ""))
    source.add_argument("--random-init", dest="weight_source", action="store_const", const="random-init",
                        help="random weights, BatchNorm statistics measured on random inputs: no download, "
                             "meaningless outputs (testing, timing)"
                             + (" [default]" if default_weights == "random-init" else ""))
    add_arch_kwargs_argument(group, help='architecture overrides with --random-init, e.g. \'{"layers": [1, 1, 1, 1]}\'')
    parser.set_defaults(weight_source=default_weights, default_model=default_model)


@dataclass(frozen=True)
class LoadedModel:
    """A model picked on the command line and where its weights came from.

    Attributes:
        model: the network, in eval mode.
        name: the registry name, or ``"resnet_custom"`` for a checkpoint of another architecture.
        weights: ``"pretrained"``, ``"random-init"`` or the checkpoint path.
    """

    model: nn.Module
    name: str
    weights: str


def load_from_args(args: argparse.Namespace, *, device: torch.device | str | None = None) -> LoadedModel:
    """Build the model that the options of :func:`add_model_arguments` describe, in eval mode.

    Args:
        args: the parsed options.
        device: where the model goes (default: the CPU).

    Raises:
        InvalidArgumentError: inconsistent options (``--arch-kwargs`` with pretrained weights, a
            checkpoint whose architecture is not ``--model``'s, no model at all).
        CheckpointError, WeightsUnavailableError: from loading.
    """
    from convnets.registry import get_model, load_model  # PyTorch only once a command runs

    if args.weights:
        if args.arch_kwargs:
            raise InvalidArgumentError("--arch-kwargs does not apply to --weights: the checkpoint defines the "
                                       "architecture")
        try:
            model = load_model(args.weights, device=device)
        except CheckpointError as e:
            if e.architecture:  # the file records an architecture that its tensors are not
                e.add_cli_advice(f"Its recorded architecture is wrong, so no --model can load it; save it again "
                                 f"with the {e.architecture} architecture recorded, or with none.")
            raise
        if args.model and model.spec != MODEL_SPECS[args.model]:
            raise InvalidArgumentError(f"{args.weights} holds a different architecture than --model {args.model} "
                                       f"({model.spec}); drop --model to use the checkpoint as it is")
        name = args.model or registered_name(model.spec) or "resnet_custom"
        return LoadedModel(model.eval(), name, str(args.weights))
    name = args.model or getattr(args, "default_model", None)
    if not name:
        raise InvalidArgumentError("--model is required unless --weights is given")
    if args.weight_source == "pretrained":
        if args.arch_kwargs:
            raise InvalidArgumentError("--arch-kwargs changes the architecture, so it needs --random-init or "
                                       "--weights")
        return LoadedModel(get_model(name, pretrained=True, device=device).eval(), name, "pretrained")
    log.warning("using randomly initialised weights (--random-init): the outputs mean nothing")
    try:
        model = get_model(name, **args.arch_kwargs)
    except (TypeError, ValueError) as e:  # an unknown field name, or a value the spec refuses
        raise InvalidArgumentError(f"--arch-kwargs: {message_for(e, 'cli')}") from e
    from convnets.deploy.calibrate import calibrate_batchnorm

    calibrate_batchnorm(model, image_size=getattr(args, "image_size", None) or 224)
    if device is not None:
        model = model.to(device)
    return LoadedModel(model.eval(), name, "random-init")


# --- run settings --------------------------------------------------------------------------------


def _device_name(text: str) -> str:
    # Only the spelling here (no PyTorch while parsing); device_from_args checks that it exists.
    if not _DEVICE.fullmatch(text):
        raise InvalidArgumentError(f"--device {text!r} is not a device: use auto, cpu, cuda or cuda:N")
    return text


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: str | None = "auto",
                        help: str | None = None) -> None:
    """Add ``--device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.

    Args:
        parser: a parser or argument group.
        default: ``"auto"``; ``None`` means the same (for configurations that store "not given").
        help: replaces the default help text.
    """
    parser.add_argument("--device", type=_argparse_type(_device_name, "device"), default=default, metavar="DEVICE",
                        help=help or "auto (default): cuda when available, else cpu; or cpu, cuda, cuda:N")


def add_engine_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                        extra_choices: Sequence[str] = (), help: str | None = None) -> None:
    """Add ``--engine``: an inference engine of :mod:`convnets.deploy.engines` or ``auto`` (default ``torch``).

    Args:
        parser: a parser or argument group.
        extra_choices: values this command adds (``benchmark``: ``all``).
        help: replaces the default help text.
    """
    from convnets.deploy.engines import AUTO, engine_names  # imports no engine and no torch

    parser.add_argument("--engine", choices=(*engine_names(), AUTO, *extra_choices), default="torch",
                        help=help or "what runs the model: torch (default; any device), onnxruntime (CPU fp32; "
                                     "the export extra), openvino (CPU fp32/bf16; the openvino extra), or auto: "
                                     "the fastest installed one for the device and precision, checked against "
                                     "the model (falls back to torch)")


def add_precision_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                           choices: Sequence[str] = PRECISIONS, default: str = "fp32", help: str | None = None) -> None:
    """Add ``--precision``: names from :data:`convnets.runtime.PRECISIONS` (a command may offer fewer).

    Args:
        parser: a parser or argument group.
        choices: the precisions this command offers, a subset of ``PRECISIONS``.
        default: the value when the option is not given.
        help: replaces the default help text.
    """
    unknown = sorted(set(choices) - set(PRECISIONS))
    if unknown:
        raise InvalidArgumentError(f"choices {unknown} are not precisions; use some of {', '.join(PRECISIONS)}")
    parser.add_argument("--precision", choices=tuple(choices), default=default,
                        help=help or "fp32 (default); bf16 (GPUs, CPUs with AVX512-BF16 or AMX); fp16 (GPUs)")


def add_memory_format_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                               default: str | None = "contiguous", help: str | None = None) -> None:
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
