"""Reproduce the README's CPU inference table: convnets variants side by side with timm.

Usage::

    python benchmarks/bench_inference.py                       # batch 16, both ResNeXt101 models
    python benchmarks/bench_inference.py --batch-sizes 1,16 --rounds 7
    python benchmarks/bench_inference.py --json /tmp/cpu_table.json   # elsewhere than benchmarks/results/

For each model and batch size, in one process, on random weights (speed does not depend on them):

* ``timm fp32``       -- ``timm.create_model('resnext101_32x4d')`` eager fp32, the reference column
* ``eager fp32``      -- our model as ``convnets.get_model`` returns it
* ``optimized fp32``  -- ``convnets.optimize_for_inference(model, "fp32")`` (folded BN, channels_last, compiled)
* ``eager bf16``      -- our model under ``torch.autocast("cpu", torch.bfloat16)``
* ``optimized bf16``  -- ``convnets.optimize_for_inference(model, "bf16")``

Measurements are interleaved: each round times every variant once (in a rotated order), and the
ratio to timm is taken within the round, so load from other processes on a shared machine hits
numerator and denominator alike. The table reports medians over rounds.

Results go to ``benchmarks/results/bench_inference.json`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
import results  # noqa: E402  (benchmarks/results.py)
from interleave import Runner, interleaved_rows  # noqa: E402  (benchmarks/interleave.py)

REFERENCE = "timm fp32"


def _autocast_bf16(model: torch.nn.Module) -> Runner:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    return run


def _variants(name: str, wanted: list[str]) -> dict[str, Runner]:
    model = convnets.get_model(name).eval()
    builders: dict[str, Callable[[], Runner]] = {
        "eager fp32": lambda: model,
        "optimized fp32": lambda: convnets.optimize_for_inference(model, "fp32"),
        "eager bf16": lambda: _autocast_bf16(model),
        "optimized bf16": lambda: convnets.optimize_for_inference(model, "bf16"),
        "optimized fp32 no-compile": lambda: convnets.optimize_for_inference(model, "fp32", compile=False),
        "optimized bf16 no-compile": lambda: convnets.optimize_for_inference(model, "bf16", compile=False),
    }
    return {v: builders[v]() for v in wanted}


def bench_model(name: str, reference: Runner, batch_size: int, variants: list[str], rounds: int,
                warmup: int, calls: int) -> list[dict[str, object]]:
    runners = {REFERENCE: reference, **_variants(name, variants)}
    x = torch.randn(batch_size, 3, 224, 224)
    return interleaved_rows(name, runners, x, reference=REFERENCE, warmup=warmup, rounds=rounds, calls=calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnext101_32x4d,se_resnext101_32x4d")
    parser.add_argument("--batch-sizes", default="16")
    parser.add_argument("--variants", default="eager fp32,optimized fp32,eager bf16,optimized bf16",
                        help="comma-separated; also: 'optimized fp32 no-compile', 'optimized bf16 no-compile'")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant (first one compiles)")
    parser.add_argument("--calls", type=int, default=1, help="calls per variant per round")
    results.add_output_option(parser, "bench_inference")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    import timm

    torch.manual_seed(0)
    reference = timm.create_model("resnext101_32x4d").eval()
    env = environment("cpu")
    rows = []
    for name in args.models.split(","):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            rows += bench_model(name, reference, batch_size, args.variants.split(","), args.rounds,
                                args.warmup, args.calls)
    print(f"{env['date']}; {env['cpu_model']}, {env['cpu_count']} cores, {env['torch_threads']} threads; "
          f"torch {env['torch']}, timm {timm.__version__}; median of {args.rounds} interleaved rounds")
    print()
    print("| model | batch | variant | img/s | vs timm fp32 (median, min-max) |")
    print("|---|---:|---|---:|---:|")
    for row in rows:
        lo, hi = row["speedup_min_max"]
        print(f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['img_per_s']:.2f} | "
              f"{row['speedup_vs_timm']:.2f}x ({lo:.2f}-{hi:.2f}) |")
    results.save(args.json, env, {"models": args.models.split(","), "batch_sizes": args.batch_sizes.split(","),
                                  "image_size": 224, "rounds": args.rounds, "warmup": args.warmup, "calls": args.calls,
                                  "timm": timm.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
