"""``convnets predict --ray local`` against ``convnets predict`` on one machine: end-to-end img/s, and where the rest goes.

Usage::

    python benchmarks/bench_ray.py                          # 2,000 JPEGs, ResNeXt101-32x4d, 1 round
    python benchmarks/bench_ray.py --images 200 --model resnet50 --rounds 1   # a quick check

Each round runs both commands as a user would (fresh processes, the same folder, checkpoint,
``--batch-size`` and default ``--engine``), one after the other, the order rotated each round,
and times them from start to exit. The ``--ray local`` run starts its own cluster on this machine.
Both outputs are compared (the same top-5 for every image). Reported per variant: img/s over the
whole run, and for the Ray run the seconds until its first record was written (cluster start,
actors started, model sent and built, first batch) and the img/s after it. Target (issue 36): the
Ray run at 0.8x or more of ``convnets predict``'s throughput.

The JPEGs (generated once, kept in ``--folder``) are the example photos resized to about
ImageNet's size (500x375 and 375x500) with noise added, saved at quality 90. The checkpoint holds
random weights of the full-size architecture (speed does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402  (benchmarks/results.py)

TARGET = 0.8


def make_images(folder: Path, count: int) -> list[Path]:
    """``count`` JPEGs of about 500x375 in ``folder`` (kept: made once)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    sources = sorted((REPO / "convnets" / "assets" / "examples").glob("*.[jp][pn]g"))
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"img{i:05d}.jpg"
        if not path.exists():
            size = (500, 375) if i % 3 else (375, 500)
            base = np.asarray(Image.open(sources[i % len(sources)]).convert("RGB").resize(size), dtype=np.int16)
            noisy = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(path, quality=90)
        paths.append(path)
    return paths


def make_checkpoint(path: Path, model: str) -> Path:
    """Random weights of ``model`` in a file (made once)."""
    if not path.exists():
        import torch

        import convnets

        net = convnets.get_model(model)
        torch.save({"state_dict": net.state_dict(), "arch_spec": net.spec.to_dict()}, path)
    return path


def run(command: list[str], spool: Path) -> dict[str, float]:
    """Run ``command`` to its end; its wall seconds and when ``spool`` (the output's) first held a record."""
    first: list[float] = []
    done = threading.Event()
    start = time.perf_counter()

    def watch() -> None:
        while not done.is_set():
            if spool.exists() and spool.stat().st_size > 0:
                first.append(time.perf_counter() - start)
                return
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - start
    done.set()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"seconds": seconds, "first_record_s": first[0] if first else float("nan")}


def tops(path: Path) -> list[tuple[str, list[int]]]:
    return [(r["input"], [t["index"] for t in r["top"]]) for r in map(json.loads, path.read_text().splitlines())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="JPEGs to classify (default: 2000)")
    parser.add_argument("--model", default="resnext101_32x4d", help="architecture (default: resnext101_32x4d)")
    parser.add_argument("--batch-size", type=int, default=16, help="--batch-size of both runs (default: 16)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both runs (default: 1)")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "convnets-bench-ray",
                        help="where the JPEGs and the checkpoint are kept")
    results.add_output_option(parser, "bench_ray")
    args = parser.parse_args()

    from convnets.deploy.benchmark import environment

    load_before = os.getloadavg()[0]
    images = make_images(args.folder / "images", args.images)
    checkpoint = make_checkpoint(args.folder / f"{args.model}.pth.tar", args.model)
    base = [sys.executable, "-m", "convnets", "predict", str(images[0].parent), "--weights", str(checkpoint),
            "--batch-size", str(args.batch_size), "--no-progress"]
    variants = {"predict": [], "predict --ray local": ["--ray", "local"]}
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    outputs: dict[str, Path] = {}
    for round_ in range(args.rounds):
        names = list(variants)
        names = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in names:
            output = args.folder / f"out-{len(outputs)}.jsonl"
            spool = output.with_name(output.name + ".partial.jsonl")
            output.unlink(missing_ok=True)
            spool.unlink(missing_ok=True)  # a run this script stopped earlier
            timing = run([*base, *variants[name], "--output", str(output)], spool)
            timing["img_per_s"] = args.images / timing["seconds"]
            timing["after_first_img_per_s"] = args.images / (timing["seconds"] - timing["first_record_s"])
            measured[name].append(timing)
            outputs[name] = output
            print(f"round {round_ + 1} {name}: {timing['img_per_s']:.2f} img/s ({timing['seconds']:.0f} s, first "
                  f"record after {timing['first_record_s']:.1f} s)", file=sys.stderr, flush=True)
    same = tops(outputs["predict"]) == tops(outputs["predict --ray local"])
    rows = []
    for name, timings in measured.items():
        rows.append({"variant": name, "img_per_s": statistics.median(t["img_per_s"] for t in timings),
                     "seconds": statistics.median(t["seconds"] for t in timings),
                     "first_record_s": statistics.median(t["first_record_s"] for t in timings),
                     "after_first_img_per_s": statistics.median(t["after_first_img_per_s"] for t in timings),
                     "all_rounds": timings})
    ratio = rows[1]["img_per_s"] / rows[0]["img_per_s"]
    print(f"--ray local / predict: {ratio:.2f}x (target {TARGET}x); same top-5 for every image: {same}",
          file=sys.stderr)
    results.save(args.json, environment("cpu"), {
        "images": args.images, "model": args.model, "batch_size": args.batch_size, "rounds": args.rounds,
        "image_size": "500x375 JPEG", "rows": rows, "ratio": ratio, "target_ratio": TARGET, "same_top5": same,
        "load_average": [load_before, os.getloadavg()[0]]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
