"""Inference engines side by side in one process: which one ``engine="auto"`` should pick.

Usage::

    python benchmarks/bench_engines.py                                   # the README's table (slow)
    python benchmarks/bench_engines.py --models resnext101_32x4d --batch-sizes 16 --rounds 3   # quicker
    python benchmarks/bench_engines.py --image-size 128 --rounds 2 --warmup 1                  # a smoke run
    python benchmarks/bench_engines.py --int8              # int8 vs bf16 (issue 9's 1.5x gate), ResNeXt101 b16
    python benchmarks/bench_engines.py --settings          # OpenVINO / ONNX Runtime settings vs their defaults

For each model and batch size, on random weights (BatchNorm statistics calibrated on random
inputs, so that activations and the faithfulness checks behave as with trained weights; speed
does not depend on the values):

* ``timm fp32``        -- ``timm.create_model(name)`` eager fp32: the reference column;
* ``torch fp32/bf16``  -- ``optimize_for_inference(model, p, engine="torch")`` (folded, channels_last, compiled);
* ``onnxruntime fp32`` -- ``engine="onnxruntime"``;
* ``openvino fp32/bf16`` -- ``engine="openvino"`` (INFERENCE_PRECISION_HINT f32 / bf16);
* ``auto fp32/bf16``   -- ``engine="auto"`` (its pick is in the label);
* ``openvino int8``    -- ``precision="int8"``: NNCF post-training quantization calibrated on
  :func:`calibration_photos` (real photos from the package and scikit-image, cropped and flipped);
  the last lines give its speed over ``openvino bf16`` per round (median, min-max).

A variant may carry engine settings after its precision, ``ENGINE PRECISION KEY=VALUE ...``:
OpenVINO CPU properties (``openvino bf16 PERFORMANCE_HINT=THROUGHPUT``) or ONNX Runtime
``SessionOptions`` attributes (``onnxruntime fp32 intra_op_num_threads=2``); ``--settings`` runs
the list :data:`SETTINGS` at batch 1 and 16 on ResNeXt101-32x4d.

Measurements are interleaved: every round times each variant once (rotated order) and ratios are
taken within the round, so load from other processes hits numerator and denominator alike; the
table reports medians over rounds. The last lines say, per precision, whether auto's pick was the
fastest engine measured (the check of :data:`convnets.deploy.engines.AUTO_ORDER`).

Results go to ``benchmarks/results/bench_engines.json``, with ``--int8`` to
``bench_engines_int8.json`` and with ``--settings`` to ``bench_engines_settings.json`` (``--json
FILE`` elsewhere; see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import convnets  # noqa: E402
from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.deploy.calibrate import calibrate_batchnorm  # noqa: E402
from convnets.deploy.engines import EngineSettings, available_engines  # noqa: E402
import results  # noqa: E402  (benchmarks/results.py)
from interleave import Runner, interleaved_rows  # noqa: E402  (benchmarks/interleave.py)

REFERENCE = "timm fp32"
VARIANTS = ("torch fp32", "onnxruntime fp32", "openvino fp32", "auto fp32", "torch bf16", "openvino bf16",
            "auto bf16", "openvino int8")
#: ``--int8``: the gate of issue 9 (int8 at least 1.5x OpenVINO bf16 on ResNeXt101 at batch 16).
INT8_VARIANTS = ("openvino bf16", "openvino int8")
#: ``--settings``: each engine's defaults against the settings worth trying on a small CPU.
SETTINGS = (
    "openvino fp32", "openvino fp32 PERFORMANCE_HINT=THROUGHPUT",
    "openvino fp32 ENABLE_CPU_PINNING=YES", "openvino fp32 INFERENCE_NUM_THREADS=1",
    "openvino bf16", "openvino bf16 PERFORMANCE_HINT=THROUGHPUT", "openvino bf16 NUM_STREAMS=2",
    "openvino bf16 ENABLE_CPU_PINNING=YES", "openvino bf16 ENABLE_CPU_PINNING=NO",
    "onnxruntime fp32", "onnxruntime fp32 intra_op_num_threads=1",
    "onnxruntime fp32 graph_optimization_level=ORT_ENABLE_EXTENDED",
    "onnxruntime fp32 execution_mode=ORT_PARALLEL",
    # ONNX Runtime's idle threads spin by default, taking the CPU from whatever runs next.
    "onnxruntime fp32 session.intra_op.allow_spinning=0",
)


def calibration_photos(image_size: int, count: int = 32) -> torch.Tensor:
    """``count`` preprocessed crops of real photos: int8 calibration data for random-weight models.

    The package's example photos and scikit-image's colour photos (when installed), each as a
    whole, flipped, and as four corner crops of 60%, through the evaluation preprocessing.
    """
    from PIL import Image, ImageOps

    from convnets.assets import example_images
    from convnets.preprocessing import prepare_input_from_uri
    from convnets.preprocessing.presets import EvalPreset

    photos = [Image.open(p).convert("RGB") for p in example_images()]
    try:
        import skimage.data

        photos += [Image.fromarray(getattr(skimage.data, n)()).convert("RGB")
                   for n in ("astronaut", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "camera")]
    except ImportError:
        logging.warning("scikit-image is not installed: int8 is calibrated on %d photos only", len(photos))
    crops = []
    for photo in photos:
        w, h = photo.size
        cw, ch = int(w * 0.6), int(h * 0.6)
        crops += [photo, ImageOps.mirror(photo)]
        crops += [photo.crop((x, y, x + cw, y + ch)) for x in (0, w - cw) for y in (0, h - ch)]
    return prepare_input_from_uri(crops[:count], preset=EvalPreset.for_image_size(image_size))


def _runners(name: str, wanted: list[str], image_size: int) -> dict[str, Runner]:
    model = convnets.get_model(name)
    calibrate_batchnorm(model, image_size=image_size, batch_size=4, batches=2)
    model.input_size = image_size
    runners: dict[str, Runner] = {}
    cpu = torch.device("cpu")
    for label in wanted:
        engine, precision, *settings = label.split()
        if engine != "auto" and engine not in available_engines(precision, cpu):
            logging.warning("%s: not installed or not runnable here; skipped", label)
            continue
        start = time.perf_counter()
        calibration = calibration_photos(image_size) if precision == "int8" else None
        options = dict(setting.split("=", 1) for setting in settings)
        typed = {k: int(v) if v.isdigit() and engine == "onnxruntime" else v for k, v in options.items()}
        built = convnets.optimize_for_inference(model, precision, engine=engine, calibration_data=calibration,
                                                settings=EngineSettings(runtime={engine: typed}))
        if precision == "int8":
            check = built.calibration_check
            logging.info("%s %s: top-1 agreement with fp32 %.1f%% on %s, min cosine %.4f", name, label,
                         100 * check.top1_agreement, check.inputs, check.min_cosine)
        if engine == "auto":
            label = f"{label} ({built.engine})"
        runners[label] = built
        logging.info("%s %s built in %.1f s", name, label, time.perf_counter() - start)
    return runners


def bench(name: str, runners: dict[str, Runner], batch_size: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """Interleaved rounds of every runner (``REFERENCE`` among them) at one batch size: one row per runner."""
    x = torch.randn(batch_size, 3, args.image_size, args.image_size)
    return interleaved_rows(name, runners, x, reference=REFERENCE, warmup=args.warmup, rounds=args.rounds,
                            calls=args.calls, settle=args.settle)


def auto_verdicts(rows: list[dict[str, object]]) -> list[str]:
    """Per model, batch and precision: auto's pick and the fastest engine measured."""
    lines = []
    keys = sorted({(r["model"], r["batch_size"]) for r in rows}, key=str)
    for model, batch in keys:
        group = [r for r in rows if (r["model"], r["batch_size"]) == (model, batch)]
        for precision in ("fp32", "bf16"):
            engines = {r["variant"].split()[0]: r["img_per_s"] for r in group
                       if str(r["variant"]).split()[1:] == [precision] and not str(r["variant"]).startswith("auto")
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


def int8_baseline(label: str) -> str | None:
    """int8 variants are compared with OpenVINO bf16 (issue 9's gate: at least 1.5x)."""
    return "openvino bf16" if label.split()[1:2] == ["int8"] else None


def settings_baseline(label: str) -> str | None:
    """A variant with settings is compared with the same engine and precision at its defaults."""
    words = label.split()
    return " ".join(words[:2]) if len(words) > 2 else None


def ratio_verdicts(rows: list[dict[str, object]], baseline_of: Callable[[str], str | None]) -> list[str]:
    """Per model and batch, each variant's speed over its ``baseline_of(variant)``, from per-round ratios."""
    import statistics

    lines = []
    for model, batch in sorted({(r["model"], r["batch_size"]) for r in rows}, key=str):
        group = {r["variant"]: r["img_per_s_all_rounds"] for r in rows if (r["model"], r["batch_size"]) == (model, batch)}
        for label, speeds in group.items():
            baseline = baseline_of(str(label))
            if baseline is None or baseline not in group:
                continue
            ratios = [a / b for a, b in zip(speeds, group[baseline])]
            lines.append(f"{model} b{batch}: {label} / {baseline} = {statistics.median(ratios):.2f}x "
                         f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated (default: resnext101_32x4d,se_resnext101_32x4d; "
                        "resnext101_32x4d with --int8 or --settings)")
    parser.add_argument("--batch-sizes", help="comma-separated (default: 1,16; 16 with --int8)")
    parser.add_argument("--variants",
                        help=f"comma-separated, from {VARIANTS}, each optionally followed by engine settings "
                             "(e.g. 'openvino bf16 PERFORMANCE_HINT=THROUGHPUT'); default: all of them, "
                             "INT8_VARIANTS with --int8, SETTINGS with --settings")
    parser.add_argument("--int8", action="store_true", help="int8 against OpenVINO bf16 only, ResNeXt101 at batch "
                        "16 (unless --models / --batch-sizes say otherwise)")
    parser.add_argument("--settings", action="store_true", help="the engine settings of SETTINGS against the "
                        "engines' defaults, ResNeXt101 at batch 1 and 16")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant (the first one compiles)")
    parser.add_argument("--calls", type=int, default=1, help="calls per variant per round")
    parser.add_argument("--settle", type=float, default=0.5, metavar="SECONDS",
                        help="idle time before each variant's timing, so that the previous runtime's spinning "
                             "threads stop (0: none; see benchmarks/interleave.py)")
    parser.add_argument("--image-size", type=int, default=224, help="input size (smaller: a quicker, less "
                                                                    "representative run)")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_engines.json; with --int8 "
                                                         "bench_engines_int8.json, with --settings "
                                                         "bench_engines_settings.json")
    args = parser.parse_args()
    # Defaults depend on the mode; an option given on the command line is kept as given, even when
    # it equals the plain run's default.
    focused = args.int8 or args.settings
    stem = "bench_engines_int8" if args.int8 else "bench_engines_settings" if args.settings else "bench_engines"
    args.json = args.json or results.default_path(stem)
    args.models = args.models or ("resnext101_32x4d" if focused else "resnext101_32x4d,se_resnext101_32x4d")
    args.batch_sizes = args.batch_sizes or ("16" if args.int8 else "1,16")
    args.variants = args.variants or ",".join(INT8_VARIANTS if args.int8 else SETTINGS if args.settings else VARIANTS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    import timm

    env = environment("cpu")
    load_before = os.getloadavg()[0]  # other processes' load, which interleaving shares out but does not remove
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        reference = timm.create_model(name.replace("se_resnext", "seresnext")).eval()  # timm's spelling
        # Built once per model: graphs have a dynamic batch axis (torch compiles per batch size at
        # the first call, which the warm-up absorbs and reports).
        runners = {REFERENCE: reference, **_runners(name, args.variants.split(","), args.image_size)}
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            rows += bench(name, runners, batch_size, args)
    load_after = os.getloadavg()[0]
    print(f"{env['date']}; {env['cpu_model']}, {env['cpu_count']} cores, {env['torch_threads']} threads; "
          f"torch {env['torch']}, timm {timm.__version__}; {args.image_size} px; median of {args.rounds} "
          f"interleaved rounds; load average before and after: {load_before:.1f}, {load_after:.1f}")
    print()
    print("| model | batch | variant | img/s | vs timm fp32 (median, min-max) | warm-up (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        lo, hi = row["speedup_min_max"]
        print(f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['img_per_s']:.2f} | "
              f"{row['speedup_vs_timm']:.2f}x ({lo:.2f}-{hi:.2f}) | {row['warmup_s']:.1f} |")
    print()
    verdicts = auto_verdicts(rows)
    ratios = ratio_verdicts(rows, settings_baseline if args.settings else int8_baseline)
    for line in verdicts + ratios:
        print(line)
    results.save(args.json, env, {"mode": "int8" if args.int8 else "settings" if args.settings else "engines",
                                  "models": args.models.split(","), "batch_sizes": args.batch_sizes.split(","),
                                  "image_size": args.image_size, "rounds": args.rounds, "warmup": args.warmup,
                                  "calls": args.calls, "settle_s": args.settle, "timm": timm.__version__,
                                  "load_average": [load_before, load_after], "rows": rows,
                                  "auto_verdicts": verdicts, "ratio_verdicts": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
