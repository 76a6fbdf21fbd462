"""``convnets predict``: classify image files, directories and URLs.

Prints a table, or with ``--json`` exactly one JSON array on stdout: one object per image in
input order, ``{"input": ..., "top": [{"index", "label", "probability"}, ...]}``; ``--jsonl`` streams
one such object per line instead. ``--output FILE`` writes records to a file as batches finish
(``.jsonl``, ``.csv``, ``.parquet``: see :mod:`convnets.inference.records`), and ``--resume`` continues one
that a killed run left. Inputs that cannot be read are reported on stderr, one line each, and leave
the exit status at 1; the others are still predicted. Inputs are streamed (``--recursive`` trees,
``--from-file`` lists), so their number does not cost memory, and decoded by ``--workers`` processes
while the model runs (:mod:`convnets.inference.loader`). The options shared with ``convnets embed`` are in
:mod:`convnets.commands.options`. ``--show FILE.png`` also draws contact sheets, thumbnails with
their top classes (:mod:`convnets.inference.sheet`). Under ``torchrun`` each process predicts its share of
the batches into a part of ``--output`` (required there) and rank 0 merges the parts into it at the
end: the file one process writes (see :mod:`convnets.inference.shard`).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING

from convnets.commands.options import (add_batch_arguments, add_compile_argument, add_device_argument,
                                       add_engine_argument, add_json_argument, add_input_arguments, add_model_arguments,
                                       add_output_arguments, add_precision_argument, add_progress_argument,
                                       device_from_args, input_error_message, load_from_args, progress_from_args,
                                       sources_from_args, skip_recorded, workers_from_args)
from convnets.constants import DEFAULT_MODEL
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    from convnets.inference.predict import Prediction
    from convnets.inference.sheet import ContactSheetWriter

__all__ = ["add_arguments", "run"]



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_input_arguments(parser)
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    # --topk is checked in run(): its limit is the number of classes of the model loaded.
    parser.add_argument("--topk", type=int, default=5, metavar="K",
                        help="classes per image, at most the model's number of classes (default 5)")
    add_device_argument(parser)
    add_precision_argument(parser, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). "
                                        "The model runs through convnets.optimize_for_inference: BatchNorm "
                                        "folded, channels_last")
    add_engine_argument(parser)
    add_compile_argument(parser, default=False, help="faster per image, but the first batch waits for the "
                                                     "compilation, so it pays off for many images")
    add_batch_arguments(parser, default_batch_size=16)
    where = add_output_arguments(
        parser, output_help="write records to FILE as batches finish, in input order; its suffix picks the "
                            "format: .jsonl, .csv (input, rank, index, label, probability, error) or .parquet "
                            "(needs pyarrow). An existing FILE is refused unless --resume",
        resume_help="continue an existing --output FILE (.jsonl or .csv) that a stopped or killed run "
                    "left: its torn last record is cut away and the inputs it records are skipped")
    add_json_argument(where, help="one array (an object per image) instead of a table")
    where.add_argument("--jsonl", action="store_true",
                       help="print one JSON object per line instead of a table, as batches finish")
    # Not one of the exclusive destinations: the sheets go with any of them.
    parser.add_argument("--show", metavar="FILE.png", default=None,
                        help="also draw contact sheets: each image as a thumbnail with its top classes (10 at most; "
                             "failed inputs: the reason), 64 per sheet, in FILE.png, FILE-2.png, ...; images are "
                             "read again for their thumbnails (URLs downloaded again). With --resume: this run's "
                             "inputs")
    add_progress_argument(parser)


def _print_table(result: Prediction) -> None:
    print(result.input)
    for rank, top in enumerate(result.top, 1):
        print(f"  {rank}. {100 * top.probability:6.2f}%  {top.label}  [{top.index}]")


def _record(result: Prediction, error: str) -> dict:
    """The record of one result (see :mod:`convnets.inference.records`); ``error``: its message, if it failed."""
    if not result.ok:
        return {"input": result.input, "error": error}
    return {"input": result.input,
            "top": [{"index": t.index, "label": t.label, "probability": t.probability} for t in result.top]}


def run(args: argparse.Namespace) -> int:
    """Run ``convnets predict``; exit status 1 if any input could not be read."""
    from convnets.inference.records import RecordWriter, check_destination, open_writer, recorded_inputs, scan
    from convnets.inference.shard import ShardedRun

    # Before PyTorch and the model load: a wrong --output fails at once.
    if args.resume and args.output is None:
        raise InvalidArgumentError("--resume continues an --output FILE: pass --output too")
    # Under torchrun, this process's shard of the inputs and its part of --output (see convnets.inference.shard).
    sharded = ShardedRun.from_env(output=args.output, batch_size=args.batch_size, reads_stdin=args.from_file == "-")
    output = None if args.output is None else sharded.part(args.output)
    if args.output is not None:
        check_destination(args.output, resume=args.resume)
        if sharded.world > 1:
            check_destination(output, resume=args.resume)
    if args.show is not None:
        if sharded.world > 1:  # each rank sees only its shard; one process must draw them all
            raise InvalidArgumentError("--show draws the contact sheets in one process, not under torchrun; "
                                       "drop --show here and draw sheets from a single-process run")
        from convnets.inference.sheet import check_sheet_destination
        check_sheet_destination(args.show, option="show")

    from tqdm.auto import tqdm

    from convnets.deploy.optimize import optimize_for_inference
    from convnets.inference.predict import class_labels, iter_inputs, predict_items
    from convnets.preprocessing.presets import preset_for_model
    if args.topk < 1:
        raise InvalidArgumentError(f"--topk must be a positive integer, got {args.topk}")
    device = sharded.join(device_from_args(args), resume=args.resume, repair=lambda path: scan(path, topk=args.topk))
    model = load_from_args(args, device=device).model
    labels = class_labels(model)
    if args.topk > len(labels):
        raise InvalidArgumentError(f"--topk {args.topk} is more than the {len(labels)} classes of the model; "
                                   f"use --topk {len(labels)} or less")
    preset = preset_for_model(model).with_crop_size(args.image_size or model.input_size)
    net = optimize_for_inference(model, args.precision, device=device, engine=args.engine, compile=args.compile)

    with ExitStack() as stack:
        writer, found = None, None
        if args.output is not None:
            writer, found = open_writer(output, resume=args.resume, topk=args.topk, stack=stack)
        elif args.jsonl:
            writer = RecordWriter(sys.stdout, "jsonl")
        sheets = _open_sheets(args, stack)
        items = sharded.items(iter_inputs(sources_from_args(args, stack), recursive=args.recursive))
        done = found.records if found else 0
        if done:
            items = skip_recorded(items, recorded_inputs(output, topk=args.topk), str(output))
        total, show = progress_from_args(args, sys.stderr.isatty(), sharded)
        results, failed = [], 0

        def on_batch(count: int) -> None:
            if writer is not None:
                writer.flush()
            bar.update(count)
        with tqdm(total=total, initial=done, unit="img", disable=not show, file=sys.stderr) as bar:
            for result in predict_items(net, items, labels=labels, topk=args.topk, batch_size=args.batch_size,
                                        device=device, preset=preset, timeout=args.timeout, on_batch=on_batch,
                                        start=done, workers=workers_from_args(args, device)):
                done += 1
                error = input_error_message(result.error)  # once: it adds command-line advice to the error
                if writer is not None:
                    writer.write(_record(result, error))
                if sheets is not None:
                    sheets.add(result)
                if not result.ok:
                    failed += 1
                    bar.clear()
                    # One write per line: print() writes the text and its newline separately, and under
                    # torchrun the ranks share stderr, so their lines would interleave.
                    sys.stderr.write(f"convnets predict: error: {error}\n")
                elif args.json:
                    results.append(_record(result, error))
                elif writer is None:
                    _print_table(result)
    if args.json:
        print(json.dumps(results, indent=2))
    if sheets is not None:  # stderr: stdout holds only the results
        print(f"convnets predict: contact sheets: {', '.join(map(str, sheets.paths)) or 'none (no inputs)'}",
              file=sys.stderr)
    earlier = found.errors if found else 0
    # Under torchrun: totals over the ranks, and rank 0 merges the parts into --output.
    failed, earlier, done = sharded.finish([failed, earlier, done])
    if (failed or earlier) and sharded.is_main:
        also = f" ({earlier} recorded by the earlier run)" if earlier else ""
        print(f"convnets predict: {failed + earlier} of {done} inputs could not be read{also}", file=sys.stderr)
    sharded.close()
    return 1 if failed or earlier else 0


def _open_sheets(args: argparse.Namespace, stack: ExitStack) -> ContactSheetWriter | None:
    """The --show writer, closed (the last sheet written) when ``stack`` unwinds without an error."""
    if args.show is None:
        return None
    from convnets.inference.sheet import ContactSheetWriter

    return stack.enter_context(ContactSheetWriter(args.show, timeout=args.timeout, interface="cli"))
