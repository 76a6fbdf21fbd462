"""The measurement loop the benchmark scripts share: warm-up, then interleaved rounds, then medians.

Every round times each runner once, starting one runner later than the round before, so load from
other processes hits the reference and the others alike; ratios are taken within a round.

``settle`` seconds of idling before each runner's timing let the previous runner's threads stop:
OpenMP (PyTorch), ONNX Runtime and OpenVINO keep their threads spinning for a while after a call,
and a rotated order always puts the same runner after the same other one, so without a pause a
runner that follows another runtime measures that runtime's spinning too (at batch 1, where a call
lasts tens of milliseconds, this moved results by up to 30% on 2 cores).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

Runner = Callable[[torch.Tensor], torch.Tensor]


def synchronize(x: torch.Tensor) -> None:
    """Wait for the GPU work queued so far (a no-op for CPU tensors): the clock must see it end."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def time_calls(run: Runner, x: torch.Tensor, calls: int) -> float:
    """Seconds per call, averaged over ``calls`` back-to-back calls (on a GPU, until the last ends)."""
    synchronize(x)
    start = time.perf_counter()
    for _ in range(calls):
        run(x)
    synchronize(x)
    return (time.perf_counter() - start) / calls


def interleaved_rows(name: str, runners: dict[str, Runner], x: torch.Tensor, *, reference: str, warmup: int,
                     rounds: int, calls: int, settle: float = 0.0) -> list[dict[str, object]]:
    """One row per runner: median img/s over ``rounds`` and the speed-up over ``runners[reference]``."""
    batch_size = len(x)
    first_call = {}
    with torch.inference_mode():
        for label, run in runners.items():  # compiles happen here (first call per batch size)
            start = time.perf_counter()
            for _ in range(warmup):
                run(x)
            synchronize(x)
            first_call[label] = time.perf_counter() - start
            logging.info("%s %s b%d: warm-up %.1f s", name, label, batch_size, first_call[label])
        times: dict[str, list[float]] = {label: [] for label in runners}
        labels = list(runners)
        for r in range(rounds):
            shift = r % len(labels)
            for label in labels[shift:] + labels[:shift]:
                if settle:
                    time.sleep(settle)
                times[label].append(time_calls(runners[label], x, calls))
            logging.info("round %d/%d: %s", r + 1, rounds,
                         ", ".join(f"{k} {batch_size / v[-1]:.2f}" for k, v in times.items()))
    rows = []
    for label, ts in times.items():
        ratios = [ref / t for ref, t in zip(times[reference], ts)]
        rows.append({"model": name, "batch_size": batch_size, "variant": label,
                     "img_per_s": batch_size / statistics.median(ts),
                     "img_per_s_all_rounds": [batch_size / t for t in ts],
                     "speedup_vs_timm": statistics.median(ratios),
                     "speedup_min_max": [min(ratios), max(ratios)],
                     "warmup_s": first_call[label],
                     "compiled": bool(getattr(runners[label], "compiled", False))})
    return rows
