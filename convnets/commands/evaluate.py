"""``convnets evaluate``: accuracy, per-class figures and the confusion matrix of a model on a labelled image set.

The evaluation loop of ``convnets train --evaluate`` (:func:`convnets.evaluation.loop.evaluate_model`),
with the model run by ``--engine`` (default ``auto``, as for ``predict``; its graph comes from the
engine cache from the second run on), on class folders or ImageNet's flat validation images with
Kaggle's or the devkit's labels (see :mod:`convnets.evaluation.data`). Prints a table;
``--output DIR`` also writes ``DIR/report.json`` and ``DIR/confusion.png``. A multi-label model
(``train --multilabel``) is evaluated on the images of ``--labels FILE.csv`` (its ``val`` rows, or all):
mAP, micro-AP, per-class AP and precision / recall / F1 at its thresholds, and ``DIR/ap.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from convnets.commands.batch_options import add_decode_argument, add_fast_decode_argument
from convnets.commands.model_options import add_model_arguments, load_from_args
from convnets.commands.options import add_force_argument, add_output_argument, batch_size, non_negative_int
from convnets.commands.path_checks import check_inputs_exist, check_output_directory, usage_errors
from convnets.commands.run_options import (add_cache_argument, add_compile_argument, add_device_argument,
                                           add_engine_argument, add_engine_settings_arguments,
                                           add_memory_format_argument, add_precision_argument, device_from_args,
                                           engine_settings_from_args)
from convnets.constants import REPORT_FILES
from convnets.fileio import preflight

_EPILOG = """\
data layouts (detected):
  DIR/<class>/*            class folders: the checkpoint's class names, or WordNet ids (n01440764, ...)
                           for 1000-class ImageNet models; DIR/val/<class>/* (convnets train's DIR) too
  DIR/*.JPEG + LOC_val_solution.csv    Kaggle's ImageNet; the CSV in DIR or up to 4 folders above
                           (DIR may be the Kaggle download itself: ILSVRC/Data/CLS-LOC/val is found)
  DIR/ILSVRC2012_val_*.JPEG + the devkit: ILSVRC2012_devkit_t12.tar.gz, torchvision's meta.bin or the
                           extracted ILSVRC2012_devkit_t12/data/ (ground truth + meta.mat), in or above DIR
  DIR + --labels FILE.csv  a multi-label model (train --multilabel): the CSV's path (relative to DIR), labels
                           (separated by ';'), optional split; its val rows (all rows without a val split)
examples:
  convnets evaluate --data imagenet/val --model se_resnext101_32x4d --pretrained --output report/
  convnets evaluate --data runs/a/data/val --weights runs/a/model_best.pth.tar --output runs/a/eval
  convnets evaluate --data DIR --labels DIR/labels.csv --weights runs/ml/model_best.pth.tar --output runs/ml/eval
  convnets evaluate --data photos/val --model se_resnext101_32x4d --pretrained --fast-decode
                           top-1 with --fast-decode: compare with the same command without it
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    from convnets.runtime import default_workers_text  # no PyTorch: os only

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    data = parser.add_argument_group("data and report")
    data.add_argument("--data", required=True, metavar="DIR", help="the labelled images (layouts below)")
    data.add_argument("--labels", metavar="FILE", default=None,
                      help="the labels file of flat ImageNet images (LOC_val_solution.csv, the devkit's .tar.gz or "
                           "data/ILSVRC2012_validation_ground_truth.txt, meta.bin); default: searched for. A "
                           "multi-label model's: the CSV of path, labels, split it was trained with (required)")
    add_output_argument(data, metavar="DIR", help="directory (created) that gets report.json and confusion.png "
                                                   "(matplotlib; a multi-label model: ap.png)")
    add_force_argument(data, what="report.json and confusion.png in DIR")
    data.add_argument("--batch-size", type=batch_size, default=64, metavar="B",
                      help="images per forward pass (default 64)")
    data.add_argument("--workers", type=non_negative_int, default=None, metavar="N",
                      help="data-loader processes; 0: decode in this process (default: as many as `convnets predict` "
                           f"starts, {default_workers_text()})")
    data.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="progress bar on stderr (default: when stderr is a terminal)")
    add_fast_decode_argument(data)
    add_decode_argument(data)
    add_model_arguments(parser, default_weights="pretrained")
    run = parser.add_argument_group("precision, device and engine")
    add_device_argument(run)
    add_precision_argument(run, help="fp32 (default); bf16 or fp16 autocast (GPUs; bf16 also on CPUs with "
                                     "AVX512-BF16 or AMX)")
    add_memory_format_argument(run, default=None, help="layout of the model and its batches (default: channels_last "
                                                      "under bf16/fp16, else contiguous)")
    add_engine_argument(run)
    add_engine_settings_arguments(run)
    add_cache_argument(run)
    add_compile_argument(run, default=False, help="faster per image on large sets, but the first batch waits for "
                                                  "the compiler (--engine torch)")


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int]:
    """Before anything heavy is imported: ``--data``, ``--labels`` and ``--weights`` exist, ``--output``
    can be written (usage errors, see :mod:`convnets.cli`); returns the run."""
    with usage_errors():
        check_inputs_exist("--data", args.data)
        check_inputs_exist("--labels", args.labels)
        check_inputs_exist("--weights", args.weights)
        if args.output is not None:
            check_output_directory(args.output)
            for name in REPORT_FILES:
                preflight(Path(args.output) / name, force=args.force)
    return lambda: run(args)


def run(args: argparse.Namespace) -> int:
    """Run ``convnets evaluate``."""
    from convnets.evaluation.loop import evaluate_model

    device = device_from_args(args)
    loaded = load_from_args(args)
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    report = evaluate_model(loaded.model, args.data, labels=args.labels, output=None, batch_size=args.batch_size,
                            workers=args.workers, device=device, precision=args.precision,
                            memory_format=args.memory_format, progress=progress, fast_decode=args.fast_decode,
                            engine=args.engine, compile=args.compile, cache=args.cache,
                            settings=engine_settings_from_args(args), decode=args.decode)
    report.source.update(model=loaded.name, weights=loaded.weights)
    print(report.table(), flush=True)
    if args.output is not None:
        files = report.write(Path(args.output), force=args.force)
        print("wrote " + ", ".join(str(f) for f in files), flush=True)
    return 0
