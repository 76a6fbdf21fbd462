"""Training throughput of the fine-tuning loop's real optimizer step: fp32 vs AMP, NCHW vs NHWC.

Times :func:`convnets.train.benchmark_training` (forward under autocast, label-smoothed loss,
backward, SGD step with the recipe's weight decay, lr schedule step) on a synthetic batch that sits
on the device, for every combination of precision and memory format, and prints img/s side by side
with ratios to fp32/NCHW. The same command runs on a GPU (``--device cuda``: AMP = fp16 with the
GradScaler, fp32 = TF32) and on a CPU (AMP = bf16 autocast).

    python benchmarks/bench_train.py                                   # small CPU run, ~1-2 min
    python benchmarks/bench_train.py --device cuda --arch se_resnext101_32x4d --tiny 0 \\
        --batch-size 128 --image-size 224 --steps 30

Every result (including per-step latencies) goes to ``benchmarks/results/bench_train.json``, or
``bench_train_cuda.json`` for a run on a GPU (``--json FILE`` elsewhere; see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.train import benchmark_training  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402  (benchmarks/results.py)

TINY = {"layers": [1, 1, 1, 1], "widths": [32, 64, 128, 256], "cardinality": 8, "expansion": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="resnext101_32x4d")
    parser.add_argument("--tiny", type=int, default=1,
                        help=f"1 (default): shrink the architecture to {TINY} so a CPU finishes quickly")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--amp-dtype", choices=["fp16", "bf16"],
                        help="AMP dtype (default: fp16 on CUDA, bf16 on CPU)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    results.add_output_option(parser, None, default_help="benchmarks/results/bench_train.json, "
                                                         "bench_train_cuda.json on a GPU")
    args = parser.parse_args()
    args.json = args.json or results.default_path("bench_train", args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = args.amp_dtype or ("fp16" if args.device.startswith("cuda") else "bf16")
    arch_kwargs = TINY if args.tiny else None
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.arch}{' (tiny: ' + json.dumps(TINY) + ')' if args.tiny else ''}, batch {args.batch_size}, "
          f"{args.image_size}px, {args.steps} timed steps after {args.warmup}; {device_name}; torch {torch.__version__}")
    # One untimed run first: thread pools, library loading and kernel caches warm up once per
    # process and would otherwise be charged to whichever configuration runs first.
    benchmark_training(args.arch, batch_size=args.batch_size, device=args.device, amp_dtype=None, steps=1,
                       warmup=1, arch_kwargs=arch_kwargs, image_size=args.image_size)
    rows = []
    for dtype in (None, amp):
        for layout in ("nchw", "nhwc"):
            r = benchmark_training(args.arch, batch_size=args.batch_size, device=args.device, amp_dtype=dtype,
                                   memory_format=layout, steps=args.steps, warmup=args.warmup,
                                   arch_kwargs=arch_kwargs, image_size=args.image_size)
            base = rows[0]["img_per_s"] if rows else r["img_per_s"]
            rows.append({**r, "vs_fp32_nchw": r["img_per_s"] / base})
            print(f"  {dtype or 'fp32':>5} {layout}: {r['img_per_s']:9.1f} img/s  median step "
                  f"{r['median_ms']:8.1f} ms  x{r['img_per_s'] / base:.2f} vs fp32 nchw", flush=True)
    results.save(args.json, environment(args.device), {
        "arch": args.arch, "tiny_kwargs": TINY if args.tiny else None, "device": args.device,
        "device_name": device_name, "batch_size": args.batch_size, "image_size": args.image_size,
        "steps": args.steps, "warmup": args.warmup, "amp_dtype": amp, "threads": torch.get_num_threads(),
        "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
