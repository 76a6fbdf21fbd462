"""``predict`` with JPEGs decoded on the device, against the CPU's decoding and the model alone (issue 38).

Usage::

    python benchmarks/bench_decode.py                  # on a GPU: SE-ResNeXt101 fp16 compiled, ~3-5 minutes
    python benchmarks/bench_decode.py --device cpu --quick --json /tmp/decode.json   # end to end on a CPU, tiny

What it measures, in one process, with random weights (speed does not depend on them; the BatchNorm
statistics are randomised so that the logits differ between images):

* ``throughput``, per image set: ``12mp``, photo-like 4032x3024 JPEGs (bench_fast_decode's, about 3.4 MB
  each, every third portrait), and ``imagenet``, 500x375 ones made the same way (ImageNet's typical size):

  - ``model only``: the optimised model (``convnets.optimize_for_inference``: BN folded, channels_last,
    ``--precision``, compiled unless ``--no-compile``) on a ready batch, as many batches as the set has,
    each batch's top-5 read back as ``predict`` does: the ceiling;
  - ``predict --decode cpu``: :func:`convnets.inference.predict.predict_items` over the folder with the same
    model, Pillow decoding in ``convnets predict``'s default ``--workers`` for the device;
  - ``predict --decode device``: the same with JPEGs decoded, resized, cropped and normalised on the device
    (the workers only read the files).

  Rounds interleave the three in a rotated order; ratios to ``model only`` are taken within a round (median,
  min-max). Targets (issue 38): ``device / model only`` at least 0.5 on ``12mp``, 0.8 on ``imagenet``.
* ``agreement``: the device path against the Pillow path on the same files (the package's photos re-encoded
  as baseline JPEGs, and the first images of each set): top-1 agreement of the model's logits (target 99 %),
  the smallest per-image cosine similarity of the logits (target 0.999), and the largest and mean absolute
  pixel difference of the preprocessed batches (normalised units; one uint8 level is about 0.017).

The images are generated once into ``--folder`` (on every core) and kept between runs.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import convnets  # noqa: E402
from bench_fast_decode import make_large_photos  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.inference.loader import Decoding, iter_batches  # noqa: E402
from convnets.inference.predict import iter_inputs, predict_items  # noqa: E402
from convnets.preprocessing.presets import preset_for_model  # noqa: E402
from convnets.runtime import default_workers  # noqa: E402

import results  # noqa: E402

log = logging.getLogger("bench_decode")

EXAMPLES = Path(__file__).resolve().parents[1] / "convnets" / "assets" / "examples"
#: The issue's targets: device-decode predict over model-only throughput, per image set.
TARGETS = {"12mp": 0.5, "imagenet": 0.8}
SIZES = {"12mp": (4032, 3024), "imagenet": (500, 375)}
QUICK_SIZES = {"12mp": (1600, 1200), "imagenet": (500, 375)}


def randomize_bn(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """BatchNorm statistics and affine terms of trained-network magnitudes (as tests/conftest.py's), small last
    gammas of each block, so that random-weight logits depend on the image."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                if name.endswith("bn3"):
                    m.weight.mul_(0.2)
    return model


def make_set(folder: Path, name: str, count: int, quick: bool) -> list[Path]:
    """``count`` JPEGs of the set ``name`` in ``folder/name-WxH-count`` (made once)."""
    size = (QUICK_SIZES if quick else SIZES)[name]
    return make_large_photos(folder / f"{name}-{size[0]}x{size[1]}-{count}", count, size=size)


def example_jpegs(folder: Path) -> list[Path]:
    """The package's photos as baseline JPEGs (PNGs re-encoded at quality 92), for the agreement."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in sorted(EXAMPLES.glob("*.*g")):
        path = folder / f"{source.stem}.jpg"
        if source.suffix == ".jpg":
            path.write_bytes(source.read_bytes())
        else:
            buffer = io.BytesIO()
            Image.open(source).convert("RGB").save(buffer, "JPEG", quality=92)
            path.write_bytes(buffer.getvalue())
        paths.append(path)
    return paths


def agreement(net: torch.nn.Module, paths: list[Path], preset: object, device: torch.device,
              batch_size: int, workers: int) -> dict[str, object]:
    """The device path's preprocessed batches and logits against the Pillow path's on ``paths``."""
    items = [(str(p), None) for p in paths]
    tensors, logits = {}, {}
    for mode in ("cpu", "device"):
        decoding = Decoding(preset, workers=workers, decode=mode).for_device(device)  # type: ignore[arg-type]
        batches = list(iter_batches(items, batch_size=batch_size, decoding=decoding, device=device))
        assert all(not b.errors for b in batches), [b.errors for b in batches]
        tensors[mode] = torch.cat([b.tensor.float() for b in batches])
        with torch.inference_mode():
            logits[mode] = torch.cat([net(b.tensor).float() for b in batches])
    difference = (tensors["device"] - tensors["cpu"]).abs()
    cosine = torch.nn.functional.cosine_similarity(logits["device"].double(), logits["cpu"].double(), dim=1)
    same = (logits["device"].argmax(1) == logits["cpu"].argmax(1)).float()
    return {"images": len(paths), "top1_agreement": float(same.mean()), "min_cosine": float(cosine.min()),
            "mean_cosine": float(cosine.mean()), "max_abs_diff": float(difference.max()),
            "mean_abs_diff": float(difference.mean())}


def throughput(net: torch.nn.Module, folder: Path, count: int, preset: object, *, batch_size: int, workers: int,
               rounds: int, device: torch.device) -> dict[str, list[float]]:
    """img/s of model only, predict with Pillow decoding and predict with device decoding, interleaved."""
    labels = [str(i) for i in range(1000)]

    def run(mode: str) -> Callable[[], float]:
        def once() -> float:
            decoding = Decoding(preset, workers=workers, decode=mode)  # type: ignore[arg-type]
            start = time.perf_counter()
            done = sum(1 for r in predict_items(net, iter_inputs([str(folder)]), labels=labels, batch_size=batch_size,
                                                device=device, decoding=decoding) if r.ok)
            assert done == count, (mode, done, count)
            return done / (time.perf_counter() - start)
        return once

    x = torch.randn(batch_size, 3, preset.crop_size, preset.crop_size, device=device)  # type: ignore[attr-defined]

    def model_only() -> float:
        batches = -(-count // batch_size)
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(batches):
                torch.softmax(net(x).float(), dim=1).topk(5, dim=1)[0].cpu()  # what predict reads back
        return batches * batch_size / (time.perf_counter() - start)

    variants = {"model only": model_only, "predict --decode cpu": run("cpu"), "predict --decode device": run("device")}
    speeds: dict[str, list[float]] = {label: [] for label in variants}
    order = list(variants)
    for r in range(rounds):
        shift = r % len(order)
        for label in order[shift:] + order[:shift]:
            speeds[label].append(variants[label]())
        log.info("%s round %d/%d: %s", folder.name, r + 1, rounds,
                 ", ".join(f"{k} {v[-1]:.1f} img/s" for k, v in speeds.items()))
    return speeds


def ratios(speeds: dict[str, list[float]], label: str) -> list[float]:
    return [v / m for v, m in zip(speeds[label], speeds["model only"])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="where the model runs and JPEGs are decoded (default cuda)")
    parser.add_argument("--model", default="se_resnext101_32x4d")
    parser.add_argument("--precision", default=None, help="default fp16 on a GPU, fp32 on a CPU")
    parser.add_argument("--no-compile", action="store_true", help="run the model without torch.compile")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--images-12mp", type=int, default=128, help="12-megapixel JPEGs (a multiple of the batch)")
    parser.add_argument("--images-imagenet", type=int, default=1024, help="500x375 JPEGs (a multiple of the batch)")
    parser.add_argument("--agreement-images", type=int, default=32, help="of each set, compared with Pillow's path")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"decoding processes (default: convnets predict's for the device, {default_workers('cuda')} "
                             "for cuda here)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_decode"),
                        help="where the generated JPEGs are kept between runs")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes to check the script end to end (resnet50 at 64 px, 1600x1200 'large' images, "
                             "8 of each, batch 4, one round, no compiling); the numbers mean nothing")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_decode_cuda.json on a GPU, "
                                                         "bench_decode.json on a CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (use --device cpu --quick to check the script)")
    if args.quick:
        args.model, args.batch_size, args.rounds, args.no_compile = "resnet50", 4, 1, True
        args.images_12mp = args.images_imagenet = 8
        args.agreement_images = 4
    precision = args.precision or ("fp16" if device.type == "cuda" else "fp32")
    for name in ("images_12mp", "images_imagenet"):
        if getattr(args, name) % args.batch_size:
            parser.error(f"--{name.replace('_', '-')} must be a multiple of --batch-size (one compiled shape)")
    args.json = args.json or results.default_path("bench_decode", args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    start = time.perf_counter()

    sets = {"12mp": make_set(args.folder, "12mp", args.images_12mp, args.quick),
            "imagenet": make_set(args.folder, "imagenet", args.images_imagenet, args.quick)}
    log.info("images ready after %.0f s", time.perf_counter() - start)
    workers = default_workers(device.type) if args.workers is None else args.workers
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(args.model)).eval()
    preset = preset_for_model(model)
    if args.quick:
        preset = preset.with_crop_size(64)
    compile = not args.no_compile
    net = convnets.optimize_for_inference(model, precision, device, compile=compile)
    warm = time.perf_counter()
    with torch.inference_mode():
        net(torch.randn(args.batch_size, 3, preset.crop_size, preset.crop_size, device=device))
    warmup_s = time.perf_counter() - warm
    log.info("model ready (warm-up %.1f s)", warmup_s)

    # Not compiled: the agreement's batches are of other sizes, each a recompilation of the compiled model.
    eager = convnets.optimize_for_inference(model, precision, device, compile=False) if compile else net
    agree = {"examples": agreement(eager, example_jpegs(args.folder / "examples"), preset, device, args.batch_size,
                                   workers)}
    for name, paths in sets.items():
        agree[name] = agreement(eager, paths[:args.agreement_images], preset, device, args.batch_size, workers)
    log.info("agreement: %s", agree)
    speeds = {name: throughput(net, paths[0].parent, len(paths), preset, batch_size=args.batch_size, workers=workers,
                               rounds=args.rounds, device=device) for name, paths in sets.items()}
    env = environment(args.device)
    rows = []
    for name, per_variant in speeds.items():
        size_mb = sum(p.stat().st_size for p in sets[name]) / len(sets[name]) / 2**20
        for label, values in per_variant.items():
            versus = ratios(per_variant, label)
            rows.append({"set": name, "image_mb": size_mb, "variant": label,
                         "img_per_s": statistics.median(values), "all_rounds": values,
                         "vs_model_only": statistics.median(versus), "vs_model_only_min_max": [min(versus), max(versus)]})
    verdicts = {name: {"target": TARGETS[name],
                       "device_vs_model_only": statistics.median(ratios(speeds[name], "predict --decode device")),
                       "cpu_vs_model_only": statistics.median(ratios(speeds[name], "predict --decode cpu"))}
                for name in speeds}
    for verdict in verdicts.values():
        verdict["met"] = verdict["device_vs_model_only"] >= verdict["target"]
    print(f"{env['date']}; {env.get('device_name', env['cpu_model'])}; torch {env['torch']}; {args.model} {precision}"
          f"{' compiled' if compile else ''}, batch {args.batch_size}, {workers} workers")
    print("| set | variant | img/s (median) | vs model only |")
    print("|---|---|---:|---:|")
    for row in rows:
        lo, hi = row["vs_model_only_min_max"]
        print(f"| {row['set']} | {row['variant']} | {row['img_per_s']:.1f} | {row['vs_model_only']:.2f} "
              f"({lo:.2f}-{hi:.2f}) |")
    for name, verdict in verdicts.items():
        print(f"{name}: device decode {verdict['device_vs_model_only']:.2f}x model only, target {verdict['target']}: "
              f"{'met' if verdict['met'] else 'NOT met'}")
    for name, a in agree.items():
        print(f"agreement {name} ({a['images']} images): top-1 {100 * a['top1_agreement']:.1f} %, cosine min "  # type: ignore[operator]
              f"{a['min_cosine']:.5f}, pixels max {a['max_abs_diff']:.3f} mean {a['mean_abs_diff']:.4f}")
    results.save(args.json, env, {
        "model": args.model, "precision": precision, "compile": compile, "device": str(device),
        "batch_size": args.batch_size, "workers": workers, "rounds": args.rounds, "quick": args.quick,
        "crop_size": preset.crop_size, "warmup_s": warmup_s,
        "sizes": {name: list((QUICK_SIZES if args.quick else SIZES)[name]) for name in sets},
        "images": {name: len(paths) for name, paths in sets.items()},
        "rows": rows, "verdicts": verdicts, "agreement": agree,
        "seconds": time.perf_counter() - start})
    return 0


if __name__ == "__main__":
    sys.exit(main())
