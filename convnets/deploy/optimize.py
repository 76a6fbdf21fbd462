"""``optimize_for_inference``: a trained model as a fast inference callable, run by the engine asked for.

The engines live in :mod:`convnets.deploy.engines` (``torch``: :mod:`convnets.deploy.engines.torch`,
BatchNorm folding, channels_last, the compute dtype, ``torch.compile``; ``onnxruntime``;
``openvino``; and ``auto``'s rule). This module is the one entry point, and keeps the names that
callers import from it (:class:`OptimizedModel`, :func:`fold_batchnorm`, ...).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from convnets.deploy.engines import AUTO, build_auto, get_engine
from convnets.deploy.engines.torch import OptimizedModel, compile_unavailable_reason, optimize_with_torch
from convnets.deploy.folding import error_summary, fold_batchnorm
from convnets.errors import InvalidArgumentError
from convnets.runtime import PrecisionName, check_precision, check_precision_name

__all__ = ["OptimizedModel", "compile_unavailable_reason", "error_summary", "fold_batchnorm",
           "optimize_for_inference", "optimize_with_torch"]


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def optimize_for_inference(
    model: nn.Module,
    precision: PrecisionName = "fp32",
    device: torch.device | str | None = None,
    engine: str = "torch",
    calibration_data: Tensor | None = None,
    compile: bool = True,
) -> nn.Module:
    """A faster copy of ``model`` for inference; ``model`` itself is not modified.

    Args:
        model: a classifier in eval mode (e.g. from :func:`convnets.get_model` with weights, or
            :func:`convnets.load_model`).
        precision: ``"fp32"`` (within 1e-4 relative of the original), ``"bf16"`` (CPUs with
            AVX512-BF16 / AMX, and GPUs) or ``"fp16"`` (CUDA only). The logits are float32 in all
            cases.
        device: where to run; default: where ``model``'s parameters are.
        engine: what runs it (:mod:`convnets.deploy.engines`): ``"torch"`` (default: folded
            BatchNorm, channels_last, ``torch.compile``; every device), ``"onnxruntime"`` (CPU,
            fp32; the ``export`` extra), ``"openvino"`` (CPU, fp32 or bf16; the ``openvino``
            extra), or ``"auto"``: the fastest installed engine for the device and precision by
            the measured rule :data:`~convnets.deploy.engines.AUTO_ORDER`, checked against
            ``model`` on a small batch and skipped if it disagrees; ``torch`` when none qualifies.
        calibration_data: reserved for int8 quantization, which is not offered: measured here it
            was neither faithful nor faster than bf16 for SE-ResNeXt101 (see the README's
            inference section). Must be ``None``.
        compile: use ``torch.compile`` (torch engine; falls back to eager, with a warning, when
            unavailable). The other engines always compile their own graph.

    Returns:
        A module: call it on a ``[N, 3, H, W]`` float batch (any device; it is moved) to get
        ``[N, num_classes]`` float32 logits. Its ``engine`` attribute names the engine that runs
        it; the torch engine returns an :class:`OptimizedModel`, the others a
        :class:`~convnets.deploy.engines.runner.RunnerModel` (CPU).

    Raises:
        UnsupportedPrecisionError: fp16 on a CPU, bf16 where the device cannot run it, or a
            precision / device the chosen engine does not run.
        MissingDependencyError: the engine's optional packages are missing (names the pip extra).
        InvalidArgumentError: ``model`` is in training mode, an unknown precision or engine, or
            ``calibration_data`` (a ``ValueError``).
    """
    if calibration_data is not None:
        raise InvalidArgumentError("calibration_data is for int8 quantization, which optimize_for_inference does "
                                   "not offer (it was not both faithful and faster than bf16; see the README); "
                                   "use 'bf16'")
    if model.training:
        raise InvalidArgumentError("optimize_for_inference needs a model in eval mode: call model.eval() first "
                                   "(BatchNorm folding uses the running statistics)")
    target = torch.device(device) if device is not None else _model_device(model)
    if engine == AUTO:
        check_precision(precision, target)
        return build_auto(model, precision, target, compile=compile)
    chosen = get_engine(engine)
    check_precision_name(precision)
    chosen.check(precision, target)  # first: its message names the engine and what it runs
    check_precision(precision, target)
    return chosen.build(model, precision, target, compile=compile)
