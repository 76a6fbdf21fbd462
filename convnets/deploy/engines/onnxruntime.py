"""The ``onnxruntime`` engine: the ONNX export's graph (BatchNorm folded, dynamic batch axis) run by
ONNX Runtime's CPU execution provider, fp32.

The graph is written by the onnx export format (:mod:`convnets.deploy.formats.onnx`) into an entry
of the engine cache (:mod:`convnets.deploy.cache`; a temporary directory with the cache off) and
loaded by the format's own runner; the next process with the same model loads that file instead of
exporting again.
Reference: https://onnxruntime.ai/docs/api/python/api_summary.html
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings

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
              settings: EngineSettings = DEFAULT_SETTINGS,
              calibration_data: list[torch.Tensor] | None = None) -> nn.Module:
        """See :meth:`Engine.build`; ``settings.runtime_options("onnxruntime")`` are
        ``onnxruntime.SessionOptions`` attributes (``threads``: ``intra_op_num_threads``; see the
        onnx format's ``load_runner``), ONNX Runtime's own defaults for the rest."""
        import torch

        from convnets.deploy.cache import cached_runner
        from convnets.deploy.engines.runner import engine_model, lazy_folded_copy
        from convnets.deploy.formats import get_format
        from convnets.deploy.formats.onnx import OnnxFormat

        fmt = get_format("onnx")
        assert isinstance(fmt, OnnxFormat)  # its load_runner takes ONNX Runtime settings
        folded = lazy_folded_copy(model)
        name = fmt.file_names[0]
        options = settings.runtime_options(self.name)

        def make_runner(shape: tuple[int, ...]) -> Runner:
            def write(directory: Path) -> None:
                fmt.write(folded(), directory / name, torch.zeros(2, *shape), **fmt.resolve_options({}))
            # The session reads the whole graph when it is made: the file may go afterwards.
            return cached_runner(model, engine=self.name, precision=precision, shape=shape, runtimes=self.requires,
                                 files=(name,), write=write, load=lambda d: fmt.load_runner(d / name, options))
        return engine_model(make_runner, engine=self.name, precision=precision, source=model)

ENGINE = OnnxRuntimeEngine()
