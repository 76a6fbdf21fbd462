"""The inference-engine plug-in interface (:mod:`convnets.deploy.engines`). No PyTorch is imported here.

An engine module imports nothing heavy at import time either (PyTorch, ONNX Runtime, OpenVINO
only inside :meth:`Engine.build` / :meth:`Engine.check`): ``--help`` imports every engine module to
list their names and :meth:`Engine.help_line` without loading them.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from convnets.deploy.formats.base import require
from convnets.errors import InvalidArgumentError, UnsupportedPrecisionError
from convnets.runtime import setting

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Engine"]


class Engine(abc.ABC):
    """An inference engine: turns an eval-mode classifier into a fast callable.

    Attributes:
        name: what ``engine=`` / ``--engine`` calls it.
        description: one line for help texts: what runs the model (the devices, precisions and
            extra are added from the attributes below by :meth:`help_line`).
        devices: device types it runs on.
        precisions: precisions it computes in (on those devices).
        requires: modules that must import (optional packages).
        extra: the pip extra of ``convnets-hub`` that installs :attr:`requires`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    requires: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = "export"

    @abc.abstractmethod
    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool,
              calibration_data: list[torch.Tensor] | None = None) -> nn.Module:
        """The optimized callable for ``model`` (eval mode; not modified), checks already done.

        Returns a module that takes an NCHW float batch of any size and returns float32 logits, with
        an ``engine`` attribute naming this engine.

        ``calibration_data``: passed by ``optimize_for_inference`` for ``"int8"`` only, as a list of
        batches (:func:`~convnets.deploy.calibrate.calibration_batches`); an engine that runs no int8
        never gets one. Engines may take more keywords, e.g. ``settings`` (the runtime's own
        options, for benchmarks/bench_engines.py).
        """

    def check(self, precision: str, device: torch.device, *, option: str = "precision") -> None:
        """Raise unless this engine can run ``precision`` on ``device`` here.

        Raises:
            UnsupportedPrecisionError: a device or precision it does not run (the message says what works).
            MissingDependencyError: its optional packages are missing (the message names the pip extra).
        """
        if device.type not in self.devices:
            raise UnsupportedPrecisionError(
                f"the {self.name} engine runs on {', '.join(self.devices)} only, not {device.type}; "
                f"use engine='torch' on {device.type}")
        if precision not in self.precisions:
            raise UnsupportedPrecisionError(
                f"the {self.name} engine does not run {setting(option, precision)}; it runs "
                f"{', '.join(self.precisions)} (engine='torch' or engine='auto' for {precision})")
        for module in self.requires:
            require(module, extra=self.extra, purpose=f"the {self.name} inference engine")

    def available(self, precision: str, device: torch.device) -> bool:
        """Whether :meth:`check` passes (quietly)."""
        try:
            self.check(precision, device)
        except (UnsupportedPrecisionError, InvalidArgumentError, ImportError):  # Invalid: a precision it does not know
            return False
        return True

    def help_line(self) -> str:
        """What ``--help`` says about this engine: its description, devices, precisions and the pip
        extra that installs it, e.g. ``onnxruntime (ONNX Runtime's CPU provider running the onnx
        export's graph; cpu; fp32; extra: export)``."""
        needs = f"; extra: {self.extra}" if self.requires else ""
        return f"{self.name} ({self.description}; {', '.join(self.devices)}; {', '.join(self.precisions)}{needs})"

    def __repr__(self) -> str:
        return f"<inference engine {self.name!r}>"
