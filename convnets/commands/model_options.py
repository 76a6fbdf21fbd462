"""The options that choose the model, shared by every command that loads one.

They mean the same in every command:

* ``--weights FILE`` loads a checkpoint (any layout :func:`convnets.load_model` reads). The file
  defines the architecture (recorded in it, or read off its tensor shapes); ``--model`` is then
  optional and, when given, must name that same architecture: a check, never a conversion.
* otherwise ``--model NAME`` picks a registered architecture, with NVIDIA's pretrained weights
  (``--pretrained``) or random weights (``--random-init``: no download, meaningless outputs, for
  trying the tools offline and timing), whichever the command defaults to.
* ``--arch-kwargs JSON`` changes the architecture of ``--random-init`` models only.

:func:`load_from_args` builds the model they describe, by :func:`convnets.registry.choose_model`
(PyTorch is imported then, not when the options are added or parsed). ``--topk`` (``predict``,
``serve``) is capped by the model's classes: :func:`known_classes` tells them before the model is
loaded where that is cheap, :func:`resolve_topk` checks the option or picks its default.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from convnets.commands.options import Parser, argparse_type, positive_int
from convnets.constants import DEFAULT_IMAGE_SIZE, DEFAULT_TOPK
from convnets.errors import CheckpointError, InvalidArgumentError
from convnets.models.specs import MODEL_SPECS, list_models

if TYPE_CHECKING:
    import torch

    from convnets.registry import ChosenModel

__all__ = ["MODEL_OPTION_NAMES", "WEIGHT_SOURCES", "add_arch_kwargs_argument", "add_model_argument",
           "add_model_arguments", "add_pretrained_argument", "add_topk_argument", "add_weights_argument", "known_classes",
           "load_from_args", "model_name", "parse_arch_kwargs", "pretrained_classes", "resolve_topk"]

#: Where a model's weights come from when no ``--weights`` file is given.
WEIGHT_SOURCES: tuple[str, ...] = ("pretrained", "random-init")


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
                            help: str = "NVIDIA's ImageNet weights (downloaded once, then verified against the digest recorded then)") -> None:
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
    parser.add_argument("--arch-kwargs", type=argparse_type(parse_arch_kwargs, "arch_kwargs"), default={},
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
    add_pretrained_argument(source, help="NVIDIA's ImageNet weights (downloaded once, then verified against the digest recorded then)"
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


def add_topk_argument(parser: Parser, *, what: str) -> None:
    """Add ``--topk K``: ``what`` (e.g. "classes per image"), at most the model's classes; without it
    :data:`~convnets.constants.DEFAULT_TOPK`, or all the classes of a model that has fewer (:func:`resolve_topk`).
    A positive integer while parsing; its upper limit, the number of classes, once that is known."""
    parser.add_argument("--topk", type=positive_int, default=None, metavar="K",
                        help=f"{what}, at most the model's number of classes (default {DEFAULT_TOPK}, or all of them "
                             "when the model has fewer)")


def resolve_topk(topk: int | None, classes: int) -> int:
    """``--topk``, or its default for a model with ``classes`` classes: :data:`DEFAULT_TOPK` or all of them.

    Raises:
        InvalidArgumentError: an explicit ``--topk`` above ``classes``.
    """
    if topk is None:
        return min(DEFAULT_TOPK, classes)
    if topk > classes:
        raise InvalidArgumentError(f"--topk {topk} is more than the {classes} classes of the model; use --topk "
                                   f"{classes} or less")
    return topk


def pretrained_classes(args: argparse.Namespace) -> int | None:
    """The number of classes of the model when it is NVIDIA's pretrained one (``weights_manifest.json``
    says, without PyTorch); ``None`` for ``--weights`` and ``--random-init``."""
    if args.weights is not None or args.weight_source != "pretrained":
        return None
    from convnets.weights.manifest import load_manifest

    entry = load_manifest().get(args.model or args.default_model)
    return None if entry is None else entry.num_classes


def known_classes(args: argparse.Namespace) -> int | None:
    """The number of classes of the model the options describe, without building it: the manifest's for
    NVIDIA's weights, the classifier's rows in a ``--weights`` checkpoint (memory-mapped: nothing else is
    read); ``None`` for ``--random-init`` or a checkpoint that cannot be read, whose error the loading reports
    in its own words."""
    if args.weights is None:
        return pretrained_classes(args)
    from convnets.weights.load import checkpoint_classes  # PyTorch

    try:
        return checkpoint_classes(args.weights)
    except CheckpointError:
        return None
