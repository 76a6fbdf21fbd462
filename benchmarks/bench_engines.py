"""Inference engines side by side in one process: which one ``engine="auto"`` should pick.

Usage::

    python benchmarks/bench_engines.py                                   # the README's table (slow)
    python benchmarks/bench_engines.py --models resnext101_32x4d --batch-sizes 16 --rounds 3   # quicker
    python benchmarks/bench_engines.py --image-size 128 --rounds 2 --warmup 1                  # a smoke run

For each model and batch size, on random weights (BatchNorm statistics calibrated on random
inputs, so that activations and the faithfulness checks behave as with trained weights; speed
does not depend on the values):

* ``timm fp32``        -- ``timm.create_model(name)`` eager fp32: the reference column;
* ``torch fp32/bf16``  -- ``optimize_for_inference(model, p, engine="torch")`` (folded, channels_last, compiled);
* ``onnxruntime fp32`` -- ``engine="onnxruntime"``;
* ``openvino fp32/bf16`` -- ``engine="openvino"`` (INFERENCE_PRECISION_HINT f32 / bf16);
* ``auto fp32/bf16``   -- ``engine="auto"`` (its pick is in the label).

Measurements are interleaved: every round times each variant once (rotated order) and ratios are
taken within the round, so load from other processes hits numerator and denominator alike; the
table reports medians over rounds. The last lines say, per precision, whether auto's pick was the
fastest engine measured (the check of :data:`convnets.deploy.engines.AUTO_ORDER`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.deploy.calibrate import calibrate_batchnorm  # noqa: E402
from convnets.deploy.engines import available_engines  # noqa: E402
from interleave import Runner, interleaved_rows  # noqa: E402  (benchmarks/interleave.py)

REFERENCE = "timm fp32"
VARIANTS = ("torch fp32", "onnxruntime fp32", "openvino fp32", "auto fp32", "torch bf16", "openvino bf16",
            "auto bf16")


def _runners(name: str, wanted: list[str], image_size: int) -> dict[str, Runner]:
    model = convnets.get_model(name)
    calibrate_batchnorm(model, image_size=image_size, batch_size=4, batches=2)
    model.input_size = image_size
    runners: dict[str, Runner] = {}
    for label in wanted:
        engine, precision = label.split()
        if engine != "auto" and engine not in available_engines(precision, torch.device("cpu")):
            logging.warning("%s: not installed or not runnable here; skipped", label)
            continue
        start = time.perf_counter()
        built = convnets.optimize_for_inference(model, precision, engine=engine)
        if engine == "auto":
            label = f"{label} ({built.engine})"
        runners[label] = built
        logging.info("%s %s built in %.1f s", name, label, time.perf_counter() - start)
    return runners


def bench(name: str, runners: dict[str, Runner], batch_size: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """Interleaved rounds of every runner (``REFERENCE`` among them) at one batch size: one row per runner."""
    x = torch.randn(batch_size, 3, args.image_size, args.image_size)
    return interleaved_rows(name, runners, x, reference=REFERENCE, warmup=args.warmup, rounds=args.rounds,
                            calls=args.calls)


def auto_verdicts(rows: list[dict[str, object]]) -> list[str]:
    """Per model, batch and precision: auto's pick and the fastest engine measured."""
    lines = []
    keys = sorted({(r["model"], r["batch_size"]) for r in rows}, key=str)
    for model, batch in keys:
        group = [r for r in rows if (r["model"], r["batch_size"]) == (model, batch)]
        for precision in ("fp32", "bf16"):
            engines = {r["variant"].split()[0]: r["img_per_s"] for r in group
                       if str(r["variant"]).split()[1:2] == [precision] and not str(r["variant"]).startswith("auto")
                       and r["variant"] != REFERENCE}
            auto = [r["variant"] for r in group if str(r["variant"]).startswith(f"auto {precision}")]
            if not engines or not auto:
                continue
            picked = str(auto[0]).split("(")[1].rstrip(")")
            best = max(engines, key=engines.__getitem__)
            share = engines.get(picked, float("nan")) / engines[best]
            lines.append(f"{model} b{batch} {precision}: auto picks {picked}, fastest measured {best} "
                         f"({'same' if picked == best else f'pick at {share:.2f}x of it'})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnext101_32x4d,se_resnext101_32x4d")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant (the first one compiles)")
    parser.add_argument("--calls", type=int, default=1, help="calls per variant per round")
    parser.add_argument("--image-size", type=int, default=224, help="input size (smaller: a quicker, less "
                                                                    "representative run)")
    parser.add_argument("--json", metavar="FILE", help="write all measurements as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    import timm

    env = environment("cpu")
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        reference = timm.create_model(name.replace("se_resnext", "seresnext")).eval()  # timm's spelling
        # Built once per model: graphs have a dynamic batch axis (torch compiles per batch size at
        # the first call, which the warm-up absorbs and reports).
        runners = {REFERENCE: reference, **_runners(name, args.variants.split(","), args.image_size)}
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            rows += bench(name, runners, batch_size, args)
    print(f"{env['date']}; {env['cpu_model']}, {env['cpu_count']} cores, {env['torch_threads']} threads; "
          f"torch {env['torch']}, timm {timm.__version__}; {args.image_size} px; median of {args.rounds} "
          "interleaved rounds")
    print()
    print("| model | batch | variant | img/s | vs timm fp32 (median, min-max) | warm-up (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        lo, hi = row["speedup_min_max"]
        print(f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['img_per_s']:.2f} | "
              f"{row['speedup_vs_timm']:.2f}x ({lo:.2f}-{hi:.2f}) | {row['warmup_s']:.1f} |")
    print()
    for line in auto_verdicts(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
