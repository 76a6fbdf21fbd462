"""``optimize_for_inference``: a trained model as a fast inference callable, run by the engine asked for.

The engines live in :mod:`convnets.deploy.engines`, one module each (their names and what each runs:
:func:`convnets.deploy.engines.engines`, or ``convnets predict --help``), with ``auto``'s rule; the
torch engine's PyTorch code is :mod:`convnets.deploy.engines.torch`. This module is the one entry
point, and keeps the names that callers import from it (:class:`OptimizedModel`,
:func:`fold_batchnorm`, ...).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from convnets.deploy.cache import use_cache
from convnets.deploy.calibrate import CalibrationData, calibration_batches, split_calibration
from convnets.deploy.engines import AUTO, build_auto, check_int8, engine_names, get_engine
from convnets.deploy.engines.base import DEFAULT_SETTINGS, EngineSettings
from convnets.deploy.engines.runner import OptimizedModel
from convnets.deploy.engines.torch import compile_unavailable_reason, optimize_with_torch
from convnets.deploy.folding import error_summary, fold_batchnorm
from convnets.errors import InvalidArgumentError, UnsupportedPrecisionError
from convnets.runtime import PrecisionName, check_precision, check_precision_name

__all__ = ["INT8", "OptimizedModel", "compile_unavailable_reason", "error_summary", "fold_batchnorm",
           "optimize_for_inference", "optimize_with_torch"]

log = logging.getLogger(__name__)

#: The quantized precision (not one of :data:`convnets.runtime.PRECISIONS`: it needs calibration
#: data and runs on the engines that list it, OpenVINO through NNCF).
INT8 = "int8"


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def optimize_for_inference(
    model: nn.Module,
    precision: PrecisionName | str = "fp32",
    device: torch.device | str | None = None,
    engine: str = "torch",
    calibration_data: CalibrationData | None = None,
    compile: bool = True,
    cache: bool = True,
    settings: EngineSettings = DEFAULT_SETTINGS,
) -> nn.Module:
    """A faster copy of ``model`` for inference; ``model`` itself is not modified.

    Args:
        model: a classifier in eval mode (e.g. from :func:`convnets.get_model` with weights, or
            :func:`convnets.load_model`).
        precision: ``"fp32"`` (within 1e-4 relative of the original), ``"bf16"`` (CPUs with
            AVX512-BF16 / AMX, and GPUs; where it is measured slower than fp32 on a CPU, the torch
            engine warns once: :func:`convnets.machine.cpu_bf16_speedup`), ``"fp16"`` (CUDA only) or ``"int8"`` (CPU, ``engine=
            "openvino"`` or ``"auto"``, needs ``calibration_data``; NNCF post-training
            quantization). The logits are float32 in all cases.
        device: where to run; default: where ``model``'s parameters are.
        engine: what runs it (the command line's ``--engine`` defaults to ``"auto"``; here the
            default is ``"torch"``): a registered engine (:func:`convnets.deploy.engines.engine_names`;
            each one's devices, precisions and extra: its ``help_line()``), ``"torch"`` by default
            (folded BatchNorm, channels_last, ``torch.compile``; every device), or ``"auto"``: the
            fastest installed engine for the device and precision by
            the measured rule :data:`~convnets.deploy.engines.AUTO_ORDER`, checked against
            ``model`` on a small batch and skipped if it disagrees; ``torch`` when none qualifies
            (int8: checked on calibration images held out of the calibration, top-1 agreement
            >= 99%, and an error when it fails, since no other engine runs int8).
        calibration_data: int8 only (required there): preprocessed images like those the model
            will see, a ``[N, 3, H, W]`` tensor or an iterable of such batches (or of
            ``(images, targets)`` pairs), at least 2; a few hundred are best. A seeded random
            half of them (at most 300) is held out; the rest (at most 300) calibrate the
            quantizer. The int8 model runs images of their height and width only. The result's
            ``calibration_check`` is the :class:`~convnets.deploy.export.Verification` of the int8
            model against ``model`` on the held-out images, which the quantizer never saw; a
            warning is logged when its top-1 agreement is below 99%.
        compile: use ``torch.compile`` (torch engine; falls back to eager, with a warning, when
            unavailable). The other engines always compile their own graph.
        cache: keep what engines other than ``torch`` convert (and ``auto``'s check of it) in the
            engine cache, and load it from there next time: same weights, engine, precision, image
            size and versions (:mod:`convnets.deploy.cache`; ``$CONVNETS_CACHE_DIR``, default under
            ``$TORCH_HOME``). ``False``: convert in a temporary directory, as if for the first time.
        settings: how the engine runs (:class:`~convnets.deploy.engines.base.EngineSettings`), e.g.
            ``EngineSettings(threads=4)``: each engine's runtime computes a batch on 4 threads (the
            torch engine sets ``torch.set_num_threads`` during each call only). What the engine
            cache keeps does not depend on them. Default: every runtime's own.

    Returns:
        A module: call it on a ``[N, 3, H, W]`` float batch (any device; it is moved) to get
        ``[N, num_classes]`` float32 logits. Its ``engine`` attribute names the engine that runs
        it; the torch engine returns an :class:`OptimizedModel`, the others a
        :class:`~convnets.deploy.engines.runner.RunnerModel` (CPU).

    Raises:
        UnsupportedPrecisionError: fp16 on a CPU, bf16 where the device cannot run it, or a
            precision / device the chosen engine does not run.
        MissingDependencyError: the engine's optional packages are missing (names the pip extra).
        InvalidArgumentError: ``model`` is in training mode, an unknown precision or engine,
            int8 without ``calibration_data`` (or with something that is not image batches), or
            ``calibration_data`` for another precision (a ``ValueError``).
    """
    if model.training:
        raise InvalidArgumentError("optimize_for_inference needs a model in eval mode: call model.eval() first "
                                   "(BatchNorm folding uses the running statistics)")
    with use_cache(cache):
        return _optimize(model, precision, device, engine, calibration_data, compile, settings)


def _optimize(model: nn.Module, precision: str, device: torch.device | str | None, engine: str,
              calibration_data: CalibrationData | None, compile: bool, settings: EngineSettings) -> nn.Module:
    if not isinstance(settings, EngineSettings):
        raise InvalidArgumentError(f"settings must be an EngineSettings, got {settings!r}", keyword="settings")
    target = torch.device(device) if device is not None else _model_device(model)
    if precision == INT8:
        return _optimize_int8(model, target, engine, calibration_data, compile=compile, settings=settings)
    if calibration_data is not None:
        raise InvalidArgumentError(f"calibration_data is for precision='int8' only, not precision={precision!r}; "
                                   "leave it out", keyword="calibration_data")
    if engine == AUTO:
        check_precision(precision, target)
        return build_auto(model, precision, target, compile=compile, settings=settings)
    chosen = get_engine(engine)
    check_precision_name(precision)
    chosen.check(precision, target)  # first: its message names the engine and what it runs
    check_precision(precision, target)
    return chosen.build(model, precision, target, compile=compile, settings=settings)


def _optimize_int8(model: nn.Module, target: torch.device, engine: str, calibration_data: CalibrationData | None,
                   *, compile: bool, settings: EngineSettings) -> nn.Module:
    """``precision="int8"``: calibration checked, the engine built, its agreement with ``model`` measured."""
    runs_int8 = [name for name in engine_names() if INT8 in get_engine(name).precisions]
    if engine == AUTO:
        calibrate, held_out = split_calibration(calibration_batches(calibration_data))
        return build_auto(model, INT8, target, compile=compile, settings=settings, calibration_data=calibrate,
                          held_out=held_out)
    chosen = get_engine(engine)
    if INT8 not in chosen.precisions:
        raise UnsupportedPrecisionError(
            f"the {engine} engine runs no precision='int8'; int8 runs on engine="
            f"{' or '.join(repr(n) for n in (*runs_int8, AUTO))} (CPU)")
    chosen.check(INT8, target)
    calibrate, held_out = split_calibration(calibration_batches(calibration_data))
    built = chosen.build(model, INT8, target, compile=compile, settings=settings, calibration_data=calibrate)
    check = check_int8(built, model, held_out)
    setattr(built, "calibration_check", check)  # a plain attribute (Module's typed setattr: tensors)
    log.log(logging.INFO if check.passed else logging.WARNING,
            "int8 (%s): top-1 agreement with the float model %.1f%% on %s (required %s), min cosine %.4f%s",
            engine, 100 * check.top1_agreement, check.inputs, check.tolerance, check.min_cosine,
            "" if check.passed else "; this int8 model changes the model's answers: use precision='bf16'")
    return built
