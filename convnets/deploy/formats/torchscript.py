"""TorchScript (``torch.jit.trace``): for Triton's ``pytorch_libtorch`` backend and C++ libtorch.

Reference: https://pytorch.org/docs/stable/jit.html
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from convnets.deploy.formats.base import ExportFormat, Runner, quiet_export_warnings

if TYPE_CHECKING:
    from torch import Tensor, nn


class TorchScriptFormat(ExportFormat):
    """A traced TorchScript module, checked after ``torch.jit.load``."""

    name = "torchscript"
    description = "Triton pytorch_libtorch, C++ libtorch"
    file_names = ("model.pt",)
    # Triton's libtorch backend maps TorchScript inputs and outputs by the ``<name>__<index>``
    # convention; the input name is the exported module's forward argument.
    input_name = "INPUT__0"
    output_name = "OUTPUT__0"
    runtime = "torch.jit.load"
    triton_platform = "pytorch_libtorch"
    # torch.jit is deprecated upstream (it warns on every trace and load); kept for Triton's
    # libtorch backend, which reads nothing else.
    deprecated = ("PyTorch is retiring torch.jit; use --format aoti for deployment without Python, "
                  "--format onnx or --format openvino for Triton")

    def write(self, module: nn.Module, path: Path, example: Tensor) -> None:
        import torch

        with quiet_export_warnings():
            # Tracing records the network as it runs; there is no data-dependent control flow in
            # these models, and check_trace reruns it to make sure. Not frozen: Triton moves the
            # parameters to its GPU with the module.
            traced = torch.jit.trace(module, example, check_trace=True)
            torch.jit.save(traced, str(path))

    def load_runner(self, path: Path) -> Runner:
        import torch

        with quiet_export_warnings():
            module = torch.jit.load(str(path), map_location="cpu")

        def run(batch: Tensor) -> Tensor:
            # TorchScript graphs carry no output names and no declared shapes: the default
            # signature() takes the output shape from this call.
            with torch.no_grad():
                return module(batch).float()
        return run


FORMAT = TorchScriptFormat()
