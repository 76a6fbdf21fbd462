"""``convnets train`` (also ``python -m convnets.train``): fine-tune with NVIDIA's recipe.

Every option maps onto a field of :class:`convnets.train.TrainConfig`; the defaults are the
recipe's. Under ``torchrun`` each process runs this command; rank 0 prints the summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from convnets.errors import ConvnetsError
from convnets.registry import list_models
from convnets.train.config import BACKENDS, TrainConfig, parse_arch_kwargs

HELP = "fine-tune a model on an ImageFolder data set (NVIDIA's recipe; DDP under torchrun)"

_EPILOG = """\
examples:
  convnets train --data DIR --output runs/a --arch se_resnext101_32x4d --pretrained --epochs 10
  convnets train --data DIR --output runs/tiny --arch resnet50 \\
      --arch-kwargs '{"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128]}' --image-size 64
  convnets train --data DIR --output runs/a --resume runs/a/checkpoint.pth.tar
  torchrun --nproc_per_node 8 -m convnets.train --data DIR --output runs/a --pretrained
DIR holds train/<class>/* and val/<class>/*. OUT gets checkpoint.pth.tar (every epoch),
model_best.pth.tar and metrics.jsonl; convnets.load_model(OUT/model_best.pth.tar) rebuilds the model.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    # Also accepted after the subcommand, so that `python -m convnets.train -v ...` works.
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more log output (-vv: debug)")
    d = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(TrainConfig)})
    g = parser.add_argument_group("data and output")
    g.add_argument("--data", metavar="DIR", help="directory with train/<class>/* and val/<class>/*")
    g.add_argument("--output", metavar="OUT", help="directory for checkpoints and metrics.jsonl")
    g.add_argument("--data-backend", choices=BACKENDS, default=d.data_backend,
                   help="input pipeline (default: %(default)s; dali-* need nvidia-dali-cuda130)")
    g.add_argument("--workers", type=int, default=d.workers,
                   help="loader processes / DALI threads per training process (default: %(default)s)")
    g.add_argument("--image-size", type=int, default=d.image_size, help="crop size (default: %(default)s)")
    g = parser.add_argument_group("model")
    g.add_argument("--arch", default=d.arch, metavar="NAME",
                   help=f"one of {', '.join(list_models())} (default: %(default)s)")
    g.add_argument("--arch-kwargs", type=_json_object, default={}, metavar="JSON",
                   help='architecture overrides, e.g. \'{"layers": [1,1,1,1], "widths": [32,64,128,256]}\'')
    g.add_argument("--pretrained", action="store_true", help="start from NVIDIA's ImageNet weights")
    g.add_argument("--pretrained-from-file", metavar="PATH", help="start from the weights in this checkpoint")
    g = parser.add_argument_group("recipe")
    g.add_argument("--epochs", type=int, default=d.epochs, help="default: %(default)s")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="per process (default: %(default)s)")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, metavar="N",
                   help="micro-batches per optimizer step (default: %(default)s)")
    g.add_argument("--lr", type=float, help="peak lr (default: 0.256 x batch-size x processes x grad-accum / 256)")
    g.add_argument("--warmup-epochs", type=float,
                   help="linear warmup (default: 0 below an optimizer batch of 512, else min(8, epochs/10))")
    g.add_argument("--momentum", type=float, default=d.momentum, help="default: %(default)s")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="on conv/linear weights only (default: 1/16384 = %(default)s)")
    g.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="default: %(default)s")
    g.add_argument("--mixup", type=float, default=d.mixup, metavar="ALPHA", help="MixUp alpha, 0 = off (default)")
    g.add_argument("--ema", type=float, metavar="DECAY", help="keep and evaluate an EMA of the weights, e.g. 0.9999")
    g.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    g = parser.add_argument_group("precision and devices")
    g.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="autocast (default: on for CUDA and for CPUs with native bf16; --no-amp: fp32)")
    g.add_argument("--amp-dtype", choices=["fp16", "bf16"], help="default: fp16 on CUDA (GradScaler), bf16 on CPU")
    g.add_argument("--memory-format", choices=["nhwc", "nchw"], help="default: nhwc under AMP, else nchw")
    g.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    g = parser.add_argument_group("run")
    g.add_argument("--resume", metavar="CHECKPOINT", help="continue the run of this checkpoint")
    g.add_argument("--evaluate", action="store_true",
                   help="only validate the weights of --resume or --pretrained / --pretrained-from-file")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _json_object(text: str) -> dict[str, object]:
    try:
        return parse_arch_kwargs(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from e


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` that the parsed options describe."""
    return TrainConfig(
        data=args.data, output=args.output, arch=args.arch, arch_kwargs=args.arch_kwargs,
        pretrained=args.pretrained, pretrained_from_file=args.pretrained_from_file, epochs=args.epochs,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup_epochs=args.warmup_epochs,
        momentum=args.momentum, weight_decay=args.weight_decay, label_smoothing=args.label_smoothing,
        mixup=args.mixup, ema=args.ema, image_size=args.image_size, amp=args.amp, amp_dtype=args.amp_dtype,
        memory_format=args.memory_format, data_backend=args.data_backend, workers=args.workers,
        device=args.device, seed=args.seed, resume=args.resume, evaluate=args.evaluate, progress=args.progress)


def run(args: argparse.Namespace) -> int:
    """Run ``convnets train``."""
    from convnets.train.engine import fit  # torch.distributed and friends only when training

    config = config_from_args(args)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        summary = fit(config)
    except (ConvnetsError, OSError, ValueError) as e:
        if world > 1:  # say which process failed; torchrun interleaves their stderr
            raise ConvnetsError(f"rank {rank}/{world}: {e}") from e
        raise
    if rank == 0:
        print(summary.line(), flush=True)
    return 0
