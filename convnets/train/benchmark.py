"""``convnets benchmark --mode training``: time the fine-tuning loop's optimizer step on synthetic data."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from convnets.registry import get_model
from convnets.data.folders import to_device
from convnets.runtime import resolve_precision
from convnets.train.recipe import scaled_lr
from convnets.train.step import Trainer, configure_backends

__all__ = ["benchmark_training"]


def benchmark_training(model_name: str, *, batch_size: int, device: str | torch.device = "cpu",
                       amp_dtype: str | None = None, memory_format: str = "nchw", steps: int = 10,
                       warmup: int = 3, arch_kwargs: Mapping[str, Any] | None = None, image_size: int = 224,
                       num_classes: int = 1000) -> dict[str, Any]:
    """Time the fine-tuning loop's real optimizer step (:meth:`Trainer.step`) on synthetic data.

    Forward under autocast, label-smoothed loss, backward (scaled under fp16), SGD update with the
    recipe's weight decay, lr schedule step; the batch already sits on the device, normalised.

    Args:
        model_name: a registered model, e.g. ``"resnext101_32x4d"``.
        batch_size: images per step.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        amp_dtype: ``None`` (fp32 / TF32), ``"fp16"`` or ``"bf16"``.
        memory_format: ``"nchw"`` or ``"nhwc"``.
        steps: timed steps.
        warmup: untimed steps first (allocator, cuDNN autotuning, oneDNN primitive caches).
        arch_kwargs: architecture overrides, e.g. ``{"layers": [1, 1, 1, 1]}``.
        image_size: input height and width.
        num_classes: classifier outputs.

    Returns:
        ``{"img_per_s", "step_ms" (list), "median_ms", "mean_ms", ...the arguments}``.
    """
    dev = torch.device(device)
    configure_backends(dev)
    precision = resolve_precision(dev, amp=amp_dtype is not None, amp_dtype=amp_dtype, memory_format=memory_format)
    torch.manual_seed(0)
    model = get_model(model_name, num_classes=num_classes, **dict(arch_kwargs or {}))
    model.to(dev).to(memory_format=precision.memory_format)
    trainer = Trainer(model, precision, lr=scaled_lr(batch_size), total_steps=warmup + steps,
                      max_nonfinite_steps=warmup + steps + 1)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    batch = [(to_device(images, dev, precision.memory_format),
              torch.randint(0, num_classes, (batch_size,), generator=g).to(dev))]
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        trainer.step(batch)  # returns a Python float: the step has finished on the device
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"model": model_name, "device": str(dev), "amp_dtype": amp_dtype, "memory_format": memory_format,
            "batch_size": batch_size, "image_size": image_size, "steps": steps,
            "img_per_s": batch_size * len(times) / sum(times), "step_ms": [1000 * t for t in times],
            "median_ms": 1000 * statistics.median(times), "mean_ms": 1000 * statistics.fmean(times)}
