"""The ``torch`` engine: PyTorch itself, on every device (see :mod:`convnets.deploy.torch_path`).

Like every engine module, this one imports nothing heavy: the command line lists the engines
from their class attributes without importing PyTorch.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings
from convnets.runtime import PRECISIONS, check_precision, check_precision_name, cpu_has_amx, cpu_has_bf16

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ENGINE", "TorchEngine"]

log = logging.getLogger(__name__)


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

        if precision == "bf16" and device.type == "cpu" and cpu_has_bf16() and not cpu_has_amx():
            _warn_slow_bf16()  # (without native bf16 at all, check_precision has warned already)

        return optimize_with_torch(model, check_precision_name(precision), device, compile=compile,
                                   settings=settings)


@functools.cache  # once per process
def _warn_slow_bf16() -> None:
    """Say that bf16 through this engine is slower than fp32 here, and what is faster."""
    # In words for both interfaces (precision='fp32' / --precision fp32): build() does not know which.
    log.warning("bf16 through the torch engine runs slower than fp32 on this CPU (AVX512-BF16 without AMX: "
                "ResNeXt101 at about 0.55-0.7x its fp32 speed, and OpenVINO's bf16 no faster); run fp32 for speed")


ENGINE = TorchEngine()
