"""A fast inference path: BatchNorm folding, channels_last, reduced precision and ``torch.compile``.

:func:`optimize_for_inference` turns a trained model into a module that takes the usual
``[N, 3, H, W]`` float batch and returns float32 logits, faster:

* BatchNorm is folded into the preceding convolution (exact: computed in float64, see
  :func:`fold_batchnorm`), which removes a third of the layers;
* activations are kept in ``channels_last`` (NHWC), the layout oneDNN and cuDNN convolutions prefer;
* ``bf16`` / ``fp16`` run the whole network in that dtype (weights converted once, not per call);
* ``torch.compile`` (inductor) with ``freezing``: weights become constants, so inductor prepacks
  them for oneDNN and fuses ReLUs and residual adds into the convolutions. If compilation is
  unavailable or fails, the module falls back to eager with a logged warning.

See https://pytorch.org/tutorials/intermediate/torch_compile_tutorial.html and
https://pytorch.org/docs/stable/torch.compiler_faq.html for ``torch.compile`` itself.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from convnets.errors import InvalidArgumentError
from convnets.models.resnet import Bottleneck, ResNet
from convnets.runtime import PrecisionName, check_precision, check_precision_name, precision_dtype

__all__ = ["OptimizedModel", "compile_unavailable_reason", "error_summary", "fold_batchnorm",
           "optimize_for_inference", "optimize_with_torch"]

log = logging.getLogger(__name__)

# (convolution, BatchNorm) attribute pairs where the forward pass applies the BatchNorm directly to
# the convolution's output; only then is folding exact. nn.Sequential is handled by position.
_CONV_BN_PAIRS: dict[type, tuple[tuple[str, str], ...]] = {
    ResNet: (("conv1", "bn1"),),
    Bottleneck: (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")),
}


def error_summary(error: BaseException) -> str:
    """``"Type: first line of the message"``, for one-line reports of long library errors."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _folded_conv(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """``conv`` followed by eval-mode ``bn`` as one convolution with a bias.

    Same algebra as :func:`torch.nn.utils.fusion.fuse_conv_bn_eval`, but computed in float64 so
    that the folded weights are the correctly rounded float32 values rather than the product of
    three float32 roundings.
    """
    # On the CPU: float64 is not available on every accelerator (e.g. MPS); this runs once.
    acc = {"device": "cpu", "dtype": torch.float64}
    w = conv.weight.detach().to(**acc)
    b = conv.bias.detach().to(**acc) if conv.bias is not None else torch.zeros(w.shape[0], **acc)
    gamma = bn.weight.detach().to(**acc) if bn.weight is not None else torch.ones_like(b)
    beta = bn.bias.detach().to(**acc) if bn.bias is not None else torch.zeros_like(b)
    assert bn.running_mean is not None and bn.running_var is not None  # checked by _foldable
    scale = gamma * torch.rsqrt(bn.running_var.detach().to(**acc) + bn.eps)
    weight = w * scale.reshape(-1, 1, 1, 1)
    bias = (b - bn.running_mean.detach().to(**acc)) * scale + beta
    like = {"device": conv.weight.device, "dtype": conv.weight.dtype}
    fused = copy.deepcopy(conv)
    fused.weight = nn.Parameter(weight.to(**like), requires_grad=False)
    fused.bias = nn.Parameter(bias.to(**like), requires_grad=False)
    return fused


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    # A BatchNorm without running statistics normalises with batch statistics even in eval mode.
    return (type(conv) is nn.Conv2d and isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
            and bn.running_var is not None and bn.num_features == conv.out_channels)


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm that directly follows a convolution into that convolution, in place.

    Knows the pairs in :class:`~convnets.models.resnet.ResNet` and its blocks, and consecutive
    ``Conv2d, BatchNorm2d`` children of any ``nn.Sequential`` (e.g. the downsample branches).
    Each folded BatchNorm is replaced by ``nn.Identity``; any BatchNorm left (in modules this
    function does not know) still works in eval mode and is reported in the log.

    Args:
        model: a model in eval mode (folding uses the running statistics). Modified in place.

    Returns:
        ``model``, for chaining.
    """
    if model.training:
        raise InvalidArgumentError("fold_batchnorm needs a model in eval mode (call model.eval() first); "
                                   "folding replaces BatchNorm's batch statistics with its running statistics")
    folded = 0
    for module in list(model.modules()):
        pairs: list[tuple[str, str]] = []
        for cls, names in _CONV_BN_PAIRS.items():
            if isinstance(module, cls):
                pairs.extend(names)
        if isinstance(module, nn.Sequential):
            keys = list(module._modules)
            pairs.extend(zip(keys, keys[1:]))
        for conv_name, bn_name in pairs:
            conv, bn = getattr(module, conv_name, None), getattr(module, bn_name, None)
            if conv is not None and bn is not None and _foldable(conv, bn):
                setattr(module, conv_name, _folded_conv(conv, bn))
                setattr(module, bn_name, nn.Identity())
                folded += 1
    left = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    log.debug("folded %d BatchNorm layers into convolutions", folded)
    if left:
        log.info("%d BatchNorm layers could not be folded (unknown module structure); they run as they are", left)
    return model


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` (inductor) cannot work here, or ``None`` when it should.

    A cheap check before the first call; compilation can still fail later, which
    :class:`OptimizedModel` also handles.
    """
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


class OptimizedModel(nn.Module):
    """The module that :func:`optimize_for_inference` returns.

    ``forward`` moves the batch to the model's device, dtype and ``channels_last`` layout, runs it
    without autograd, and returns float32 logits. Attributes: ``module`` (the folded eager network
    in the compute dtype), ``precision``, ``device``, ``compiled`` (whether calls go through the
    compiled graph) and, copied from the source model, ``num_classes`` / ``class_names`` /
    ``spec`` when present; ``engine`` is ``"torch"``.

    A compiled graph is specialised to each new input shape (batch size) at its first call, which
    is therefore slow. If compilation fails, the module logs a warning and stays eager.
    """

    engine = "torch"

    def __init__(self, module: nn.Module, *, precision: PrecisionName, device: torch.device,
                 graph: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__()
        self.module = module
        self.precision: PrecisionName = precision
        self.device = device
        self.dtype = precision_dtype(precision)
        # A plain attribute, outside the module tree: a compiled wrapper holds the same parameters
        # and must not duplicate them in state_dict().
        self.__dict__["_graph"] = graph

    @property
    def compiled(self) -> bool:
        """Whether calls go through the ``torch.compile``-d graph rather than eager ``module``."""
        return self.__dict__["_graph"] is not None

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(device=self.device, dtype=self.dtype, memory_format=torch.channels_last)
        with torch.no_grad():
            graph = self.__dict__["_graph"]
            if graph is None:
                out = self.module(x)
            else:
                try:
                    out = graph(x)
                except Exception as e:  # noqa: BLE001 - decided below: compiler's fault or the input's
                    out = self._fall_back(x, e)
        return out.float()

    def _fall_back(self, x: Tensor, error: Exception) -> Tensor:
        # If the eager module fails too, the input is at fault: raise that (clearer) error and
        # keep the graph for later calls. Otherwise compilation broke: stay eager.
        out = self.module(x)
        log.warning("torch.compile failed (%s); falling back to eager execution", error_summary(error))
        self.__dict__["_graph"] = None
        return out


def _compiled(module: nn.Module, device: torch.device) -> Callable[[Tensor], Tensor] | None:
    """``torch.compile(module)`` with inference settings, or None (warning logged) if unavailable."""
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


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def optimize_with_torch(model: nn.Module, precision: PrecisionName, device: torch.device, *,
                        compile: bool = True) -> OptimizedModel:
    """The ``torch`` engine: a folded copy of ``model`` in the compute dtype, channels_last, compiled.

    Args:
        model: a classifier in eval mode (not modified).
        precision: checked for ``device`` here.
        device: where to run.
        compile: use ``torch.compile`` (falls back to eager, with a warning, when unavailable).
    """
    check_precision(precision, device)
    module = copy.deepcopy(model)
    fold_batchnorm(module)
    module.requires_grad_(False)
    # The whole network in the target dtype: weights are converted once here instead of by
    # autocast on every call (which also leaves nothing for autocast to decide per op).
    module.to(device=device, dtype=precision_dtype(precision), memory_format=torch.channels_last)
    optimized = OptimizedModel(module, precision=precision, device=device,
                               graph=_compiled(module, device) if compile else None)
    for attr in ("num_classes", "class_names", "spec", "input_size"):
        if hasattr(model, attr):
            setattr(optimized, attr, getattr(model, attr))
    return optimized


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
    from convnets.deploy.engines import AUTO, build_auto, get_engine

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
