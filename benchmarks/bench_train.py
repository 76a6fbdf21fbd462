"""Training throughput of the fine-tuning loop's real optimizer step: fp32 vs AMP, NCHW vs NHWC.

Times :func:`convnets.train.benchmark_training` (forward under autocast, label-smoothed loss,
backward, SGD step with the recipe's weight decay, lr schedule step) on a synthetic batch that sits
on the device, for every combination of precision and memory format, and prints img/s side by side
with ratios to fp32/NCHW. The same command runs on a GPU (``--device cuda``: AMP = fp16 with the
GradScaler, fp32 = TF32) and on a CPU (AMP = bf16 autocast).

    python benchmarks/bench_train.py                                   # small CPU run, ~1-2 min
    python benchmarks/bench_train.py --device cuda --arch se_resnext101_32x4d --tiny 0 \\
        --batch-size 128 --image-size 224 --steps 30

``--json FILE`` also writes every result (including per-step latencies).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convnets.train import benchmark_training  # noqa: E402

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
    parser.add_argument("--json", type=Path, help="write all results to this file")
    args = parser.parse_args()
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
    results = []
    for dtype in (None, amp):
        for layout in ("nchw", "nhwc"):
            r = benchmark_training(args.arch, batch_size=args.batch_size, device=args.device, amp_dtype=dtype,
                                   memory_format=layout, steps=args.steps, warmup=args.warmup,
                                   arch_kwargs=arch_kwargs, image_size=args.image_size)
            results.append(r)
            base = results[0]["img_per_s"]
            print(f"  {dtype or 'fp32':>5} {layout}: {r['img_per_s']:9.1f} img/s  median step "
                  f"{r['median_ms']:8.1f} ms  x{r['img_per_s'] / base:.2f} vs fp32 nchw", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
