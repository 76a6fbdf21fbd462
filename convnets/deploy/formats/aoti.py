"""AOTInductor: ``torch.export`` + ``torch._inductor.aoti_compile_and_package`` -> a ``.pt2`` package.

The package holds compiled C++ kernels and the weights; ``torch._inductor.aoti_load_package``
(Python) or ``torch::inductor::AOTIModelPackageLoader`` (C++) run it without the model's Python
code. It is what PyTorch offers in place of TorchScript for deployment without Python.

Reference: https://pytorch.org/docs/stable/torch.compiler_aot_inductor.html
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.deploy.formats.base import ExportFormat, Runner
from convnets.errors import MissingDependencyError

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger(__name__)

#: Inductor settings for the package. ``freezing`` turns the weights into constants of the compiled
#: graph (no parameter updates are possible in a package anyway), which lets Inductor fold and
#: pre-pack them for the CPU convolution kernels.
INDUCTOR_CONFIGS: dict[str, Any] = {"freezing": True}


def export_program(module: nn.Module, example: Tensor) -> Any:
    """``torch.export`` of ``module`` with a dynamic batch axis (the first one of its only input).

    Shared by the formats that start from an ``ExportedProgram`` (AOTInductor, OpenVINO).

    Args:
        module: the network, in eval mode; its ``forward`` takes one batch.
        example: a batch of at least 2 images (a batch of 1 would be specialized to a constant).
    """
    import inspect

    import torch

    (arg,) = inspect.signature(module.forward).parameters
    batch = torch.export.Dim("batch", min=1)
    return torch.export.export(module, (example,), dynamic_shapes={arg: {0: batch}}, strict=False)


class AotiFormat(ExportFormat):
    """An AOTInductor package with a dynamic batch axis, run with ``torch._inductor.aoti_load_package``."""

    name = "aoti"
    description = "AOTInductor .pt2 package: runs from Python or C++ without the model code"
    file_names = ("model.pt2",)
    runtime = "torch._inductor.aoti_load_package"
    # Triton has no AOTInductor backend (its libtorch backend reads TorchScript).
    triton_platform = None
    # The package is compiled for the CPU (where the module is exported); fp16 packages verify
    # here too (cosine > 0.9999 on a small network) and are half the size.

    def check_dependencies(self) -> None:
        """Also fail early when there is no C++ compiler (Inductor builds the package with one)."""
        super().check_dependencies()
        from torch._inductor import exc
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except exc.InvalidCxxCompiler as e:
            raise MissingDependencyError(
                "the aoti export compiles C++ and no C++ compiler was found ($CXX, else g++); install "
                "one (e.g. apt-get install g++) or set CXX to it, or use --format onnx") from e

    def write(self, module: nn.Module, path: Path, example: Tensor) -> None:
        import time

        import torch._inductor

        start = time.perf_counter()
        program = export_program(module, example)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=dict(INDUCTOR_CONFIGS))
        log.info("AOTInductor package compiled in %.1f s", time.perf_counter() - start)

    def load_runner(self, path: Path) -> Runner:
        import torch
        import torch._inductor

        package = torch._inductor.aoti_load_package(str(path))

        def run(batch: Tensor) -> Tensor:
            with torch.no_grad():
                return package(batch.contiguous()).float()
        return run


FORMAT = AotiFormat()
