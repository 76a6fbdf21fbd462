"""``--fast-decode`` on phone-sized photos: pixel difference from the exact path, and end-to-end img/s.

Usage::

    python benchmarks/bench_fast_decode.py                       # 24 JPEGs of 4032x3024, bf16, 3 rounds
    python benchmarks/bench_fast_decode.py --images 8 --rounds 1 --model resnet50   # a quick check
    python benchmarks/bench_fast_decode.py --json /tmp/fast_decode.json   # elsewhere than benchmarks/results/
    python benchmarks/bench_fast_decode.py --device cuda --images 96 --skip-pixels --no-compile   # model on a GPU

What it measures:

* ``pixels``: for each variant (the draft margin, 1x or 2x the resize size, and Pillow's
  ``reducing_gap`` in the resize), the mean and largest absolute difference of the preprocessed
  tensor from the exact path's, in normalised units (1 uint8 level is about 0.017), and the
  preprocessing time per image on one thread. This is what chose
  :data:`convnets.preprocessing.decode.FAST_DECODE_MARGIN`.
* ``end to end``: :func:`convnets.inference.predict.predict` (decode + preprocess + model + top-5) over
  the folder with the model in ``--precision`` (random weights: speed does not depend on them),
  decoding with ``convnets predict``'s default ``--workers``, exact against ``fast_decode=True``,
  and ``model only`` (the same batches, already preprocessed: the ceiling of any decoding
  speed-up). Rounds interleave the three in a rotated order; the speed-up is the median of the
  per-round ratios, with their min and max. With ``--device cuda`` the model runs on the GPU and
  the CPU only decodes (``convnets predict``'s default workers for a GPU): decoding is then all the
  cost, and the results go to ``bench_fast_decode_cuda.json``.

The JPEGs (generated once, kept in ``--folder``) are the example photos of ``examples/`` upscaled to
12 megapixels (landscape and portrait) with mid-frequency texture and grain added, saved at quality
90: about 3.4 MB each, like a phone's photos.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.inference.loader import Decoding  # noqa: E402
from convnets.inference.predict import iter_inputs, predict_items  # noqa: E402
from convnets.preprocessing.presets import DEFAULT_PRESET, EvalPreset, preset_for_model  # noqa: E402
from convnets.preprocessing.transforms import to_rgb  # noqa: E402
from convnets.runtime import default_workers, usable_cores  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

log = logging.getLogger("bench_fast_decode")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def make_large_photo(path: Path, i: int, size: tuple[int, int] = (4032, 3024), seed: int = 0) -> None:
    """The ``i``-th 12-megapixel photo-like JPEG; every third is portrait."""
    rng = np.random.default_rng([seed, i])
    sources = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
    shape = size if i % 3 else size[::-1]
    image = Image.open(sources[i % len(sources)]).convert("RGB").resize(shape, Image.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32)
    low = rng.normal(0, 40, (shape[1] // 8, shape[0] // 8, 3)) + 128
    texture = Image.fromarray(np.clip(low, 0, 255).astype(np.uint8)).resize(shape, Image.BICUBIC)
    pixels = pixels + 0.5 * (np.asarray(texture, dtype=np.float32) - 128) + rng.normal(0, 6, pixels.shape)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)


def make_large_photos(folder: Path, count: int, size: tuple[int, int] = (4032, 3024)) -> list[Path]:
    """``count`` JPEGs of :func:`make_large_photo` (of ``size``) in ``folder`` (kept between runs), made on every core."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"large{i:03d}.jpg" for i in range(count)]
    missing = [(p, i, size) for i, p in enumerate(paths) if not p.exists()]
    if missing:
        with ProcessPoolExecutor(usable_cores()) as pool:
            list(pool.map(make_large_photo, *zip(*missing)))
    return paths


def preprocess_variant(path: Path, preset: EvalPreset, margin: int | None, reducing_gap: float | None) -> np.ndarray:
    """The normalised HWC pixels of one variant: ``margin`` None is the exact decode."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    with Image.open(path) as image:
        if margin is not None:
            side = margin * preset.resize_size
            image.draft("RGB", (side, side))
        image.load()
        rgb = to_rgb(image)
    if reducing_gap is None:  # what convnets.preprocessing.transforms.resize_and_crop does
        resized = F.resize(rgb, [preset.resize_size], interpolation=InterpolationMode.BILINEAR, antialias=True)
    else:  # the same output size (torchvision's rule), with Pillow's reduce() first
        w, h = rgb.size
        short, long = min(w, h), max(w, h)
        other = int(preset.resize_size * long / short)
        resized = rgb.resize((preset.resize_size, other) if w <= h else (other, preset.resize_size),
                             Image.BILINEAR, reducing_gap=reducing_gap)
    cropped = F.center_crop(resized, [preset.crop_size, preset.crop_size])
    pixels = np.asarray(cropped, dtype=np.float32) / np.float32(255)
    return (pixels - np.asarray(preset.mean, np.float32)) / np.asarray(preset.std, np.float32)


VARIANTS: dict[str, tuple[int | None, float | None]] = {
    "exact": (None, None), "exact, reducing_gap 2": (None, 2.0), "exact, reducing_gap 3": (None, 3.0),
    "draft 1x": (1, None), "draft 1x, reducing_gap 1": (1, 1.0),
    "draft 2x (--fast-decode)": (2, None), "draft 2x, reducing_gap 1": (2, 1.0), "draft 2x, reducing_gap 1.5": (2, 1.5),
}


def bench_pixels(paths: list[Path], rounds: int) -> list[dict[str, object]]:
    """Per variant: difference from the exact path (normalised units) and ms per image on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exact = {p: preprocess_variant(p, DEFAULT_PRESET, None, None) for p in paths}
        diffs = {name: [np.abs(preprocess_variant(p, DEFAULT_PRESET, margin, gap) - exact[p]) for p in paths]
                 for name, (margin, gap) in VARIANTS.items()}
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        order = list(VARIANTS)
        for r in range(rounds):  # interleaved, in a rotated order, as the end-to-end rounds
            for name in order[r % len(order):] + order[:r % len(order)]:
                margin, gap = VARIANTS[name]
                start, start_cpu = time.perf_counter(), time.process_time()
                for p in paths:
                    preprocess_variant(p, DEFAULT_PRESET, margin, gap)
                times[name].append((time.perf_counter() - start) / len(paths) * 1000)
                cpu[name].append((time.process_time() - start_cpu) / len(paths) * 1000)
            log.info("pixels round %d/%d: %s", r + 1, rounds, ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in times.items()))
    finally:
        torch.set_num_threads(threads)
    return [{"variant": name, "mean_abs_diff": float(np.mean([d.mean() for d in diffs[name]])),
             "max_abs_diff": float(max(d.max() for d in diffs[name])), "ms_per_image": statistics.median(times[name]),
             "ms_all_rounds": times[name], "cpu_ms_per_image": statistics.median(cpu[name]),
             "cpu_ms_all_rounds": cpu[name]} for name in VARIANTS]


def model_cpu_ms(model: torch.nn.Module, precision: str, batch_size: int, rounds: int, compile: bool) -> list[float]:
    """CPU milliseconds per image of the model alone on one thread (no OpenMP spinning counted)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = convnets.optimize_for_inference(model, precision, compile=compile)
        x = torch.randn(batch_size, 3, DEFAULT_PRESET.crop_size, DEFAULT_PRESET.crop_size)
        with torch.inference_mode():
            net(x)
            result = []
            for _ in range(rounds):
                start = time.process_time()
                net(x)
                result.append((time.process_time() - start) / batch_size * 1000)
        return result
    finally:
        torch.set_num_threads(threads)


def bench_end_to_end(model: torch.nn.Module, folder: Path, count: int, precision: str, *, batch_size: int,
                     workers: int, rounds: int, device: torch.device, compile: bool) -> dict[str, list[float]]:
    """img/s of ``predict`` over the folder, exact and fast, in interleaved rounds."""
    net = convnets.optimize_for_inference(model, precision, device, compile=compile)
    preset = preset_for_model(model)
    labels = [str(i) for i in range(model.num_classes)]

    def run(fast: bool) -> Callable[[], float]:
        def once() -> float:
            decoding = Decoding(preset, workers=workers, fast_decode=fast, decode="cpu")  # Pillow, on a GPU too
            start = time.perf_counter()
            done = sum(1 for r in predict_items(net, iter_inputs([str(folder)]), labels=labels,
                                                batch_size=batch_size, device=device, decoding=decoding) if r.ok)
            assert done == count, done
            return done / (time.perf_counter() - start)
        return once

    x = torch.randn(batch_size, 3, preset.crop_size, preset.crop_size, device=device)

    def model_only() -> float:  # the ceiling: the same number of batches, no decoding
        batches = -(-count // batch_size)
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(batches):
                net(x).cpu()  # as predict reads each batch's results back
        return batches * batch_size / (time.perf_counter() - start)

    variants = {"exact": run(False), "fast": run(True), "model only": model_only}
    with torch.inference_mode():
        net(x)  # warm-up
    speeds: dict[str, list[float]] = {label: [] for label in variants}
    order = list(variants)
    for r in range(rounds):
        shift = r % len(order)
        for label in order[shift:] + order[:shift]:
            speeds[label].append(variants[label]())
        log.info("round %d/%d: %s", r + 1, rounds, ", ".join(f"{k} {v[-1]:.2f} img/s" for k, v in speeds.items()))
    return speeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="se_resnext101_32x4d")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default) or cuda")
    parser.add_argument("--no-compile", action="store_true",
                        help="run the model without torch.compile (on a GPU it outruns decoding either way, and "
                             "compiling takes a minute)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--images", type=int, default=24, help="12-megapixel JPEGs in the folder (default 24)")
    parser.add_argument("--pixel-images", type=int, default=6, help="of which the pixel comparison uses (default 6)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_fast_decode"),
                        help="where the generated JPEGs are kept between runs")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"decoding processes (default: convnets predict's for the device, here "
                             f"{default_workers('cpu')} for cpu, {default_workers('cuda')} for cuda)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--skip-pixels", action="store_true", help="only the end-to-end comparison")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_fast_decode.json, "
                                                         "bench_fast_decode_cuda.json with --device cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.json = args.json or results.default_path("bench_fast_decode", args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    folder = args.folder / f"{args.images}"
    paths = make_large_photos(folder, args.images)
    size_mb = sum(p.stat().st_size for p in paths) / len(paths) / 2**20
    workers = default_workers(device.type) if args.workers is None else args.workers
    env = environment(args.device)
    pixels = [] if args.skip_pixels else bench_pixels(paths[:args.pixel_images], args.rounds)
    torch.manual_seed(0)
    model = convnets.get_model(args.model).eval()
    model_cpu = [] if device.type != "cpu" else model_cpu_ms(model, args.precision, args.batch_size, args.rounds,
                                                             not args.no_compile)
    speeds = bench_end_to_end(model, folder, len(paths), args.precision, batch_size=args.batch_size,
                              workers=workers, rounds=args.rounds, device=device, compile=not args.no_compile)
    ratios = [f / e for f, e in zip(speeds["fast"], speeds["exact"])]
    print(f"{env['date']}; {env['cpu_model']}, {usable_cores()} usable cores, {env['torch_threads']} threads; "
          f"torch {env['torch']}; {len(paths)} JPEGs of 4032x3024 ({size_mb:.1f} MB)")
    if pixels and model_cpu:  # (with the model on a GPU, the CPU only decodes)
        print()
        print(f"pixels vs the exact path ({args.pixel_images} images; normalised units), preprocessing on one thread:")
        print("| variant | mean abs diff | max abs diff | wall ms/image (median; min-max) | CPU ms/image |")
        print("|---|---:|---:|---:|---:|")
        for row in pixels:
            ms = row["ms_all_rounds"]
            assert isinstance(ms, list)
            print(f"| {row['variant']} | {row['mean_abs_diff']:.4f} | {row['max_abs_diff']:.3f} | "
                  f"{row['ms_per_image']:.0f} ({min(ms):.0f}-{max(ms):.0f}) | {row['cpu_ms_per_image']:.0f} |")
        # What an otherwise idle machine gives when decoding and the model share the cores perfectly:
        # CPU time is what load from other processes changes least.
        model_ms = statistics.median(model_cpu)
        by_name = {str(row["variant"]): float(row["cpu_ms_per_image"]) for row in pixels}  # type: ignore[arg-type]
        exact_ms = by_name["exact"]
        print()
        print(f"CPU budget per image: model {model_ms:.0f} ms (1 thread, {args.precision}); end-to-end estimate "
              f"(preprocess + model CPU time), relative to exact:")
        for name, ms in by_name.items():
            if name.startswith("draft"):
                print(f"  {name}: ({exact_ms:.0f} + {model_ms:.0f}) / ({ms:.0f} + {model_ms:.0f}) = "
                      f"{(exact_ms + model_ms) / (ms + model_ms):.2f}x")
    print()
    print(f"end to end: predict, {args.model} {args.precision} on {env['device_name']}"
          f"{' (not compiled)' if args.no_compile else ''}, batch {args.batch_size}, workers {workers}; "
          f"median of {args.rounds} interleaved rounds (min-max):")
    print("| variant | img/s | all rounds |")
    print("|---|---:|---|")
    for label, values in speeds.items():
        print(f"| {label} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    print(f"speed-up fast / exact: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    results.save(args.json, env, {"images": len(paths), "image_mb": size_mb, "model": args.model,
                                  "precision": args.precision, "device": args.device,
                                  "compile": not args.no_compile, "batch_size": args.batch_size, "workers": workers,
                                  "rounds": args.rounds, "pixels": pixels, "model_cpu_ms": model_cpu,
                                  "end_to_end": speeds, "speedup": ratios,
                                  "speedup_median": statistics.median(ratios)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
