"""Throughput and latency measurement, reported in the shape of NVIDIA's published tables.

NVIDIA's ConvNets READMEs report, per batch size, the throughput in images per second and latency
percentiles in milliseconds (https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/
Classification/ConvNets/resnext101-32x4d#inference-performance-results). :func:`format_table`
prints the same columns, so a GPU run of ``convnets benchmark`` compares with them directly.

Inference is measured here; training throughput is measured on the fine-tuning loop's real
optimizer step by ``convnets.train.benchmark_training`` and summarised the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from convnets.errors import InvalidArgumentError

__all__ = ["BatchResult", "benchmark_inference", "environment", "format_engine_table", "format_table", "summarize"]


@dataclass(frozen=True)
class BatchResult:
    """Measurements at one batch size.

    Attributes:
        batch_size: images per call.
        iterations: timed calls.
        throughput: images per second over all timed calls.
        latency_ms: per-call latency percentiles and mean, in milliseconds
            (keys ``p50``, ``p90``, ``p95``, ``p99``, ``mean``).
        first_call_s: seconds of the first call (includes compilation for compiled models);
            ``None`` where not measured (training mode).
    """

    batch_size: int
    iterations: int
    throughput: float
    latency_ms: dict[str, float]
    first_call_s: float | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return dataclasses.asdict(self)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def benchmark_inference(
    model: Callable[[Tensor], Tensor],
    batch_sizes: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 5,
    iterations: int = 20,
    image_size: int = 224,
    memory_format: torch.memory_format = torch.contiguous_format,
    autocast_dtype: torch.dtype | None = None,
) -> list[BatchResult]:
    """Time ``model`` on random ``[B, 3, image_size, image_size]`` batches, for each batch size.

    Each batch size gets ``warmup`` untimed calls (the first one, timed separately, is where
    ``torch.compile`` compiles), then ``iterations`` timed calls, each ended by a device
    synchronisation so that latencies are real. Inputs are created on ``device`` beforehand:
    no host-to-device copy is timed, as in NVIDIA's measurements.

    Args:
        model: an eval-mode module or any callable on a batch (e.g. an
            :class:`~convnets.deploy.optimize.OptimizedModel`).
        batch_sizes: batch sizes to measure, in order.
        device: where the inputs are created.
        warmup: untimed calls per batch size (at least 1).
        iterations: timed calls per batch size (at least 1).
        image_size: input height and width.
        memory_format: layout of the input batch.
        autocast_dtype: run the calls under ``torch.autocast`` with this dtype (eager AMP).

    Returns:
        One :class:`BatchResult` per batch size.
    """
    if warmup < 1 or iterations < 1:
        raise InvalidArgumentError(f"warmup and iterations must be at least 1, got {warmup} and {iterations}")
    device = torch.device(device)
    results = []
    for batch_size in batch_sizes:
        x = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(memory_format=memory_format)
        times = []
        with torch.inference_mode(), (torch.autocast(device.type, dtype=autocast_dtype)
                                      if autocast_dtype is not None else contextlib.nullcontext()):
            for i in range(warmup + iterations):
                start = time.perf_counter()
                model(x)
                _synchronize(device)
                times.append(time.perf_counter() - start)
        results.append(summarize(batch_size, [1000.0 * t for t in times[warmup:]], first_call_s=times[0]))
    return results


def summarize(batch_size: int, times_ms: Sequence[float], first_call_s: float | None = None) -> BatchResult:
    """Throughput and latency percentiles of timed calls (each processing ``batch_size`` images)."""
    timed = np.asarray(times_ms, dtype=np.float64)
    latency = {f"p{q}": float(np.percentile(timed, q)) for q in (50, 90, 95, 99)}
    latency["mean"] = float(timed.mean())
    return BatchResult(batch_size, len(timed), batch_size * len(timed) / (timed.sum() / 1000.0), latency,
                       first_call_s)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | str) -> dict[str, Any]:
    """What the numbers depend on: versions, device name, CPU and thread counts."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": _cpu_model(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "mkldnn_bf16": bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def format_table(results: Sequence[BatchResult], title: str = "") -> str:
    """A Markdown table: batch size, throughput (img/s), latency p50 / p90 / p99 (ms)."""
    lines = [f"**{title}**", ""] if title else []
    lines += ["| Batch size | Throughput (img/s) | Latency p50 (ms) | Latency p90 (ms) | Latency p99 (ms) |",
              "|---:|---:|---:|---:|---:|"]
    for r in results:
        lat = r.latency_ms
        lines.append(f"| {r.batch_size} | {r.throughput:.1f} | {lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} |")
    return "\n".join(lines)


def format_engine_table(results: Sequence[tuple[str, BatchResult]], title: str = "", picked: str | None = None) -> str:
    """A Markdown table of engines side by side: engine, batch size, img/s, latency p50 / p90 / p99, first call.

    Args:
        results: ``(engine name, result)`` rows, in the order to print.
        title: a bold line above the table.
        picked: the engine that ``engine="auto"`` picks, marked ``(auto)`` in its rows.
    """
    lines = [f"**{title}**", ""] if title else []
    lines += ["| Engine | Batch size | Throughput (img/s) | Latency p50 (ms) | Latency p90 (ms) | Latency p99 (ms) "
              "| First call (s) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for engine, r in results:
        lat = r.latency_ms
        label = f"{engine} (auto)" if engine == picked else engine
        first = f"{r.first_call_s:.2f}" if r.first_call_s is not None else "-"
        lines.append(f"| {label} | {r.batch_size} | {r.throughput:.1f} | {lat['p50']:.2f} | {lat['p90']:.2f} "
                     f"| {lat['p99']:.2f} | {first} |")
    return "\n".join(lines)
