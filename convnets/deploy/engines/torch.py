"""The ``torch`` engine: PyTorch itself, on every device, and its code (:func:`optimize_with_torch`).

It turns a trained model into a module that takes the usual ``[N, 3, H, W]`` float batch and returns
float32 logits, faster (:class:`~convnets.deploy.engines.runner.OptimizedModel`):

* BatchNorm is folded into the preceding convolution (exact: computed in float64, see
  :func:`~convnets.deploy.folding.fold_batchnorm`), which removes a third of the layers;
* activations are kept in ``channels_last`` (NHWC), the layout oneDNN and cuDNN convolutions prefer;
* ``bf16`` / ``fp16`` run the whole network in that dtype (weights converted once, not per call);
* ``torch.compile`` (inductor) with ``freezing``: weights become constants, so inductor prepacks
  them for oneDNN and fuses ReLUs and residual adds into the convolutions. If compilation is
  unavailable or fails, the module falls back to eager with a logged warning.

See https://pytorch.org/tutorials/intermediate/torch_compile_tutorial.html and
https://pytorch.org/docs/stable/torch.compiler_faq.html for ``torch.compile`` itself.

Like every engine module, this one imports nothing heavy at import (PyTorch inside the functions):
the command line lists the engines from their class attributes without importing PyTorch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings
from convnets.runtime import (PRECISIONS, PrecisionName, check_precision, check_precision_name, precision_dtype,
                              warn_if_bf16_is_slower)

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from convnets.deploy.engines.runner import OptimizedModel

__all__ = ["ENGINE", "TorchEngine", "compile_unavailable_reason", "optimize_with_torch"]

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
        if precision == "bf16" and device.type == "cpu":
            warn_if_bf16_is_slower()

        return optimize_with_torch(model, check_precision_name(precision), device, compile=compile,
                                   settings=settings)


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` (inductor) cannot work here, or ``None`` when it should.

    A cheap check before the first call; compilation can still fail later, which
    :class:`~convnets.deploy.engines.runner.OptimizedModel` also handles.
    """
    from convnets.deploy.folding import error_summary

    try:
        import torch._dynamo as dynamo
        if not dynamo.is_dynamo_supported():
            return "torch.compile does not support this Python/platform"
        if device.type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler
            get_cpp_compiler()
        elif device.type == "cuda":
            from torch.utils._triton import has_triton
            if not has_triton():
                return "the triton package is missing (inductor needs it for CUDA)"
    except Exception as e:  # noqa: BLE001 - private APIs: any failure means "cannot compile"
        return error_summary(e)
    return None


def _compiled(module: nn.Module, device: torch.device) -> Callable[[Tensor], Tensor] | None:
    """``torch.compile(module)`` with inference settings, or None (warning logged) if unavailable."""
    import torch

    from convnets.deploy.folding import error_summary

    reason = compile_unavailable_reason(device)
    if reason is None:
        try:
            # max_autotune stays off: minutes of compile time for little gain on these
            # convolution-bound networks. dynamic=False: one static graph per batch size, which
            # inductor specialises best.
            compiled = torch.compile(module, dynamic=False)
        except Exception as e:  # noqa: BLE001 - any failure to set up compilation: stay eager
            reason = error_summary(e)
        else:
            return functools.partial(_run_frozen, compiled)
    log.warning("torch.compile is unavailable (%s); running the optimized model eagerly", reason)
    return None


def _run_frozen(compiled: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    # Freezing makes the weights graph constants, so inductor folds them and, on CPU, prepacks
    # them for oneDNN and fuses ReLU / residual add into the convolutions (about 1.4x for bf16
    # here). Inductor reads the flag when it compiles, i.e. inside the first call at each shape;
    # torch.compile(options={"freezing": True}) does not reach that code in torch 2.14, and
    # setting the global flag would change the caller's other compiled models. (Imported here:
    # importing inductor pulls in dynamo, a second of `import convnets` for everyone.)
    import torch._inductor.config as inductor_config

    with inductor_config.patch(freezing=True):
        return compiled(x)


def optimize_with_torch(model: nn.Module, precision: PrecisionName, device: torch.device, *,
                        compile: bool = True, settings: EngineSettings = DEFAULT_SETTINGS) -> OptimizedModel:
    """The ``torch`` engine: a folded copy of ``model`` in the compute dtype, channels_last, compiled.

    Args:
        model: a classifier in eval mode (not modified).
        precision: checked for ``device`` here.
        device: where to run.
        compile: use ``torch.compile`` (falls back to eager, with a warning, when unavailable).
        settings: how it runs: ``threads``, ``torch.set_num_threads`` during each call (:class:`~convnets.deploy.engines.runner.OptimizedModel`;
            ``None``: the process's count).
    """
    import copy

    import torch

    from convnets.deploy.engines.runner import OptimizedModel
    from convnets.deploy.folding import fold_batchnorm

    check_precision(precision, device)
    module = copy.deepcopy(model)
    fold_batchnorm(module)
    module.requires_grad_(False)
    # The whole network in the target dtype: weights are converted once here instead of by
    # autocast on every call (which also leaves nothing for autocast to decide per op).
    module.to(device=device, dtype=precision_dtype(precision)).to(memory_format=torch.channels_last)
    optimized = OptimizedModel(module, precision=precision, device=device,
                               graph=_compiled(module, device) if compile else None,
                               threads=settings.threads)
    for attr in ("num_classes", "class_names", "spec", "input_size"):
        if hasattr(model, attr):
            setattr(optimized, attr, getattr(model, attr))
    return optimized


ENGINE = TorchEngine()
