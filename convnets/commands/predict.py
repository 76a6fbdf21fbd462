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
                                       device_from_args, load_from_args, positive_int, positive_seconds)
from convnets.errors import ConvnetsError, InvalidArgumentError, message_for

if TYPE_CHECKING:
    from convnets.predict import Prediction

DEFAULT_MODEL = "se_resnext101_32x4d"
# convnets.preprocessing.io.DEFAULT_TIMEOUT, spelled out because that module imports PIL and requests,
# which `--help` must not wait for; tests/test_cli_errors.py checks that the two agree.
DEFAULT_TIMEOUT = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image file, directory of images, or URL")
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    # --topk is checked in run(): its limit is the number of classes of the model loaded.
    parser.add_argument("--topk", type=int, default=5, metavar="K",
                        help="classes per image, at most the model's number of classes (default 5)")
    parser.add_argument("--batch-size", type=positive_int, default=16, metavar="B",
                        help="images per forward pass (default 16)")
    parser.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"time allowed for each URL download, connecting included (default {DEFAULT_TIMEOUT:g})")
    add_device_argument(parser)
    parser.add_argument("--image-size", type=positive_int, default=None, metavar="N",
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


def _cli_message(error: BaseException | None) -> str:
    """An input's error in this command's words (see :mod:`convnets.errors`)."""
    if isinstance(error, ConvnetsError) and error.keyword == "timeout":
        error.add_cli_advice("Retry, or pass a larger --timeout.")
    return message_for(error, "cli") if error is not None else ""


def run(args: argparse.Namespace) -> int:
    """Run ``convnets predict``; exit status 1 if any input could not be read."""
    from tqdm.auto import tqdm

    from convnets.deploy.optimize import optimize_for_inference
    from convnets.predict import class_labels, expand_inputs, predict
    from convnets.preprocessing.presets import preset_for_model

    if args.topk < 1:
        raise InvalidArgumentError(f"--topk must be a positive integer, got {args.topk}")
    device = device_from_args(args)
    model = load_from_args(args, device=device).model
    labels = class_labels(model)
    if args.topk > len(labels):
        raise InvalidArgumentError(f"--topk {args.topk} is more than the {len(labels)} classes of the model; "
                                   f"use --topk {len(labels)} or less")
    preset = preset_for_model(model).with_crop_size(args.image_size or model.input_size)
    net = optimize_for_inference(model, args.precision, device=device, compile=args.compile)
    total = len(expand_inputs(args.inputs))
    show = args.progress if args.progress is not None else (sys.stderr.isatty() and total > args.batch_size)
    results, failed = [], 0
    with tqdm(total=total, unit="img", disable=not show, file=sys.stderr) as bar:
        for result in predict(net, args.inputs, labels=labels, topk=args.topk, batch_size=args.batch_size,
                              device=device, preset=preset, timeout=args.timeout, on_batch=bar.update):
            if not result.ok:
                failed += 1
                bar.clear()
                print(f"convnets predict: error: {_cli_message(result.error)}", file=sys.stderr)
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
