"""The options of the batch jobs, ``convnets predict`` and ``convnets embed``: inputs at scale, batches, output, progress.

Each ``add_*`` function adds one group to a command's parser (nothing heavy is imported: ``--help``
and usage errors answer at once); :func:`prepare_job` checks the paths they name and claims the
output (its lock) before PyTorch, and :func:`job_settings` turns the parsed values into the
:class:`~convnets.inference.job.JobSettings` that the batch-job driver (:mod:`convnets.inference.job`)
runs with, including the :class:`~convnets.inference.loader.Decoding` that reaches the decoder. The
model, device and precision options are :mod:`convnets.commands.model_options`' and
:mod:`convnets.commands.run_options`'.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from convnets.commands.options import (Parser, add_image_size_argument, add_output_argument, batch_size,
                                       non_negative_int, positive_seconds)
from convnets.commands.path_checks import check_inputs_exist, check_output_file, usage_errors
from convnets.constants import DECODES, DEFAULT_TIMEOUT, PRIVATE_URLS_OPTION

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import ExitStack

    from convnets.inputs.listing import InputItem, Listing
    from convnets.inference.job import BatchJob, JobSettings
    from convnets.inference.loader import Decoding
    from convnets.ray import R, Worker

__all__ = ["add_batch_arguments", "add_decode_argument", "add_fast_decode_argument", "add_input_arguments",
           "add_output_arguments", "add_private_urls_argument", "add_progress_argument", "add_ray_argument", "check_ray",
           "job_settings", "prepare_job", "ray_results"]


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``INPUT...`` and the ``inputs at scale`` group (``--recursive``, ``--from-file``);
    :func:`job_settings` carries them to the driver. At least one INPUT or ``--from-file`` is required."""
    parser.add_argument("inputs", nargs="*", metavar="INPUT",
                        help="image file, directory of images, or URL; a file or directory must exist (checked "
                             "before anything runs; URLs and --from-file lines are read when the run reaches them)")
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
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]


def add_batch_arguments(parser: argparse.ArgumentParser, *, default_batch_size: int = 16) -> None:
    """Add the ``batches`` group: ``--batch-size``, ``--workers``, ``--image-size``, ``--timeout``,
    ``--deny-private-urls``, ``--fast-decode``, ``--decode``."""
    from convnets.runtime import default_workers_text  # no PyTorch: os only

    group = parser.add_argument_group("batches")
    group.add_argument("--batch-size", type=batch_size, default=default_batch_size, metavar="B",
                       help=f"images per forward pass (default {default_batch_size})")
    group.add_argument("--workers", type=non_negative_int, default=None, metavar="N",
                       help="processes that decode and preprocess the next batches while the model runs (a "
                            "PyTorch DataLoader; same tensors, same order); 0: decode in this process, between "
                            f"batches (default: {default_workers_text()})")
    add_image_size_argument(group, default=None,
                            help="center-crop size; the shorter side is resized to PX*256/224 first (default: "
                                 "what the weights were trained for, 224 for the NGC weights)")
    group.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                       help=f"time allowed for each URL download, connecting and redirects included (default "
                            f"{DEFAULT_TIMEOUT:g})")
    add_private_urls_argument(group)
    add_fast_decode_argument(group)
    add_decode_argument(group)


def add_private_urls_argument(parser: Parser) -> None:
    """Add ``--deny-private-urls`` (``allow_private=False`` of the library's downloads)."""
    parser.add_argument(PRIVATE_URLS_OPTION, dest="allow_private", action="store_false",
                        help="refuse URLs whose host is a loopback, private or link-local address (localhost, "
                             "10.x, 192.168.x, 169.254.x, ::1, ...), also as a redirect's target: for URL lists "
                             "that come from someone else (default: fetch them, as curl and upstream do)")


def add_fast_decode_argument(parser: Parser) -> None:
    """Add ``--fast-decode`` (``predict``, ``embed``, ``evaluate``): :class:`~convnets.inference.loader.Decoding`'s
    ``fast_decode``, i.e. :func:`~convnets.preprocessing.pipeline.prepare_batch`'s."""
    parser.add_argument("--fast-decode", action="store_true",
                        help="decode JPEGs much larger than the resize target at a reduced DCT scale (1/2 to 1/8, keeping at "
                            "least twice the resize size), then resize as usual: preprocessing 12-megapixel photos takes "
                            "2.3-2.9x less CPU time, pixels 0.005 apart on average (0.07 at most, normalised); other "
                            "images are unaffected (default: exact, upstream preprocessing)")


def add_decode_argument(parser: Parser) -> None:
    """Add ``--decode {auto,cpu,device}`` (``predict``, ``embed``, ``evaluate``): :class:`~convnets.inference.loader.Decoding`'s
    ``decode`` (:mod:`convnets.preprocessing.device`)."""
    parser.add_argument("--decode", choices=DECODES, default="auto",
                        help="where JPEGs are decoded and preprocessed: 'device' reads the files on the CPU workers, then "
                             "decodes each batch's JPEGs on the model's device (nvJPEG on a GPU, torchvision's decoder "
                             "on the CPU) and resizes, crops and normalises them there, close to the 'cpu' path (Pillow, "
                             "upstream's exact numbers); PNG, WebP, greyscale, CMYK, progressive and EXIF-rotated JPEGs "
                             "go the 'cpu' path per image. 'auto' (default): 'device' with a CUDA --device, else 'cpu'")


def add_output_arguments(parser: argparse.ArgumentParser, *, kind: str, what: str, resume_help: str,
                         required: bool = False) -> argparse._ArgumentGroup:
    """Add the ``output`` group: ``--output FILE`` (its formats from :mod:`convnets.inference.outputs`'
    registry) and ``--resume``.

    Args:
        parser: the command's parser.
        kind: what the command writes, ``"predictions"`` or ``"embeddings"``.
        what: how ``--output``'s help names it.
        resume_help: how it resumes.
        required: ``--output`` must be given (no output on standard output).

    Returns:
        Without ``required``: the group of mutually exclusive destinations that holds ``--output``,
        for a command to add its standard-output formats (``predict --json``); else the ``output`` group.
    """
    from convnets.inference.outputs import output_formats

    formats = [f"{', '.join(f.suffixes)} ({f.holds[kind]})" for f in output_formats(kind)]
    again = "unless --resume" if any(kind in f.readable for f in output_formats(kind)) else "(--resume continues only a spool)"
    text = (f"write {what} to FILE, in an existing directory; its suffix picks the format: {'; '.join(formats)}. "
            "FILE appears at the end, written from FILE.partial.jsonl, which grows as batches finish (a stopped or "
            f"killed run leaves it, for --resume). An existing FILE is refused {again}. The run holds FILE.lock until "
            "it ends: a second run on FILE is refused at once")
    group = parser.add_argument_group("output")
    where = group if required else group.add_mutually_exclusive_group()
    add_output_argument(where, metavar="FILE", help=text, required=required)
    group.add_argument("--resume", action="store_true", help=resume_help)
    return where


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--progress`` / ``--no-progress`` (:func:`convnets.inference.job.progress`)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr; it counts images, with a total only when every INPUT "
                             "is a file or URL named on the command line (default: when stderr is a terminal "
                             "and the inputs may fill more than one batch)")


def add_ray_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--ray ADDRESS`` (:mod:`convnets.ray`): the model runs on a Ray cluster's actors."""
    group = parser.add_argument_group("beyond one machine")
    group.add_argument("--ray", metavar="ADDRESS", default=None,
                       help="run the model on a Ray cluster (the ray extra): auto (the one `ray start` started "
                            "here), HOST:PORT, ray://HOST:PORT, or local (a new one on this machine). Each actor "
                            "loads the model once, one per CPU (per GPU with --device cuda); this process lists the "
                            "inputs and writes the records as they come back, in the same order, with the same "
                            "options, formats and --resume as without it. The inputs must be readable where the "
                            "actors run (a shared folder, or URLs)")


def ray_results(args: argparse.Namespace, worker: type[Worker[R]], options: dict[str, Any], items: Iterator[InputItem],
                *, decoding: Decoding, batch_size: int, on_batch: Callable[[int], None]) -> Iterator[R]:
    """A batch job's results computed on the Ray cluster of ``--ray`` by ``worker`` (:mod:`convnets.ray`), built
    with ``options`` (the job's) and the model, run and decoding options; in the inputs' order."""
    from convnets.commands.run_options import engine_settings_from_args
    from convnets.ray import connect, iter_results

    connect(args.ray)
    options = {**options, "device": None if args.device == "auto" else args.device, "precision": args.precision,
               "engine": args.engine, "compile": args.compile, "cache": args.cache,
               "settings": engine_settings_from_args(args), "image_size": decoding.preset and decoding.preset.crop_size,
               "timeout": decoding.timeout, "allow_private": decoding.allow_private,
               "fast_decode": decoding.fast_decode, "interface": "cli"}
    return iter_results(worker, options, list(items), batch_size=batch_size, on_batch=on_batch)


def job_settings(args: argparse.Namespace, inputs: Listing) -> JobSettings:
    """The batch job that the options of this module describe.

    Args:
        args: parsed by a parser with all four groups.
        inputs: its INPUTs, listed (and checked) by :func:`prepare_job`.

    Returns:
        The settings, with a :class:`~convnets.inference.loader.Decoding` whose preset the driver
        fills in from the model.
    """
    from convnets.inference.job import JobSettings
    from convnets.inference.loader import Decoding

    decoding = Decoding(timeout=args.timeout, workers=args.workers, allow_private=args.allow_private,
                        fast_decode=args.fast_decode, decode=args.decode)
    return JobSettings(inputs=inputs, decoding=decoding,
                       recursive=args.recursive, from_file=args.from_file, output=args.output, resume=args.resume,
                       batch_size=args.batch_size, image_size=args.image_size, progress=args.progress)


def prepare_job(job: BatchJob, args: argparse.Namespace, stack: ExitStack) -> Callable[[], int] | int:
    """A batch job's ``prepare`` (see :mod:`convnets.cli`): before anything heavy is imported, check the
    paths that the options of this module and ``--weights`` name, then claim the output (its lock,
    held in ``stack`` until the run ends, and the job's own checks:
    :func:`convnets.inference.job.claim_output`).

    Args:
        job: the command's plug-in.
        args: parsed by a parser with this module's groups and the model options.
        stack: holds the output's lock.

    Returns:
        The run (:func:`convnets.inference.job.run_job`), or the exit status 0 when there is
        nothing to do.

    Raises:
        argparse.ArgumentError: an INPUT, ``--from-file`` list or ``--weights`` file that does not
            exist; an INPUT directory without images or file that is not an image; an ``--output`` of
            an unknown format or in a directory that is missing or cannot be written.
        InvalidArgumentError: the output is held by another run, or refused by the job's checks.
    """
    from convnets.inference.job import claim_output, run_job
    from convnets.inference.outputs import KINDS, suffixes
    from convnets.inputs.listing import Listing

    with usage_errors():
        if args.output is not None:
            check_output_file(args.output, formats=suffixes(job.kind), kind=KINDS[job.kind])
        inputs = Listing(args.inputs, recursive=args.recursive)  # each looked at once: the run resumes the walk
        check_inputs_exist("--from-file", None if args.from_file == "-" else args.from_file)
        check_inputs_exist("--weights", args.weights)
        if args.ray is not None:
            check_ray(args)
    destination = claim_output(job, output=args.output, resume=args.resume, stack=stack)
    if destination is None:
        return 0
    return lambda: run_job(job, job_settings(args, inputs), destination)


def check_ray(args: argparse.Namespace) -> None:
    """``--ray`` with what it needs: the ``ray`` extra installed, and no option that only a local run has.

    Raises:
        argparse.ArgumentError: (in :func:`usage_errors`) an option that ``--ray`` cannot honour.
        MissingDependencyError: the ``ray`` extra is missing.
    """
    import importlib.util

    if args.workers is not None:
        raise argparse.ArgumentError(None, "--workers sets this process's decoding; with --ray the actors decode "
                                           "(one batch at a time each): drop --workers")
    if getattr(args, "decode", "auto") == "device":
        raise argparse.ArgumentError(None, "--decode device decodes on this process's device, and with --ray the "
                                           "actors decode (with Pillow): drop --decode device, or --ray")
    if getattr(args, "show", None) is not None:
        raise argparse.ArgumentError(None, "--show draws contact sheets from the images this process decodes, and "
                                           "with --ray the cluster decodes them: drop --show, or --ray")
    if not args.ray.strip():
        raise argparse.ArgumentError(None, "--ray needs an address: auto, HOST:PORT, ray://HOST:PORT or local")
    if importlib.util.find_spec("ray") is None:
        from convnets.errors import MissingDependencyError
        from convnets.extras import install_hint

        raise MissingDependencyError(f"--ray needs Ray Data, which is not installed; install the 'ray' extra: "
                                     f"{install_hint('ray')}")
    from convnets.ray import check_address  # before the model loads: an unreachable cluster fails at once

    check_address(args.ray)
