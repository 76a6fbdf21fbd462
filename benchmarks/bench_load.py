"""Cost of building a pretrained SE-ResNeXt101-32x4d from a local checkpoint, in fresh processes.

Compares, side by side and interleaved (the machine is shared and noisy):

* baseline -- what upstream does: construct with random initialisation, ``torch.load`` the file,
  ``load_state_dict``;
* convnets -- ``convnets.se_resnext101_32x4d(pretrained_from_file=PATH)`` (meta-device build,
  memory-mapped file, tensors assigned);
* convnets cached -- ``pretrained=True`` with the file already in the cache (adds the sha256
  verification of the cached copy).

Each measurement runs in a new Python process; imports are not timed. Reports the median build
time and the peak RSS growth (peak RSS after the build minus RSS before it) relative to the file
size. Targets (issue): time < 0.5x baseline, RSS growth <= 1.25x the file size.

    python benchmarks/bench_load.py [--rounds 5] [--checkpoint PATH] [--json FILE]

Results go to ``benchmarks/results/bench_load.json`` (see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402  (benchmarks/results.py)

FILE_NAME = "nvidia_se-resnext101-32x4d_200821.pth.tar"

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch, convnets
from convnets.models.resnet import MODEL_SPECS, ResNet

def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

variant, path = sys.argv[1], sys.argv[2]
before = rss_kib("VmRSS")
start = time.perf_counter()
if variant == "baseline":
    model = ResNet(MODEL_SPECS["se_resnext101_32x4d"])
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({{k.removeprefix("module."): v for k, v in state.items()}})
elif variant == "convnets":
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path)
else:
    model = convnets.se_resnext101_32x4d(pretrained=True, progress=False)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "rss_growth_kib": rss_kib("VmHWM") - before}}))
"""

VARIANTS = ("baseline", "convnets", "convnets cached")


def make_checkpoint(folder: Path) -> Path:
    """Write a full-size SE-ResNeXt101-32x4d checkpoint in the NGC 20.06 layout."""
    sys.path.insert(0, str(REPO))
    import torch

    from convnets.deploy.calibrate import calibrate_batchnorm
    from convnets.models.resnet import MODEL_SPECS, ResNet

    torch.manual_seed(0)
    model = ResNet(MODEL_SPECS["se_resnext101_32x4d"])
    # BatchNorm statistics of random inputs: activations stay in range as with trained weights, so
    # engine="auto" accepts the engines it would accept for NGC's checkpoint (the loading cost does not
    # depend on the values). Seeded: float32 engines' error on random weights is near the 1e-4 that
    # auto allows (seed 0: OpenVINO 3e-5), and a benchmark must measure the same path every time.
    calibrate_batchnorm(model, image_size=224, batch_size=4, batches=2)
    path = folder / FILE_NAME
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, path)
    return path


def run_child(variant: str, path: Path, env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO)), variant, str(path)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, help=f"an existing checkpoint (default: generate {FILE_NAME})")
    results.add_output_option(parser, "bench_load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        path = args.checkpoint or make_checkpoint(tmp_path)
        env = {**os.environ, "TORCH_HOME": str(tmp_path / "torch_home"), "CONVNETS_WEIGHTS_MIRROR": str(path.parent)}
        run_child("convnets cached", path, env)  # fills the cache and the page cache
        measured: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                measured[variant].append(run_child(variant, path, env))
        size_kib = path.stat().st_size / 1024
    from convnets.deploy.benchmark import environment  # after the timing: imports PyTorch

    machine = environment("cpu")
    base = statistics.median(r["seconds"] for r in measured["baseline"])
    print(f"SE-ResNeXt101-32x4d, file {size_kib / 1024:.0f} MiB, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"fresh process each")
    print(f"{'variant':<17} {'build s (median)':>16} {'vs baseline':>12} {'peak RSS growth':>16} {'/ file size':>12}")
    rows = []
    for variant in VARIANTS:
        seconds = statistics.median(r["seconds"] for r in measured[variant])
        growth = statistics.median(r["rss_growth_kib"] for r in measured[variant])
        print(f"{variant:<17} {seconds:>16.3f} {seconds / base:>11.2f}x {growth / 1024:>12.0f} MiB "
              f"{growth / size_kib:>11.2f}x")
        rows.append({"variant": variant, "seconds_median": seconds, "vs_baseline": seconds / base,
                     "rss_growth_mib": growth / 1024, "rss_over_file_size": growth / size_kib,
                     "seconds_all_rounds": [r["seconds"] for r in measured[variant]],
                     "rss_growth_kib_all_rounds": [r["rss_growth_kib"] for r in measured[variant]]})
    results.save(args.json, machine, {"model": "se_resnext101_32x4d", "file_mib": size_kib / 1024,
                                      "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
