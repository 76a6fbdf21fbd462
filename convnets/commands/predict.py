"""``convnets predict``: classify image files, directories and URLs.

Prints a table, or with ``--json`` exactly one JSON array on stdout: one object per image in
input order, ``{"input": ..., "top": [{"index", "label", "probability"}, ...]}``; ``--jsonl`` streams
one such object per line instead. ``--output FILE`` writes records to a file as batches finish
(``.jsonl``, ``.csv``, ``.parquet``: see :mod:`convnets.records`), and ``--resume`` continues one
that a killed run left. Inputs that cannot be read are reported on stderr, one line each, and leave
the exit status at 1; the others are still predicted. Inputs are streamed (``--recursive`` trees,
``--from-file`` lists), so their number does not cost memory. Under ``torchrun`` each process
predicts its share of the batches into a part of ``--output`` (required there) and rank 0 merges the
parts into it at the end: the file one process writes (see :mod:`convnets.shard`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, TextIO

from convnets.commands.options import (add_device_argument, add_engine_argument, add_model_arguments,
                                       add_precision_argument, device_from_args, load_from_args, positive_int,
                                       positive_seconds)
from convnets.errors import ConvnetsError, InvalidArgumentError, message_for

if TYPE_CHECKING:
    from convnets.predict import InputItem, Prediction

DEFAULT_MODEL = "se_resnext101_32x4d"
# convnets.preprocessing.io.DEFAULT_TIMEOUT, spelled out because that module imports PIL and requests,
# which `--help` must not wait for; tests/test_cli_errors.py checks that the two agree.
DEFAULT_TIMEOUT = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="image file, directory of images, or URL")
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
    add_engine_argument(parser)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model too: faster per image, but the first batch waits for "
                             "the compilation, so it pays off for many images (default: off)")
    _add_input_arguments(parser)
    _add_output_arguments(parser)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr; it counts images, with a total only when every INPUT "
                             "is a file or URL named on the command line (default: when stderr is a terminal "
                             "and the inputs may fill more than one batch)")


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("inputs at scale")
    group.add_argument("--recursive", action="store_true",
                       help="search directories' subfolders too, depth first in sorted order (default: only the "
                            "images directly inside). Hidden files and folders (.name, ._name) are always skipped")
    group.add_argument("--from-file", metavar="LIST", default=None,
                       help="read more inputs from LIST, one path, directory or URL per line ('-': standard "
                            "input), after the INPUTs; blank lines and lines starting with '#' are skipped")
    # At least one INPUT or --from-file: checked after parsing, still as a usage error (exit 2, no torch).
    parse = parser.parse_known_args

    def parse_known_args(args: list[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = parse(args, namespace)
        if not parsed.inputs and parsed.from_file is None:
            parser.error("the following arguments are required: INPUT (or --from-file LIST)")
        return parsed, rest
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    where.add_argument("--jsonl", action="store_true",
                       help="print one JSON object per line instead of a table, as batches finish")
    where.add_argument("--output", metavar="FILE", default=None,
                       help="write records to FILE as batches finish, in input order; its suffix picks the "
                            "format: .jsonl, .csv (input, rank, index, label, probability, error) or .parquet "
                            "(needs pyarrow). An existing FILE is refused unless --resume")
    group.add_argument("--resume", action="store_true",
                       help="continue an existing --output FILE (.jsonl or .csv) that a stopped or killed run "
                            "left: its torn last record is cut away and the inputs it records are skipped")


def _print_table(result: Prediction) -> None:
    print(result.input)
    for rank, top in enumerate(result.top, 1):
        print(f"  {rank}. {100 * top.probability:6.2f}%  {top.label}  [{top.index}]")


def _cli_message(error: BaseException | None) -> str:
    """An input's error in this command's words (see :mod:`convnets.errors`)."""
    if isinstance(error, ConvnetsError) and error.keyword == "timeout":
        error.add_cli_advice("Retry, or pass a larger --timeout.")
    return message_for(error, "cli") if error is not None else ""


def _read_list(stream: TextIO) -> Iterator[str]:
    """Inputs listed one per line; blank lines and ``#`` comments skipped."""
    for line in stream:
        line = line.strip()
        if line and not line.startswith("#"):
            yield line


def _sources(args: argparse.Namespace, stack: ExitStack) -> Iterator[str]:
    """The INPUTs, then the lines of --from-file, lazily."""
    yield from args.inputs
    if args.from_file == "-":
        yield from _read_list(sys.stdin)
    elif args.from_file is not None:
        try:
            stream = stack.enter_context(open(args.from_file, encoding="utf-8"))
        except OSError as e:
            raise InvalidArgumentError(f"--from-file {args.from_file}: cannot read it ({e.strerror})") from e
        yield from _read_list(stream)


def _skip_recorded(items: Iterator[InputItem], recorded: Iterator[str], output: str) -> Iterator[InputItem]:
    """``items`` after those that ``recorded`` (the resumed file's inputs) already holds, in order.

    The file must hold a prefix of this run's inputs: anything else (the inputs changed, or the file
    belongs to another run) would record some inputs twice or never, so it is refused.
    """
    for position, name in enumerate(recorded, 1):
        item = next(items, None)
        if item is None or item[0] != name:
            now = f"the inputs now give {item[0]!r} there" if item else "the inputs now end before it"
            raise InvalidArgumentError(f"--resume: {output} records {name!r} as input {position} but {now}; "
                                       "resume with the same inputs and options, or write a new --output")
    return items


def _record(result: Prediction, error: str) -> dict:
    """The record of one result (see :mod:`convnets.records`); ``error``: its message, if it failed."""
    if not result.ok:
        return {"input": result.input, "error": error}
    return {"input": result.input,
            "top": [{"index": t.index, "label": t.label, "probability": t.probability} for t in result.top]}


def run(args: argparse.Namespace) -> int:
    """Run ``convnets predict``; exit status 1 if any input could not be read."""
    from convnets.records import RecordWriter, check_destination, open_writer, recorded_inputs, scan
    from convnets.shard import ShardedRun

    # Before PyTorch and the model load: a wrong --output fails at once.
    if args.resume and args.output is None:
        raise InvalidArgumentError("--resume continues an --output FILE: pass --output too")
    # Under torchrun, this process's shard of the inputs and its part of --output (see convnets.shard).
    sharded = ShardedRun.from_env(output=args.output, batch_size=args.batch_size, reads_stdin=args.from_file == "-")
    output = None if args.output is None else sharded.part(args.output)
    if args.output is not None:
        check_destination(args.output, resume=args.resume)
        if sharded.world > 1:
            check_destination(output, resume=args.resume)

    from tqdm.auto import tqdm

    from convnets.deploy.optimize import optimize_for_inference
    from convnets.predict import class_labels, iter_inputs, predict_items
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
        items = sharded.items(iter_inputs(_sources(args, stack), recursive=args.recursive))
        done = found.records if found else 0
        if done:
            items = _skip_recorded(items, recorded_inputs(output, topk=args.topk), str(output))
        # The total is known without listing anything only when every input is a file or URL named on
        # the command line; otherwise the bar counts without one (listing a tree twice costs time).
        total = None if args.recursive or args.from_file is not None or any(
            _is_directory(i) for i in args.inputs) else sharded.count(len(args.inputs))
        # Under torchrun only rank 0 shows a bar, counting its own shard.
        show = sharded.is_main and (args.progress if args.progress is not None else (
            sys.stderr.isatty() and (total is None or total > args.batch_size)))
        results, failed = [], 0

        def on_batch(count: int) -> None:
            if writer is not None:
                writer.flush()
            bar.update(count)
        with tqdm(total=total, initial=done, unit="img", disable=not show, file=sys.stderr) as bar:
            for result in predict_items(net, items, labels=labels, topk=args.topk, batch_size=args.batch_size,
                                        device=device, preset=preset, timeout=args.timeout, on_batch=on_batch,
                                        start=done):
                done += 1
                error = _cli_message(result.error)  # once: it adds command-line advice to the error
                if writer is not None:
                    writer.write(_record(result, error))
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
    earlier = found.errors if found else 0
    # Under torchrun: totals over the ranks, and rank 0 merges the parts into --output.
    failed, earlier, done = sharded.finish([failed, earlier, done])
    if (failed or earlier) and sharded.is_main:
        also = f" ({earlier} recorded by the earlier run)" if earlier else ""
        print(f"convnets predict: {failed + earlier} of {done} inputs could not be read{also}", file=sys.stderr)
    sharded.close()
    return 1 if failed or earlier else 0


def _is_directory(item: str) -> bool:
    from convnets.preprocessing.io import is_url

    return not is_url(item) and os.path.isdir(item)
