"""The ``openvino`` engine: the OpenVINO conversion of the folded model (as the openvino export
format makes it, :mod:`convnets.deploy.formats.openvino`), compiled in memory for the CPU plugin.

OpenVINO's CPU plugin computes in bf16 by default on CPUs that have it, so the precision is
always stated: ``INFERENCE_PRECISION_HINT`` ``f32`` for fp32 (within 1e-4 of the model) or
``bf16``. ``PERFORMANCE_HINT`` is left at OpenVINO's default (LATENCY: one stream using every core).
Reference: https://docs.openvino.ai/2025/openvino-workflow/running-inference/optimize-inference/precision-control.html
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.deploy.engines.base import Engine

if TYPE_CHECKING:
    import torch
    from torch import nn

    from convnets.deploy.formats import Runner

#: OpenVINO's name of each precision this engine runs.
PRECISION_HINTS: dict[str, str] = {"fp32": "f32", "bf16": "bf16"}


class OpenVinoEngine(Engine):
    """OpenVINO Runtime on the CPU, fp32 or bf16."""

    name = "openvino"
    description = "OpenVINO Runtime (CPU, fp32 or bf16), converted in memory"
    devices = ("cpu",)
    precisions = tuple(PRECISION_HINTS)
    requires = ("openvino",)
    extra = "openvino"

    def config(self, precision: str) -> dict[str, str]:
        """The CPU plugin's properties for ``precision``."""
        return {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision]}

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool) -> nn.Module:
        import torch

        from convnets.deploy.engines.runner import engine_model, folded_copy
        from convnets.deploy.formats import get_format

        fmt = get_format("openvino")
        module = folded_copy(model)
        config = self.config(precision)

        def make_runner(shape: tuple[int, ...]) -> Runner:
            return fmt.compile(fmt.convert(module, torch.zeros(2, *shape)), config)  # type: ignore[attr-defined]
        return engine_model(make_runner, engine=self.name, precision=precision, source=model)


ENGINE = OpenVinoEngine()
