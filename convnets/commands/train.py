"""``convnets train`` (also ``python -m convnets.train``): fine-tune with NVIDIA's recipe.

Every option is generated from a field of :class:`convnets.train.TrainConfig` (its type, default
and ``metadata``; see :mod:`convnets.train.config`); the defaults are the recipe's. The options
that other commands have too (``--model``, ``--weights``, ``--precision``, ``--device``, ...) come
from their shared definitions (:mod:`convnets.commands.options` and its siblings) with upstream's spellings as
aliases: ``--arch``, ``--pretrained-from-file``, ``--amp`` / ``--no-amp``. Under ``torchrun`` each process runs this command; rank 0 prints the summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Union

from convnets.commands import model_options, options, path_checks, run_options
from convnets.errors import CheckpointError, ConvnetsError, message_for
from convnets.train.config import (DEVICES, NON_NEGATIVE_INT_FIELDS, OPTION_GROUPS, POSITIVE_INT_FIELDS, TrainConfig,
                                   flag_name)

_EPILOG = """\
examples:
  convnets train --data DIR --output runs/a --model se_resnext101_32x4d --pretrained --epochs 10
  convnets train --data DIR --output runs/tiny --model resnet50 \\
      --arch-kwargs '{"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128]}' --image-size 64
  convnets train --data DIR --output runs/a --resume runs/a/checkpoint.pth.tar
  convnets train --data DIR --labels DIR/labels.csv --multilabel --output runs/ml --pretrained --epochs 10
  torchrun --nproc_per_node 8 -m convnets.train --data DIR --output runs/a --pretrained --amp
--data DIR holds train/<class>/* and val/<class>/*, or with --multilabel the images that --labels FILE.csv
lists (columns path, labels separated by ';', optional split; the classes are the sorted set of labels). --output DIR gets checkpoint.pth.tar (every epoch),
model_best.pth.tar, model_best.safetensors and metrics.jsonl; convnets.load_model of either rebuilds the model.
Also tensorboard/ (event files; tensorboard --logdir DIR) and, at the end, curves.png (convnets plot DIR
redraws it), when the tensorboard / matplotlib packages are installed.
Upstream's spellings (NVIDIA's training scripts) are aliases: --arch = --model, --pretrained-from-file =
--weights, --amp = mixed precision (fp16 on CUDA, bf16 on CPUs; --no-amp = --precision fp32).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options: ``-v`` and one flag per :class:`TrainConfig` field."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    # Also accepted after the subcommand, so that `python -m convnets.train -v ...` works.
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more log output (-vv: debug)")
    groups: dict[str, Group] = {name: parser.add_argument_group(name) for name in OPTION_GROUPS}
    # --precision and its upstream spellings --amp / --no-amp set the same two fields: one of them.
    precision = groups[DEVICES].add_mutually_exclusive_group()
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        shared = f.metadata.get("shared")
        if shared is not None:
            # An option shared between commands (_SHARED_OPTIONS): the adder gets the
            # group and the field and stores the value under f.name, with the field's default and help.
            group = precision if shared in ("precision", "amp") else groups[f.metadata["group"]]
            _SHARED_OPTIONS[shared](group, f)
        else:
            flags, kwargs = _flag(f, hints[f.name])
            groups[f.metadata["group"]].add_argument(*flags, **kwargs)


Group = Union[argparse._ArgumentGroup, argparse._MutuallyExclusiveGroup]


class _Precision(argparse.Action):
    """``--precision`` of a training run: ``fp32`` turns autocast off (``amp=False``); ``bf16`` / ``fp16``
    turn it on in that dtype (``amp=True``, ``amp_dtype``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.amp = values != "fp32"
        namespace.amp_dtype = None if values == "fp32" else values


def _add_amp(group: Group, f: dataclasses.Field[Any]) -> None:
    """Upstream's ``--amp`` (and ``--no-amp``), spellings of ``--precision`` (which shares its group)."""
    group.add_argument("--amp", dest=f.name, action=argparse.BooleanOptionalAction, default=_default(f),
                       help=f.metadata["help"])


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


#: Shared options a field may name in its ``shared`` metadata: ``name -> adder(group, field)``. The
#: adders come from convnets.commands (options, model_options, run_options), so these flags are
#: spelled and parsed as in every other command; train adds upstream's spellings as aliases
#: (``--arch``, ``--pretrained-from-file``, ``--amp``). ``--arch`` is checked when the model is built, and takes upstream's spelling
#: ``se-resnext101-32x4d`` too.
_SHARED_OPTIONS: dict[str, Callable[[Group, dataclasses.Field[Any]], None]] = {
    "model": lambda g, f: model_options.add_model_argument(g, aliases=("--arch",), dest=f.name, default=_default(f),
                                                           check=False, help=f.metadata["help"]),
    "weights": lambda g, f: model_options.add_weights_argument(g, aliases=("--pretrained-from-file",), dest=f.name,
                                                               help=f.metadata["help"]),
    "pretrained": lambda g, f: model_options.add_pretrained_argument(g, dest=f.name, help=f.metadata["help"]),
    "arch_kwargs": lambda g, f: model_options.add_arch_kwargs_argument(g, help=f.metadata["help"]),
    "precision": lambda g, f: run_options.add_precision_argument(g, aliases=("--amp-dtype",), dest=f.name,
                                                                 default=_default(f), action=_Precision,
                                                                 help=f.metadata["help"]),
    "amp": lambda g, f: _add_amp(g, f),
    "memory_format": lambda g, f: run_options.add_memory_format_argument(g, default=_default(f),
                                                                         help=f.metadata["help"]),
    "device": lambda g, f: run_options.add_device_argument(g, default=_default(f), help=f.metadata["help"]),
    "image_size": lambda g, f: options.add_image_size_argument(g, default=_default(f), help=f.metadata["help"]),
    "output": lambda g, f: options.add_output_argument(g, metavar="DIR", help=f.metadata["help"]),
}


def _flag(f: dataclasses.Field[Any], annotation: Any) -> tuple[list[str], dict[str, Any]]:
    """The ``add_argument`` arguments of one config field, from its type, default and metadata."""
    meta = f.metadata
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    flag = flag_name(f.name)
    kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
    kwargs.update({k: meta[k] for k in ("metavar", "choices") if k in meta})
    types = [t for t in typing.get_args(annotation) if t is not type(None)] or [annotation]
    if types == [bool]:
        if default is None:  # --amp / --no-amp, unset by default
            return [flag], dict(kwargs, action=argparse.BooleanOptionalAction, default=None)
        if default:  # on by default: only the flag that turns it off
            return ["--no-" + flag[2:]], dict(kwargs, action="store_false", default=True)
        return [flag], dict(kwargs, action="store_true", default=False)
    if "parse" in meta:
        kwargs["type"] = _usage_errors(meta["parse"])
    elif types[0] is int and f.name in POSITIVE_INT_FIELDS:  # counts: a usage error naming the option
        kwargs["type"] = options.positive_int
    elif types[0] is int and f.name in NON_NEGATIVE_INT_FIELDS:
        kwargs["type"] = options.non_negative_int
    elif types[0] in (int, float):
        kwargs["type"] = types[0]
    elif types[0] not in (str, Path):
        raise TypeError(f"TrainConfig.{f.name}: a {annotation} field needs a 'parse' function in its metadata")
    return [flag], dict(kwargs, default=default)


def _usage_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse shows an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(e)) from e
    convert.__name__ = parse.__name__  # argparse names the type in some messages
    return convert


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` that the parsed options describe."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def _add_cli_advice(error: BaseException, config: TrainConfig) -> None:
    """Advice in this command's words for an error whose Python advice names a call (see
    :mod:`convnets.errors`): a ``--pretrained-from-file`` checkpoint of another architecture."""
    if (isinstance(error, CheckpointError) and error.architecture and config.pretrained_from_file is not None
            and config.resume is None and error.architecture != config.arch):
        error.add_cli_advice(f"To fine-tune it, use --arch {error.architecture}.")


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int]:
    """Before anything heavy is imported: ``--data``, ``--weights`` and ``--resume`` exist, ``--output``
    can be written (usage errors, see :mod:`convnets.cli`); returns the run."""
    with path_checks.usage_errors():
        path_checks.check_inputs_exist("--data", args.data)
        path_checks.check_inputs_exist("--labels", args.labels)
        path_checks.check_inputs_exist("--weights", args.pretrained_from_file)
        path_checks.check_inputs_exist("--resume", args.resume)
        if args.output is not None:
            path_checks.check_output_directory(args.output)
    return lambda: run(args)


def run(args: argparse.Namespace) -> int:
    """Run ``convnets train``."""
    from convnets.dist import rank_world
    from convnets.train import fit  # torch.distributed and friends only when training

    config = config_from_args(args)
    rank, world = rank_world()
    try:
        summary = fit(config)
    except (ConvnetsError, OSError, ValueError) as e:
        _add_cli_advice(e, config)
        if world > 1:  # say which process failed; torchrun interleaves their stderr
            raise ConvnetsError(f"rank {rank}/{world}: {e}",
                                cli=f"rank {rank}/{world}: {message_for(e, 'cli')}") from e
        raise
    if rank == 0:
        print(summary.line(), flush=True)
    return 0
