"""Does decoding keep up with the model? End-to-end ``predict`` img/s against the same engine's model-only img/s.

Usage::

    python benchmarks/bench_predict_pipeline.py                    # 500 JPEGs, fp32 and bf16, batch 16
    python benchmarks/bench_predict_pipeline.py --images 64 --rounds 1 --model resnet50   # a quick check
    python benchmarks/bench_predict_pipeline.py --json /tmp/pipeline.json   # elsewhere than benchmarks/results/

What it measures, per precision (``optimize_for_inference``'s torch engine, as ``convnets predict``
runs it; random weights, since speed does not depend on them):

* ``model only``: the engine on one preprocessed batch, called once per batch of the folder;
* ``end to end``: :func:`convnets.inference.predict.predict` over a folder of photo-sized JPEGs (1000x750,
  generated once: smooth shapes, gradients and grain, about 150 KB each, like camera photos
  scaled down), decoding in ``--workers`` processes (:mod:`convnets.inference.loader`), top-5 included;
* ``end to end, workers 0``: the same with decoding between batches in the main process (the
  behaviour before decoding workers), for comparison.

The ratio end to end / model only is the issue's target (at least 0.85). Rounds interleave the
variants (in a rotated order, as benchmarks/interleave.py does) and ratios are taken within a
round, so load from other processes hits both sides.

``--pinned`` (default on) repeats everything with the model on one core (``torch.set_num_threads(1)``,
the main process pinned to it) and the decoding process on another: what a 2-core machine can
show about the overlap, independent of how many cores the machine has. Needs
``os.sched_setaffinity`` (Linux) and two usable cores.

Results go to ``benchmarks/results/bench_predict_pipeline.json`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.inference.predict import iter_inputs, predict_items  # noqa: E402
from convnets.preprocessing.pipeline import prepare_batch  # noqa: E402
from convnets.preprocessing.presets import preset_for_model  # noqa: E402
from convnets.runtime import default_workers, usable_cores  # noqa: E402
import results  # noqa: E402  (benchmarks/results.py)
from interleave import time_calls  # noqa: E402  (benchmarks/interleave.py)

log = logging.getLogger("bench_predict_pipeline")


def make_photos(folder: Path, count: int, size: tuple[int, int] = (1000, 750), seed: int = 0) -> list[Path]:
    """``count`` photo-like JPEGs in ``folder`` (kept between runs): smooth colour fields, a few
    shapes with soft edges, fine grain; they decode like camera JPEGs, not like flat colour."""
    from PIL import Image, ImageDraw, ImageFilter

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    width, height = size
    for i in range(count):
        path = folder / f"photo{i:04d}.jpg"
        paths.append(path)
        if path.exists():
            continue
        low = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        image = Image.fromarray(low).resize(size, Image.BICUBIC)
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x, y = rng.integers(0, width), rng.integers(0, height)
            r = int(rng.integers(20, 200))
            colour = tuple(int(c) for c in rng.integers(0, 255, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=colour)
        image = image.filter(ImageFilter.GaussianBlur(2))
        grain = rng.normal(0, 8, (height, width, 3))
        pixels = np.clip(np.asarray(image, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, quality=90)
    return paths


def _median_ratio(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    ratios = [n / d for n, d in zip(numerator, denominator)]
    return statistics.median(ratios), min(ratios), max(ratios)


def bench_precision(model: torch.nn.Module, paths: list[Path], folder: Path, precision: str, *, batch_size: int,
                    workers: int, rounds: int, pinned: tuple[int, int] | None, compile: bool) -> list[dict[str, object]]:
    """Rows for one precision: model only, end to end with ``workers``, and with 0 workers."""
    net = convnets.optimize_for_inference(model, precision, compile=compile)
    preset = preset_for_model(model)
    labels = [str(i) for i in range(model.num_classes)]
    x = prepare_batch([str(p) for p in paths[:batch_size]], preset=preset).tensor
    batches = -(-len(paths) // batch_size)

    def model_only() -> float:
        return batch_size / time_calls(net, x, batches)

    def end_to_end(count: int) -> Callable[[], float]:
        def run() -> float:
            if pinned is not None:  # the decoding processes fork from here: give them the decoder's core
                os.sched_setaffinity(0, {pinned[1]})
            start = time.perf_counter()
            stream = predict_items(net, iter_inputs([str(folder)]), labels=labels, batch_size=batch_size,
                                    preset=preset, workers=count)
            done = 1
            next(stream)
            if pinned is not None:
                os.sched_setaffinity(0, {pinned[0]})
            done += sum(1 for _ in stream)
            assert done == len(paths), done
            return done / (time.perf_counter() - start)
        return run
    variants: dict[str, Callable[[], float]] = {"model only": model_only, f"end to end, workers {workers}":
                                                end_to_end(workers)}
    if workers:
        variants["end to end, workers 0"] = end_to_end(0)
    with torch.inference_mode():
        for _ in range(2):
            net(x)  # warm-up (and compilation)
        speeds: dict[str, list[float]] = {label: [] for label in variants}
        labels_order = list(variants)
        for r in range(rounds):
            shift = r % len(labels_order)
            for label in labels_order[shift:] + labels_order[:shift]:
                speeds[label].append(variants[label]())
            log.info("%s round %d/%d: %s", precision, r + 1, rounds,
                     ", ".join(f"{k} {v[-1]:.1f}" for k, v in speeds.items()))
    rows = []
    for label, values in speeds.items():
        ratio, lo, hi = _median_ratio(values, speeds["model only"])
        rows.append({"precision": precision, "batch_size": batch_size, "variant": label,
                     "pinned": pinned is not None, "img_per_s": statistics.median(values),
                     "img_per_s_all_rounds": values, "vs_model_only": ratio, "vs_model_only_min_max": [lo, hi]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="se_resnext101_32x4d")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--images", type=int, default=500, help="JPEGs in the folder (default 500)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_photos"),
                        help="where the generated JPEGs are kept between runs")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"decoding processes (default: convnets' default for a GPU model, min(4, cores - 1), "
                             f"here {default_workers('cuda')}; the CPU default is {default_workers('cpu')})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--pinned", action=argparse.BooleanOptionalAction, default=True,
                        help="also run with the model on one core and the decoder on another")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine (predict --compile)")
    results.add_output_option(parser, "bench_predict_pipeline")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    folder = args.folder / f"{args.images}"
    paths = make_photos(folder, args.images)
    size_kb = sum(p.stat().st_size for p in paths) / len(paths) / 1024
    torch.manual_seed(0)
    model = convnets.get_model(args.model).eval()
    # At least one process: the point is to compare decoding processes with in-process decoding.
    workers = max(1, default_workers("cuda")) if args.workers is None else args.workers
    env = environment("cpu")
    rows = []
    for precision in args.precisions.split(","):
        rows += bench_precision(model, paths, folder, precision, batch_size=args.batch_size, workers=workers,
                                rounds=args.rounds, pinned=None, compile=args.compile)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pinned and len(cores) >= 2:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for precision in args.precisions.split(","):
                rows += bench_precision(model, paths, folder, precision, batch_size=args.batch_size, workers=1,
                                        rounds=args.rounds, pinned=(cores[0], cores[1]), compile=args.compile)
        finally:
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, cores)
    elif args.pinned:
        log.warning("--pinned needs two usable cores and os.sched_setaffinity; skipped")
    print(f"{env['date']}; {env['cpu_model']}, {usable_cores()} usable cores, {env['torch_threads']} threads; "
          f"torch {env['torch']}; {args.model}, {len(paths)} JPEGs of 1000x750 ({size_kb:.0f} KB), batch "
          f"{args.batch_size}; median of {args.rounds} interleaved rounds")
    print()
    print("| precision | cores | variant | img/s | vs model only (median, min-max) |")
    print("|---|---|---|---:|---:|")
    for row in rows:
        lo, hi = row["vs_model_only_min_max"]
        where = "model 1 + decoder 1 (pinned)" if row["pinned"] else f"all {usable_cores()}"
        print(f"| {row['precision']} | {where} | {row['variant']} | {row['img_per_s']:.1f} | "
              f"{row['vs_model_only']:.2f} ({lo:.2f}-{hi:.2f}) |")
    results.save(args.json, env, {"model": args.model, "images": len(paths), "image_kb": size_kb,
                                  "batch_size": args.batch_size, "rounds": args.rounds, "workers": workers,
                                  "usable_cores": usable_cores(), "compile": args.compile, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
