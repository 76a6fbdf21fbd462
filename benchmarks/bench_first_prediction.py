"""Time to the first prediction of ``convnets predict IMG --weights CK --jsonl``, as a new user runs it.

A full-size SE-ResNeXt101-32x4d checkpoint in NGC's layout (random weights, written once, as
benchmarks/bench_load.py makes it) and one generated 640x480 photo. Each round runs, in fresh
processes and in a rotated order (the machine may be shared):

* ``--engine torch``
* ``--engine auto`` cold: an empty engine cache (``CONVNETS_CACHE_DIR``), so it converts and checks
* ``--engine auto`` warm: the cache that the cold runs filled (loads the graph and auto's verdict)

and reports the median wall time from the start of the process to the first JSON line on stdout,
and the per-round ratios to ``--engine torch``. Target (issue "Fast without knowing the flags"):
warm ``auto`` at most 1.2x ``torch``.

    python benchmarks/bench_first_prediction.py [--rounds 3] [--checkpoint PATH] [--json FILE]

Results go to ``benchmarks/results/bench_first_prediction.json`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.2
VARIANTS = ("torch", "auto cold", "auto warm")


def make_photo(path: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
    return path


def first_prediction_s(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from starting ``cmd`` to its first line on stdout (the process is then waited for)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - start
    _, err = proc.communicate()
    if proc.returncode != 0 or not line.startswith("{"):
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, help="an existing checkpoint (default: generate one)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results
    from bench_load import make_checkpoint  # the same generated checkpoint

    results.add_output_option(parser, "bench_first_prediction")
    args = parser.parse_args()
    from convnets.deploy.benchmark import environment

    env = environment("cpu")

    with tempfile.TemporaryDirectory(prefix="bench-first-prediction-") as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = args.checkpoint or make_checkpoint(tmp)
        photo = make_photo(tmp / "photo.jpg")
        warm_dir, cold_dir = tmp / "warm-cache", tmp / "cold-cache"
        base = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_HOME": str(tmp / "torch-home")}
        envs = {"torch": {**base, "CONVNETS_CACHE_DIR": str(cold_dir)},
                "auto cold": {**base, "CONVNETS_CACHE_DIR": str(cold_dir)},
                "auto warm": {**base, "CONVNETS_CACHE_DIR": str(warm_dir)}}

        def command(variant: str) -> list[str]:
            engine = "torch" if variant == "torch" else "auto"
            return [sys.executable, "-m", "convnets", "predict", str(photo), "--weights", str(checkpoint), "--jsonl",
                    "--device", "cpu", "--engine", engine]

        first_prediction_s(command("auto warm"), envs["auto warm"])  # fills the warm cache (untimed)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for variant in order:
                if variant == "auto cold":
                    shutil.rmtree(cold_dir, ignore_errors=True)
                times[variant].append(first_prediction_s(command(variant), envs[variant]))
            print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in VARIANTS), flush=True)
    print(f"\n| variant | median s | min s | max s | median ratio to torch (per round; min-max) |")
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        ratios = [t / ref for t, ref in zip(times[variant], times["torch"])]
        print(f"| {variant} | {statistics.median(times[variant]):.2f} | {min(times[variant]):.2f} | "
              f"{max(times[variant]):.2f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    warm = statistics.median(t / ref for t, ref in zip(times["auto warm"], times["torch"]))
    print(f"\nwarm auto / torch: {warm:.2f}x (target <= {TARGET}x): {'met' if warm <= TARGET else 'NOT met'}")
    rows = [{"variant": v, "seconds_all_rounds": times[v],
             "median_s": statistics.median(times[v]),
             "ratio_to_torch_all_rounds": [t / ref for t, ref in zip(times[v], times["torch"])]} for v in VARIANTS]
    results.save(args.json, env, {"model": "se_resnext101_32x4d", "image": "640x480 JPEG", "rounds": args.rounds,
                                  "target_ratio": TARGET, "warm_auto_ratio": warm, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
