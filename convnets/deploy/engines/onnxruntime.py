"""The ``onnxruntime`` engine: the ONNX export's graph (BatchNorm folded, dynamic batch axis) run by
ONNX Runtime's CPU execution provider, fp32.

The graph is written by the onnx export format (:mod:`convnets.deploy.formats.onnx`) into a
temporary directory and loaded by the format's own runner; the session keeps it in memory.
Reference: https://onnxruntime.ai/docs/api/python/api_summary.html
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.deploy.engines.base import Engine

if TYPE_CHECKING:
    import torch
    from torch import nn

    from convnets.deploy.formats import Runner


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime on the CPU, fp32 (its CPU provider has no fast bf16/fp16 convolutions)."""

    name = "onnxruntime"
    description = "ONNX Runtime's CPU provider running the onnx export's graph"
    devices = ("cpu",)
    precisions = ("fp32",)
    requires = ("onnx", "onnxruntime")
    extra = "export"

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool,
              calibration_data: list[torch.Tensor] | None = None,
              settings: Mapping[str, Any] | None = None) -> nn.Module:
        """See :meth:`Engine.build`; ``settings``: ``onnxruntime.SessionOptions`` attributes (default:
        ONNX Runtime's own; see the onnx format's ``load_runner``)."""
        import torch

        from convnets.deploy.engines.runner import engine_model, folded_copy
        from convnets.deploy.formats import get_format
        from convnets.deploy.formats.onnx import OnnxFormat

        from convnets.deploy.formats.onnx import OnnxFormat

        fmt = get_format("onnx")
        assert isinstance(fmt, OnnxFormat)  # its load_runner takes ONNX Runtime settings
        module = folded_copy(model)

        def make_runner(shape: tuple[int, ...]) -> Runner:
            with tempfile.TemporaryDirectory(prefix="convnets-onnxruntime-") as tmp:
                path = Path(tmp) / fmt.file_names[0]
                fmt.write(module, path, torch.zeros(2, *shape), **fmt.resolve_options({}))
                return fmt.load_runner(path, settings)  # the session holds the graph: the file can go
        return engine_model(make_runner, engine=self.name, precision=precision, source=model)


ENGINE = OnnxRuntimeEngine()
