"""``convnets benchmark``: throughput and latency per batch size, as in NVIDIA's published tables.

Examples::

    convnets benchmark --model resnext101_32x4d --device cuda --precision fp16 --batch-sizes 1,16,64,256
    convnets benchmark --model se_resnext101_32x4d --precision bf16 --batch-sizes 1,16 --json bench.json
    convnets benchmark --model resnext101_32x4d --no-optimize --precision bf16   # eager + autocast

Weights do not change the speed, so random weights are the default (no download).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from convnets.deploy.benchmark import benchmark_inference, environment, format_table, parse_batch_sizes
from convnets.deploy.loading import add_model_arguments, load_from_args
from convnets.deploy.optimize import PRECISIONS, check_precision, optimize_for_inference, precision_dtype

HELP = "measure inference throughput (img/s) and latency percentiles per batch size"

#: Modes offered on the command line. "training" joins once convnets.train.engine provides
#: benchmark_training (see convnets.deploy.benchmark.benchmark_training); it must time the real
#: fine-tuning step, so there is no stand-in until then.
MODES: tuple[str, ...] = ("inference",)

_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_model_arguments(parser, default_weights="random-init")
    parser.add_argument("--mode", choices=MODES, default="inference", help="what to measure (default: inference)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, bf16 (CPU with AVX512-BF16/AMX, GPU) or fp16 (GPU); eager runs use autocast")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 16, 64, 256], metavar="B1,B2,...",
                        help="comma-separated batch sizes (default: 1,16,64,256, as NVIDIA's tables)")
    parser.add_argument("--optimize", action=argparse.BooleanOptionalAction, default=True,
                        help="use convnets.optimize_for_inference (BatchNorm folding, channels_last, "
                             "compile); --no-optimize measures the plain eager model (default: optimize)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the optimized model (default: on; each batch size compiles once)")
    parser.add_argument("--memory-format", choices=sorted(_MEMORY_FORMATS), default="contiguous",
                        help="layout of the eager model and of the input batch (the optimized model "
                             "always computes in channels_last); default: contiguous")
    parser.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed calls per batch size (default: 5)")
    parser.add_argument("--iterations", type=int, default=20, metavar="N",
                        help="timed calls per batch size (default: 20)")
    parser.add_argument("--image-size", type=int, default=224, metavar="PX", help="input size (default: 224)")
    parser.add_argument("--json", metavar="FILE", help="also write the environment and results as JSON")


def _batch_sizes(text: str) -> list[int]:
    try:
        return parse_batch_sizes(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Run ``convnets benchmark``."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    check_precision(args.precision, device)
    if not args.optimize and not args.compile:
        raise ValueError("--no-compile applies to the optimized model; --no-optimize is already eager")
    loaded = load_from_args(args)
    memory_format = _MEMORY_FORMATS[args.memory_format]
    autocast_dtype = None
    if args.optimize:
        model: Any = optimize_for_inference(loaded.model, args.precision, device=device, compile=args.compile)
        variant = "optimized, " + ("compiled" if model.compiled else "eager")
    else:
        model = loaded.model.to(device=device, memory_format=memory_format)
        if args.precision != "fp32":
            autocast_dtype = precision_dtype(args.precision)
        variant = "eager" + (" autocast" if autocast_dtype else "") + f", {args.memory_format}"
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest convolution algorithms, as NVIDIA does

    results = benchmark_inference(model, args.batch_sizes, device=device, warmup=args.warmup,
                                  iterations=args.iterations, image_size=args.image_size,
                                  memory_format=memory_format, autocast_dtype=autocast_dtype)
    if args.optimize and not model.compiled and args.compile:
        variant = "optimized, eager (compilation failed)"
    env = environment(device)
    arch = " (custom architecture)" if args.arch_kwargs else ""
    title = (f"{loaded.name}{arch} {args.mode}, {env['device_name']} ({device}), {args.precision}, {variant}, "
             f"{loaded.weights} weights")
    print(format_table(results, title))
    if args.json:
        config = {"model": loaded.name, "weights": loaded.weights, "arch_kwargs": args.arch_kwargs,
                  "mode": args.mode, "precision": args.precision, "optimize": args.optimize,
                  "compile": args.compile, "compiled": bool(args.optimize and model.compiled),
                  "memory_format": args.memory_format, "batch_sizes": args.batch_sizes, "warmup": args.warmup,
                  "iterations": args.iterations, "image_size": args.image_size}
        report = {"environment": env, "config": config, "results": [r.to_dict() for r in results]}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
