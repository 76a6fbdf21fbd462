"""``convnets predict``: classify image files, directories and URLs.

Prints a table, or with ``--json`` exactly one JSON array on stdout: one object per image in
input order, ``{"input": ..., "top": [{"index", "label", "probability"}, ...]}``; ``--jsonl`` streams
one such object per line instead. A multi-label model (``train --multilabel``) gives sigmoid
probabilities, and each object adds ``"labels"``: the classes at or above their thresholds. ``--output FILE`` writes records to a file (``.jsonl``, ``.csv``,
``.parquet``: see :mod:`convnets.inference.outputs`) from the spool that grows as batches finish, and
``--resume`` continues the spool that a killed run left. Inputs that cannot be read are reported on stderr, one line each, and leave
the exit status at 1; the others are still predicted. Inputs are streamed (``--recursive`` trees,
``--from-file`` lists), so their number does not cost memory, and decoded by ``--workers`` processes
while the model runs (:mod:`convnets.inference.loader`). The options shared with ``convnets embed`` are in
:mod:`convnets.commands.batch_options`, and the run around the model (inputs, resume, progress,
errors, summary) is the batch-job driver's, :mod:`convnets.inference.job`: this module is its plug-in. ``--show FILE.png`` also draws contact sheets, thumbnails with
their top classes (:mod:`convnets.inference.sheet`). ``--ray ADDRESS`` runs the model on a Ray cluster's
actors while this process lists the inputs and writes the records, in the same order (:mod:`convnets.ray`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from convnets.commands.batch_options import (add_batch_arguments, add_input_arguments, add_output_arguments,
                                             add_progress_argument, add_ray_argument, prepare_job, ray_results)
from convnets.commands.model_options import (add_model_arguments, add_topk_argument, load_from_args,
                                             pretrained_classes, resolve_topk)
from convnets.commands.options import add_json_argument
from convnets.commands.path_checks import usage_errors
from convnets.commands.run_options import (add_cache_argument, add_compile_argument, add_device_argument,
                                           add_engine_argument, add_engine_settings_arguments, add_precision_argument,
                                           device_from_args, engine_settings_from_args)
from convnets.constants import DEFAULT_MODEL
from convnets.inference.job import BatchJob

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from convnets.inputs.listing import InputItem
    from convnets.inference.loader import Decoding
    from convnets.inference.predict import Prediction
    from convnets.inference.outputs.spool import Record, SpoolWriter
    from convnets.inference.sheet import ContactSheetWriter
    from convnets.models.resnet import ResNet

__all__ = ["add_arguments", "prepare"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_input_arguments(parser)
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    # Its upper limit, the number of classes, is checked in prepare for NVIDIA's weights (the manifest's),
    # else in PredictJob.load (the model's).
    add_topk_argument(parser, what="classes per image")
    add_device_argument(parser)
    add_precision_argument(parser, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). "
                                        "The model runs through convnets.optimize_for_inference: BatchNorm "
                                        "folded, channels_last")
    add_engine_argument(parser)
    add_engine_settings_arguments(parser)
    add_cache_argument(parser)
    add_compile_argument(parser, default=False, help="faster per image, but the first batch waits for the "
                                                     "compilation, so it pays off for many images")
    add_batch_arguments(parser, default_batch_size=16)
    where = add_output_arguments(
        parser, kind="predictions", what="the records (in input order)",
        resume_help="continue the FILE.partial.jsonl that a stopped or killed run left (or a finished FILE): its "
                    "torn last record is cut away and the inputs it records are skipped")
    add_json_argument(where, help="one array (an object per image) instead of a table")
    where.add_argument("--jsonl", action="store_true",
                       help="print one JSON object per line instead of a table, as batches finish")
    # Not one of the exclusive destinations: the sheets go with any of them.
    parser.add_argument("--show", metavar="FILE.png", default=None,
                        help="also draw contact sheets: each image as a thumbnail with its top classes (10 at most; "
                             "failed inputs: the reason), 64 per sheet, in FILE.png, FILE-2.png, ... (refused if any of "
                             "them exists), each written as soon as its images are predicted; the thumbnails are "
                             "kept as the images are decoded. With --resume: this run's inputs")
    add_progress_argument(parser)
    add_ray_argument(parser)


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int] | int:
    """Check ``--topk`` against the classes of NVIDIA's weights (the manifest's count; another model's is
    known once it is loaded), check the paths on the command line and claim ``--output`` (see
    :func:`~convnets.commands.batch_options.prepare_job`); the run's exit status is 1 if any input could
    not be read."""
    with usage_errors():
        classes = None if args.topk is None else pretrained_classes(args)  # the manifest only when it is needed
        if classes is not None:
            resolve_topk(args.topk, classes)
        if args.show is not None:
            from convnets.inference.sheet import check_sheet_destination

            check_sheet_destination(args.show, option="show")
    return prepare_job(PredictJob(args), args, stack)


class PredictJob(BatchJob):
    """``convnets predict`` as a batch job: top-k classes per input, records in JSONL, CSV or Parquet,
    a table or JSON on stdout without ``--output``, contact sheets with ``--show``."""

    command = "predict"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model: Any = None
        self.labels: list[str] = []
        self.thresholds: list[float] | None = None
        self.sheets: ContactSheetWriter | None = None
        self.printed: list[Record] = []  # --json: printed at the end, as one array

    def device(self) -> torch.device:
        import torch

        # With --ray the model is read here for its classes and preset; the actors load it onto their device.
        return torch.device("cpu") if self.args.ray is not None else device_from_args(self.args)

    def load(self, device: torch.device) -> ResNet:
        from convnets.preprocessing.classes import class_labels

        self.model = load_from_args(self.args, device=device).model
        self.labels = class_labels(self.model)
        # The optimized runner is no ResNet: the multi-label thresholds are read here, off the model.
        self.thresholds = self.model.decision_thresholds()
        self.width = resolve_topk(self.args.topk, len(self.labels))
        return self.model

    def open(self, stack: ExitStack) -> SpoolWriter | None:
        from convnets.inference.outputs.spool import SpoolWriter

        args = self.args
        if args.show is not None:  # closed (the last sheet written) when the stack unwinds without an error
            from convnets.inference.sheet import ContactSheetWriter

            self.sheets = stack.enter_context(ContactSheetWriter(args.show, timeout=args.timeout,
                                                                      allow_private=args.allow_private,
                                                                      interface="cli"))
        return SpoolWriter(sys.stdout) if args.jsonl else None

    def results(self, items: Iterator[InputItem], *, decoding: Decoding, batch_size: int, device: torch.device,
                start: int, on_batch: Callable[[int], None]) -> Iterator[Prediction]:
        from convnets.deploy.optimize import optimize_for_inference
        from convnets.inference.predict import predict_items

        args = self.args
        if args.ray is not None:
            from convnets.ray import Classifier

            return ray_results(args, Classifier, {"model": self.model, "topk": self.width}, items, decoding=decoding,
                               batch_size=batch_size, on_batch=on_batch)
        net = optimize_for_inference(self.model, args.precision, device=device, engine=args.engine,
                                     compile=args.compile, cache=args.cache, settings=engine_settings_from_args(args))
        if self.sheets is not None:  # the sheets' thumbnails, kept as the inputs are decoded: read once
            decoding = dataclasses.replace(decoding, thumbnail=self.sheets.side)
        return predict_items(net, items, labels=self.labels, topk=self.width, batch_size=batch_size,
                             device=device, decoding=decoding, start=start, on_batch=on_batch,
                             thresholds=self.thresholds)

    def record(self, result: Prediction, error: str) -> Record:
        """The record of one result (see :mod:`convnets.inference.outputs.spool`)."""
        if not result.ok:
            return {"input": result.input, "error": error}
        record: Record = {"input": result.input, "top": [{"index": t.index, "label": t.label,
                                                           "probability": t.probability} for t in result.top]}
        if result.labels is not None:  # a multi-label model: the classes above their thresholds
            record["labels"] = list(result.labels)
        return record

    def show(self, result: Prediction, record: Record) -> None:
        if self.sheets is not None:
            self.sheets.add(result)
        if not result.ok:
            return
        if self.args.json:
            self.printed.append(record)
        elif self.args.output is None and not self.args.jsonl:
            print(result)  # the name (bytes that are not UTF-8 as \udcXX), then a line per class

    def close(self) -> None:
        if self.args.json:
            print(json.dumps(self.printed, indent=2))
        if self.sheets is not None:  # stderr: stdout holds only the results
            print(f"convnets predict: contact sheets: {', '.join(map(str, self.sheets.paths)) or 'none (no inputs)'}",
                  file=sys.stderr)
