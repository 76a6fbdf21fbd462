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

import torch
from tqdm.auto import tqdm

import convnets
from convnets.deploy.optimize import PRECISIONS, check_precision, optimize_for_inference
from convnets.predict import Prediction, class_labels, expand_inputs, predict
from convnets.preprocessing.presets import preset_for_model

HELP = "classify images (files, directories of images, http(s) URLs)"
DEFAULT_MODEL = "se_resnext101_32x4d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image file, directory of images, or URL")
    parser.add_argument("--model", choices=convnets.list_models(), default=None,
                        help=f"architecture (default: {DEFAULT_MODEL}, or whatever --weights holds)")
    parser.add_argument("--weights", metavar="FILE",
                        help="checkpoint to use instead of the NGC weights (any supported layout, "
                             "including `convnets train` checkpoints with their class names)")
    parser.add_argument("--topk", type=int, default=5, metavar="K", help="classes per image (default 5)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B", help="images per forward pass (default 16)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): cuda when available, else cpu")
    parser.add_argument("--image-size", type=int, default=None, metavar="N",
                        help="center-crop size; the shorter side is resized to N*256/224 first (default: "
                             "what the weights were trained for, 224 for the NGC weights)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). The model "
                             "runs through convnets.optimize_for_inference: BatchNorm folded, channels_last")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model too: faster per image, but the first batch waits for "
                             "the compilation, so it pays off for many images (default: off)")
    parser.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal and inputs fill "
                             "more than one batch)")


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available here; use --device cpu")
    return torch.device(choice)


def load_model(model: str | None, weights: str | None, device: torch.device) -> convnets.ResNet:
    """The model ``--model`` / ``--weights`` ask for, in eval mode on ``device``."""
    if weights and not model:
        return convnets.load_model(weights, device=device)
    return convnets.get_model(model or DEFAULT_MODEL, pretrained=True, pretrained_from_file=weights,
                              device=device).eval()


def _print_table(result: Prediction) -> None:
    print(result.input)
    for rank, top in enumerate(result.top, 1):
        print(f"  {rank}. {100 * top.probability:6.2f}%  {top.label}  [{top.index}]")


def run(args: argparse.Namespace) -> int:
    """Run ``convnets predict``; exit status 1 if any input could not be read."""
    if min(args.topk, args.batch_size, args.image_size or 1) < 1:
        raise ValueError("--topk, --batch-size and --image-size must be positive integers")
    device = _device(args.device)
    check_precision(args.precision, device)
    model = load_model(args.model, args.weights, device)
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
