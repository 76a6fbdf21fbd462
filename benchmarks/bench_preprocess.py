"""Preprocessing speed: upstream's one-image-at-a-time loop vs ``prepare_input_from_uri(list)``.

Builds ``--count`` large JPEG photos (real photos shipped with scikit-image and scikit-learn,
upscaled to about 3000x2000 and saved at quality 90, so that decoding dominates as with camera
photos) in a temporary directory, then times, interleaved, ``--repeat`` times each:

* upstream: ``torch.cat([prepare(p) for p in paths])`` where ``prepare`` is a faithful
  re-implementation of upstream ``prepare_input_from_uri`` on local files (``validators.url``
  check, ``PIL.Image.open``, torchvision ``Compose``, ``unsqueeze(0)``);
* convnets: ``convnets.preprocessing.prepare_input_from_uri(paths)`` (what ``processing_utils``
  re-exports; one call, thread pool).

Prints both wall times (median and best) and CPU times, their ratio, the machine's usable cores
and load average (other jobs on a shared machine skew the ratio), and the max abs difference
between the two batches. Run from the repository root::

    python benchmarks/bench_preprocess.py [--json FILE]

Results go to ``benchmarks/results/bench_preprocess.json`` (see ``benchmarks/results.py``); not
written when the two batches differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import validators
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.preprocessing.pipeline import prepare_input_from_uri  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py)

PHOTO_DIRS = ("skimage/data", "sklearn/datasets/images")
PHOTOS = ("china.jpg", "flower.jpg", "chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png",
          "motorcycle_left.png", "retina.jpg")
# Variants multiply the photos into distinct files with both orientations.
VARIANTS = (None, Image.Transpose.FLIP_LEFT_RIGHT, Image.Transpose.ROTATE_90,
            Image.Transpose.FLIP_TOP_BOTTOM)


def find_photos() -> list[Path]:
    """The real photos available from the installed scikit-image / scikit-learn."""
    found = []
    for site in map(Path, sys.path):
        for folder in PHOTO_DIRS:
            found += [site / folder / name for name in PHOTOS if (site / folder / name).is_file()]
    unique = list(dict.fromkeys(found))
    if not unique:
        sys.exit("no sample photos found: install scikit-image and scikit-learn")
    return unique


def build_photos(directory: Path, count: int, long_side: int) -> list[Path]:
    """Write ``count`` upscaled JPEG photos (quality 90) into ``directory``."""
    sources = find_photos()
    paths = []
    for i in range(count):
        source = sources[i % len(sources)]
        variant = VARIANTS[(i // len(sources)) % len(VARIANTS)]
        with Image.open(source) as img:
            img = img.convert("RGB")
            scale = long_side / max(img.size)
            img = img.resize((round(img.width * scale), round(img.height * scale)),
                             Image.Resampling.BICUBIC)
            if variant is not None:
                img = img.transpose(variant)
            path = directory / f"{i:03d}_{source.stem}.jpg"
            img.save(path, "JPEG", quality=90)
            paths.append(path)
    return paths


UPSTREAM_TRANSFORMS = transforms.Compose([
    transforms.Resize(256),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
])


def upstream_prepare_input_from_uri(uri: str) -> torch.Tensor:
    """Upstream's function for local paths (the URL branch is not exercised here)."""
    if validators.url(uri):
        raise NotImplementedError("the benchmark uses local files only")
    img = Image.open(uri)
    return UPSTREAM_TRANSFORMS(img).unsqueeze(0)


def upstream_loop(paths: list[str]) -> torch.Tensor:
    return torch.cat([upstream_prepare_input_from_uri(p) for p in paths])


def timed(function: Callable[[], torch.Tensor]) -> tuple[float, float, torch.Tensor]:
    """Wall seconds, CPU seconds of the whole process (all threads) and the result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=32, help="number of photos (default 32)")
    parser.add_argument("--long-side", type=int, default=3000, help="photo long side in pixels")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (default 3)")
    parser.add_argument("--workers", type=int, default=None, help="threads (default: cores)")
    results.add_output_option(parser, "bench_preprocess")
    args = parser.parse_args()
    env = environment("cpu")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with tempfile.TemporaryDirectory(prefix="convnets-bench-") as tmp:
        paths = [str(p) for p in build_photos(Path(tmp), args.count, args.long_side)]
        with Image.open(paths[0]) as first:
            size = f"{first.width}x{first.height}"
        megabytes = sum(os.path.getsize(p) for p in paths) / 2**20
        load_average = os.getloadavg()[0]
        print(f"{len(paths)} JPEG photos ({size} and similar, {megabytes:.1f} MiB), {cores} usable "
              f"CPU cores, torch {torch.__version__}, load average {load_average:.2f}")

        ours = lambda: prepare_input_from_uri(paths, workers=args.workers)  # noqa: E731
        upstream = lambda: upstream_loop(paths)  # noqa: E731
        timed(ours)  # warm-up: imports, page cache, thread start-up
        upstream_times, our_times, upstream_cpu, our_cpu = [], [], [], []
        for _ in range(args.repeat):  # interleaved, so that load from others hits both alike
            seconds, cpu, expected = timed(upstream)
            upstream_times.append(seconds)
            upstream_cpu.append(cpu)
            seconds, cpu, batch = timed(ours)
            our_times.append(seconds)
            our_cpu.append(cpu)

    diff = (batch - expected).abs().max().item()
    up, us = statistics.median(upstream_times), statistics.median(our_times)
    print(f"upstream loop            : median {up:.3f} s, best {min(upstream_times):.3f} s, "
          f"CPU {statistics.median(upstream_cpu):.3f} s")
    print(f"prepare_input_from_uri() : median {us:.3f} s, best {min(our_times):.3f} s, "
          f"CPU {statistics.median(our_cpu):.3f} s")
    print(f"speed-up (median)        : {up / us:.2f}x   (best/best {min(upstream_times) / min(our_times):.2f}x)")
    print(f"batch {list(batch.shape)}, max abs diff vs upstream {diff:.3g}, "
          f"bitwise equal: {torch.equal(batch, expected)}")
    if diff > 1e-4:
        sys.exit("the batches differ")
    rows = [{"variant": variant, "median_s": statistics.median(times), "best_s": min(times),
             "cpu_s": statistics.median(cpu), "seconds_all_rounds": times, "cpu_s_all_rounds": cpu}
            for variant, times, cpu in (("upstream loop", upstream_times, upstream_cpu),
                                        ("prepare_input_from_uri()", our_times, our_cpu))]
    results.save(args.json, env, {"photos": len(paths), "size": size, "megabytes": megabytes,
                                  "long_side": args.long_side, "usable_cores": cores, "load_average": load_average,
                                  "repeat": args.repeat, "workers": args.workers, "rows": rows,
                                  "speedup_median": up / us, "speedup_best": min(upstream_times) / min(our_times),
                                  "max_abs_diff": diff, "bitwise_equal": torch.equal(batch, expected)})


if __name__ == "__main__":
    main()
