"""Inference throughput: convnets variants side by side with timm, on the CPU or a GPU.

Usage::

    python benchmarks/bench_inference.py                       # batch 16, both ResNeXt101 models
    python benchmarks/bench_inference.py --batch-sizes 1,16 --rounds 7
    python benchmarks/bench_inference.py --json /tmp/cpu_table.json   # elsewhere than benchmarks/results/
    python benchmarks/bench_inference.py --device cuda --models se_resnext101_32x4d --batch-sizes 1,64,256 \
        --variants "timm fp16,eager fp16,optimized fp16,optimized fp16 no-compile" --calls 10

For each model and batch size, in one process, on random weights (speed does not depend on them):

* ``timm fp32``       -- ``timm.create_model('resnext101_32x4d')`` eager fp32, the reference column
  (for ``resnet50``: timm's ``resnet50``; timm's SE-ResNeXt is another network, see :data:`TIMM_REFERENCE`)
* ``eager fp32``      -- our model as ``convnets.get_model`` returns it
* ``optimized fp32``  -- ``convnets.optimize_for_inference(model, "fp32")`` (folded BN, channels_last, compiled)
* ``eager bf16``      -- our model under ``torch.autocast(device, torch.bfloat16)``
* ``optimized bf16``  -- ``convnets.optimize_for_inference(model, "bf16")``
* ``timm bf16`` / ``timm fp16`` -- timm's model in channels_last under autocast: what a user who
  knows PyTorch would run (fp16: CUDA only, as are ``eager fp16`` and ``optimized fp16``)

Measurements are interleaved: each round times every variant once (in a rotated order), and the
ratio to timm is taken within the round, so load from other processes on a shared machine hits
numerator and denominator alike. The table reports medians over rounds. On a GPU every call is
timed to its end (synchronised), and TF32 stays at PyTorch's defaults for every variant.

Results go to ``benchmarks/results/bench_inference.json``, ``bench_inference_cuda.json`` with
``--device cuda`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.runtime import AMP_DTYPES, PRECISIONS, precision_dtype  # noqa: E402
import results  # noqa: E402  (benchmarks/results.py)
from interleave import Runner, interleaved_rows  # noqa: E402  (benchmarks/interleave.py)

REFERENCE = "timm fp32"
#: The timm model each of ours is compared with; others: timm's ``resnext101_32x4d`` (timm's
#: ``seresnext101_32x4d`` squeezes to C/16, not NVIDIA's fixed 16 channels: a different network).
TIMM_REFERENCE = {"resnet50": "resnet50"}


def _autocast(model: Runner, precision: str, device: torch.device) -> Runner:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=precision_dtype(precision)):
            return model(x)
    return run


def _variants(name: str, timm_model: torch.nn.Module, wanted: list[str], device: torch.device) -> dict[str, Runner]:
    model = convnets.get_model(name).eval().to(device)

    def timm_half(precision: str) -> Runner:  # a channels_last copy (Module.to converts in place)
        nhwc = copy.deepcopy(timm_model).to(memory_format=torch.channels_last)
        return _autocast(lambda x: nhwc(x.contiguous(memory_format=torch.channels_last)), precision, device)

    def optimized(precision: str, compile: bool = True) -> Runner:
        return convnets.optimize_for_inference(model, precision, device, compile=compile)

    builders: dict[str, Callable[[], Runner]] = {"eager fp32": lambda: model}
    for p in PRECISIONS:
        builders[f"optimized {p}"] = lambda p=p: optimized(p)
        builders[f"optimized {p} no-compile"] = lambda p=p: optimized(p, compile=False)
    for p in AMP_DTYPES:
        builders[f"eager {p}"] = lambda p=p: _autocast(model, p, device)
        builders[f"timm {p}"] = lambda p=p: timm_half(p)
    unknown = [v for v in wanted if v not in builders]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(builders)}")
    return {v: builders[v]() for v in wanted}


def bench_model(name: str, reference: torch.nn.Module, batch_size: int, variants: list[str], rounds: int,
                warmup: int, calls: int, device: torch.device) -> list[dict[str, object]]:
    runners = {REFERENCE: reference, **_variants(name, reference, variants, device)}
    x = torch.randn(batch_size, 3, 224, 224, device=device)
    return interleaved_rows(name, runners, x, reference=REFERENCE, warmup=warmup, rounds=rounds, calls=calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnext101_32x4d,se_resnext101_32x4d")
    parser.add_argument("--batch-sizes", default="16")
    parser.add_argument("--variants", default="eager fp32,optimized fp32,eager bf16,optimized bf16",
                        help="comma-separated; also: 'optimized PRECISION no-compile', 'timm bf16', 'timm fp16', "
                             "and fp16 (CUDA only) for each")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant (first one compiles)")
    parser.add_argument("--calls", type=int, default=1, help="calls per variant per round")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_inference.json, "
                                                         "bench_inference_cuda.json with --device cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.json = args.json or results.default_path("bench_inference", args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    import timm

    env = environment(args.device)
    load_before = os.getloadavg()[0]  # other processes' load, which interleaving shares out but does not remove
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        reference = timm.create_model(TIMM_REFERENCE.get(name, "resnext101_32x4d")).eval().to(device)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            rows += bench_model(name, reference, batch_size, args.variants.split(","), args.rounds,
                                args.warmup, args.calls, device)
    load_after = os.getloadavg()[0]
    print(f"{env['date']}; {env['device_name']}; {env['cpu_model']}, {env['cpu_count']} cores, "
          f"{env['torch_threads']} threads; "
          f"torch {env['torch']}, timm {timm.__version__}; median of {args.rounds} interleaved rounds; "
          f"load average before and after: {load_before:.1f}, {load_after:.1f}")
    print()
    print("| model | batch | variant | img/s | vs timm fp32 (median, min-max) |")
    print("|---|---:|---|---:|---:|")
    for row in rows:
        lo, hi = row["speedup_min_max"]
        print(f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['img_per_s']:.2f} | "
              f"{row['speedup_vs_timm']:.2f}x ({lo:.2f}-{hi:.2f}) |")
    results.save(args.json, env, {"models": args.models.split(","), "batch_sizes": args.batch_sizes.split(","),
                                  "image_size": 224, "device": args.device, "rounds": args.rounds,
                                  "warmup": args.warmup, "calls": args.calls,
                                  "timm": timm.__version__, "load_average": [load_before, load_after],
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
