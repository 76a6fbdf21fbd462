"""``convnets benchmark``: throughput and latency per batch size, as in NVIDIA's published tables.

Examples::

    convnets benchmark --model resnext101_32x4d --device cuda --precision fp16 --batch-sizes 1,16,64,256
    convnets benchmark --model se_resnext101_32x4d --precision bf16 --batch-sizes 1,16 --output bench.json
    convnets benchmark --model resnext101_32x4d --no-optimize --precision bf16   # eager + autocast
    convnets benchmark --model resnext101_32x4d --engine all --batch-sizes 1,16  # every installed engine
    convnets benchmark --model se_resnext101_32x4d --mode training --device cuda --precision fp16 \
        --memory-format channels_last --batch-sizes 128                        # the fine-tuning step

Weights do not change the speed, so random weights are the default (no download). ``--output FILE``
writes the environment, configuration and results as JSON (an existing FILE only with ``--force``); ``--json`` prints that JSON on stdout
instead of the table (``--json FILE``, which wrote the file and printed the table, still does).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from convnets.commands.model_options import add_model_arguments, load_from_args
from convnets.commands.options import (add_force_argument, add_image_size_argument, add_json_argument,
                                       add_output_argument, bounded_int, positive_int)
from convnets.commands.path_checks import check_inputs_exist, check_output_file, usage_errors
from convnets.commands.run_options import (add_cache_argument, add_compile_argument, add_device_argument,
                                           add_engine_argument, add_engine_settings_arguments,
                                           add_memory_format_argument, add_precision_argument, device_from_args,
                                           engine_settings_from_args)
from convnets.constants import DEFAULT_IMAGE_SIZE, MAX_BATCH_SIZE
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from convnets.deploy.benchmark import BatchResult

log = logging.getLogger(__name__)

#: inference: the model's forward pass (eager or optimized); training: the fine-tuning loop's real
#: optimizer step (convnets.train.benchmark_training) on synthetic data.
MODES: tuple[str, ...] = ("inference", "training")
#: ``--engine all``: every installed engine that runs the precision on the device, side by side.
ALL = "all"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_model_arguments(parser, default_weights="random-init")
    parser.add_argument("--mode", choices=MODES, default="inference",
                        help="inference (default): forward passes; training: the fine-tuning loop's optimizer "
                             "step (forward under autocast, loss, backward, SGD) with random weights and data; "
                             "--optimize/--compile apply to inference only")
    add_device_argument(parser)
    add_precision_argument(parser, help="fp32 (default), bf16 (CPU with AVX512-BF16/AMX, GPU) or fp16 (GPU); "
                                        "eager runs use autocast")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 16, 64, 256], metavar="B1,B2,...",
                        help="comma-separated batch sizes (default: 1,16,64,256, as NVIDIA's tables; each at most "
                             f"{MAX_BATCH_SIZE})")
    parser.add_argument("--optimize", action=argparse.BooleanOptionalAction, default=True,
                        help="use convnets.optimize_for_inference (BatchNorm folding, channels_last, "
                             "compile); --no-optimize measures the plain eager model (default: optimize)")
    add_engine_argument(parser, extra_choices={ALL: "every installed engine in one table, the one auto picks marked"},
                        help="what runs the optimized model")
    add_engine_settings_arguments(parser)
    add_cache_argument(parser)
    add_compile_argument(parser, default=True, help="the torch engine's optimized model, once per batch size")
    add_memory_format_argument(parser, help="layout of the eager model and of the input batch (the optimized "
                                            "model always computes in channels_last); default: contiguous; "
                                            "nchw / nhwc are aliases")
    parser.add_argument("--warmup", type=positive_int, default=5, metavar="N",
                        help="untimed calls per batch size (default: 5)")
    parser.add_argument("--iterations", type=positive_int, default=20, metavar="N",
                        help="timed calls per batch size (default: 20)")
    add_image_size_argument(parser, default=DEFAULT_IMAGE_SIZE, help=f"input size (default: {DEFAULT_IMAGE_SIZE})")
    add_output_argument(parser, metavar="FILE", help="the JSON file (written) that gets the environment, configuration "
                                                     "and results, besides the table")
    add_json_argument(parser, help="the environment, configuration and results", file_option="--output")
    add_force_argument(parser, what="the --output FILE")


def _batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: comma-separated integers from 1 to :data:`~convnets.constants.MAX_BATCH_SIZE`,
    no empty entries (``1,,2`` is refused: a typo, not a list of two)."""
    parts = text.split(",")
    rule = f"batch sizes must be comma-separated positive integers of at most {MAX_BATCH_SIZE}"
    if not text.strip() or any(not part.strip() for part in parts):
        raise argparse.ArgumentTypeError(f"{rule}, such as 1,16,64 (no empty entries); got {text[:60]!r}")
    sizes = []
    for part in parts:
        try:
            sizes.append(bounded_int(part, MAX_BATCH_SIZE))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{rule}; got {part.strip()[:40]!r} in {text[:60]!r}") from None
    return sizes


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int]:
    """Before anything heavy is imported: ``--weights`` exists, ``--output`` (and the older ``--json
    FILE``) can be written (usage errors, see :mod:`convnets.cli`); returns the run."""
    from convnets.fileio import preflight

    with usage_errors():
        check_inputs_exist("--weights", args.weights)
        for option, path in _files(args):
            check_output_file(path, option=option)
            preflight(path, force=args.force, option=option)  # at once, not after the measurements
    return lambda: run(args)


def _files(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The JSON files to write: ``(option without its dashes, path)`` of ``--output`` and the older ``--json FILE``."""
    return [(option, path) for option, path in (("output", args.output), ("json", args.json))
            if isinstance(path, str)]


def run(args: argparse.Namespace) -> int:
    """Run ``convnets benchmark``."""
    import torch

    from convnets.deploy.benchmark import environment, format_engine_table, format_table
    from convnets.deploy.engines.runner import num_threads
    from convnets.fileio import write_output

    if isinstance(args.json, str):
        log.warning("--json FILE is the older spelling of --output FILE; use --output %s", args.json)
    device = device_from_args(args)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest convolution algorithms, as NVIDIA does
    picked = None
    # --threads: the engines get it (settings=); the eager model and the training step run under it here.
    with num_threads(args.threads):
        if args.mode == "training":
            results, name, weights, variant = _training(args, device)
            runs = [("torch", results)]
        else:
            runs, name, weights, variant, picked = _inference(args, device)
    env = environment(device)
    arch = " (custom architecture)" if args.arch_kwargs else ""
    title = (f"{name}{arch} {args.mode}, {env['device_name']} ({device}), {args.precision}, {variant}, "
             f"{weights} weights")
    if args.json is not True:  # --json alone: the JSON replaces the table
        if args.mode == "inference" and args.engine == ALL:
            print(format_engine_table([(engine, r) for engine, results in runs for r in results], title, picked))
        else:
            print(format_table(runs[0][1], title))
    if args.json or args.output:
        config = {"model": name, "weights": weights, "arch_kwargs": args.arch_kwargs, "mode": args.mode,
                  "precision": args.precision, "variant": variant, "optimize": args.optimize,
                  "compile": args.compile, "compiled": "compiled" in variant, "memory_format": args.memory_format,
                  "batch_sizes": args.batch_sizes, "warmup": args.warmup, "iterations": args.iterations,
                  "image_size": args.image_size, "threads": args.threads}
        if args.mode == "inference":
            config |= {"engine": args.engine, "engines": [engine for engine, _ in runs], "auto_picks": picked}
        rows = [r.to_dict() | ({"engine": engine} if args.mode == "inference" else {})
                for engine, results in runs for r in results]
        text = json.dumps({"environment": env, "config": config, "results": rows}, indent=2) + "\n"
        for option, path in _files(args):
            write_output(path, lambda f: f.write(text.encode("utf-8")), force=args.force, option=option)
        if args.json is True:
            print(text, end="")
    return 0


Runs = list[tuple[str, "list[BatchResult]"]]


def _inference(args: argparse.Namespace, device: torch.device) -> tuple[Runs, str, str, str, str | None]:
    """Measure the engine(s) asked for: ``(runs, model name, weights, variant, auto's pick or None)``."""
    from convnets.deploy.benchmark import benchmark_inference
    from convnets.deploy.engines import AUTO, available_engines
    from convnets.deploy.optimize import optimize_for_inference
    from convnets.runtime import parse_memory_format, precision_dtype

    if not args.optimize and not args.compile:
        raise InvalidArgumentError("--no-compile applies to the optimized model; --no-optimize is already eager")
    if not args.optimize and args.engine not in ("torch", AUTO):  # auto, the default: nothing to pick from
        raise InvalidArgumentError(f"--engine {args.engine} runs the optimized model; drop --no-optimize to "
                                   f"measure it, or drop --engine {args.engine} to measure the plain eager model")
    loaded = load_from_args(args)
    memory_format = parse_memory_format(args.memory_format, option="--memory-format")

    def measure(model: Any, autocast_dtype: torch.dtype | None = None) -> list[BatchResult]:
        return benchmark_inference(model, args.batch_sizes, device=device, warmup=args.warmup,
                                   iterations=args.iterations, image_size=args.image_size,
                                   memory_format=memory_format, autocast_dtype=autocast_dtype)

    if not args.optimize:
        autocast_dtype = precision_dtype(args.precision) if args.precision != "fp32" else None
        eager = loaded.model.to(device=device, memory_format=memory_format)  # type: ignore[call-overload]  # torch's stubs lack Module.to's device + memory_format overload
        results = measure(eager, autocast_dtype)
        variant = "eager" + (" autocast" if autocast_dtype else "") + f", {args.memory_format}"
        return [("torch", results)], loaded.name, loaded.weights, variant, None

    def optimized(engine: str) -> Any:
        return optimize_for_inference(loaded.model, args.precision, device=device, engine=engine,
                                      compile=args.compile, cache=args.cache,
                                      settings=engine_settings_from_args(args))

    if args.engine == ALL:
        auto = optimized(AUTO)  # built first: its engine's row reuses it
        runs = [(engine, measure(auto if engine == auto.engine else optimized(engine)))
                for engine in available_engines(args.precision, device)]
        return runs, loaded.name, loaded.weights, "optimized, every installed engine", auto.engine
    model = optimized(args.engine)
    results = measure(model)
    if model.engine != "torch":
        variant = f"optimized, {model.engine} engine"
    elif model.compiled:
        variant = "optimized, compiled"
    else:
        variant = "optimized, eager" + (" (compilation failed)" if args.compile else "")
    if args.engine == AUTO:
        variant += f" (picked by --engine {AUTO})"
    return [(model.engine, results)], loaded.name, loaded.weights, variant, model.engine if args.engine == AUTO else None


def _training(args: argparse.Namespace, device: torch.device) -> tuple[list[BatchResult], str, str, str]:
    from convnets.deploy.benchmark import summarize
    from convnets.train.benchmark import benchmark_training  # the training stack only when asked for

    if args.weights:
        raise InvalidArgumentError("--mode training times the training step of a fresh model (weights do not "
                                   "change its speed); drop --weights")
    if not args.model:
        raise InvalidArgumentError("--model is required")
    results = []
    for batch_size in args.batch_sizes:
        r = benchmark_training(args.model, batch_size=batch_size, device=device,
                               amp_dtype=None if args.precision == "fp32" else args.precision,
                               memory_format=args.memory_format,
                               steps=args.iterations, warmup=args.warmup, arch_kwargs=args.arch_kwargs,
                               image_size=args.image_size)
        results.append(summarize(batch_size, r["step_ms"]))
    amp = "fp32" if args.precision == "fp32" else f"{args.precision} autocast"
    return results, args.model, "random-init", f"fine-tuning step ({amp}), {args.memory_format}"
