"""The ``torch`` engine: BatchNorm folding, channels_last, the compute dtype and ``torch.compile``
(:func:`convnets.deploy.optimize.optimize_with_torch`). Every device and precision PyTorch runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.deploy.engines import Engine
from convnets.runtime import PRECISIONS

if TYPE_CHECKING:
    import torch
    from torch import nn


class TorchEngine(Engine):
    """Today's path; precision support per device is :func:`convnets.runtime.check_precision`'s."""

    name = "torch"
    description = "PyTorch: folded BatchNorm, channels_last, torch.compile (any device)"
    devices = ("cpu", "cuda", "mps", "xpu")
    precisions = PRECISIONS
    requires = ()

    def check(self, precision: str, device: torch.device, *, option: str = "precision") -> None:
        from convnets.runtime import check_precision

        check_precision(precision, device, option=option)

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool) -> nn.Module:
        from convnets.deploy.optimize import optimize_with_torch

        return optimize_with_torch(model, precision, device, compile=compile)  # type: ignore[arg-type]


ENGINE = TorchEngine()
