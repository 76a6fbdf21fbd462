"""``convnets predict``: classify image files, directories and URLs.

Prints a table, or with ``--json`` exactly one JSON array on stdout: one object per image in
input order, ``{"input": ..., "top": [{"index", "label", "probability"}, ...]}``. Inputs that
cannot be read are reported on stderr, one line each, and leave the exit status at 1; the others
are still predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from convnets.commands.options import (add_device_argument, add_model_arguments, add_precision_argument,
                                       device_from_args, load_from_args)
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    from convnets.predict import Prediction

DEFAULT_MODEL = "se_resnext101_32x4d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image file, directory of images, or URL")
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    parser.add_argument("--topk", type=int, default=5, metavar="K", help="classes per image (default 5)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B", help="images per forward pass (default 16)")
    add_device_argument(parser)
    parser.add_argument("--image-size", type=int, default=None, metavar="N",
                        help="center-crop size; the shorter side is resized to N*256/224 first (default: "
                             "what the weights were trained for, 224 for the NGC weights)")
    add_precision_argument(parser, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). "
                                        "The model runs through convnets.optimize_for_inference: BatchNorm "
                                        "folded, channels_last")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model too: faster per image, but the first batch waits for "
                             "the compilation, so it pays off for many images (default: off)")
    parser.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal and inputs fill "
                             "more than one batch)")


def _print_table(result: Prediction) -> None:
    print(result.input)
    for rank, top in enumerate(result.top, 1):
        print(f"  {rank}. {100 * top.probability:6.2f}%  {top.label}  [{top.index}]")


def run(args: argparse.Namespace) -> int:
    """Run ``convnets predict``; exit status 1 if any input could not be read."""
    from tqdm.auto import tqdm

    from convnets.deploy.optimize import optimize_for_inference
    from convnets.predict import class_labels, expand_inputs, predict
    from convnets.preprocessing.presets import preset_for_model

    if min(args.topk, args.batch_size, args.image_size or 1) < 1:
        raise InvalidArgumentError("--topk, --batch-size and --image-size must be positive integers")
    device = device_from_args(args)
    model = load_from_args(args, device=device).model
    preset = preset_for_model(model).with_crop_size(args.image_size or model.input_size)
    net = optimize_for_inference(model, args.precision, device=device, compile=args.compile)
    total = len(expand_inputs(args.inputs))
    show = args.progress if args.progress is not None else (sys.stderr.isatty() and total > args.batch_size)
    results, failed = [], 0
    with tqdm(total=total, unit="img", disable=not show, file=sys.stderr) as bar:
        for result in predict(net, args.inputs, labels=class_labels(model), topk=args.topk,
                              batch_size=args.batch_size, device=device, preset=preset, on_batch=bar.update):
            if not result.ok:
                failed += 1
                bar.clear()
                print(f"convnets predict: error: {result.error}", file=sys.stderr)
            elif args.json:
                results.append({"input": result.input, "top": [
                    {"index": t.index, "label": t.label, "probability": t.probability} for t in result.top]})
            else:
                _print_table(result)
    if args.json:
        print(json.dumps(results, indent=2))
    if failed:
        print(f"convnets predict: {failed} of {total} inputs could not be read", file=sys.stderr)
    return 1 if failed else 0
