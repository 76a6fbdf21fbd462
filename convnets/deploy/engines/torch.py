"""The ``torch`` engine: PyTorch itself, on every device (see :mod:`convnets.deploy.torch_path`).

Like every engine module, this one imports nothing heavy: the command line lists the engines
from their class attributes without importing PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings
from convnets.runtime import PRECISIONS, check_precision, check_precision_name

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ENGINE", "TorchEngine"]


class TorchEngine(Engine):
    """Today's path, on every device; precision support per device is :func:`convnets.runtime.check_precision`'s."""

    name = "torch"
    description = "PyTorch, BatchNorm folded, channels_last, optionally torch.compile"
    devices = ("cpu", "cuda", "mps", "xpu")
    precisions = PRECISIONS
    requires = ()

    def check(self, precision: str, device: torch.device, *, option: str = "precision") -> None:
        check_precision(precision, device, option=option)

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool,
              settings: EngineSettings = DEFAULT_SETTINGS,
              calibration_data: list[torch.Tensor] | None = None) -> nn.Module:
        # calibration_data: int8 only, which this engine does not run (check refuses it).
        from convnets.deploy.torch_path import optimize_with_torch

        return optimize_with_torch(model, check_precision_name(precision), device, compile=compile,
                                   settings=settings)


ENGINE = TorchEngine()
