"""What the ``torch`` engine runs: BatchNorm folding, channels_last, reduced precision and ``torch.compile``.

The engine itself (:mod:`convnets.deploy.engines.torch`) imports nothing heavy, so that ``--help``
can list it; this module holds the PyTorch code it calls.

:func:`optimize_with_torch` (``optimize_for_inference(engine="torch")``) turns a trained model into a module that takes the usual
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

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from convnets.deploy.engines.base import DEFAULT_SETTINGS, EngineSettings
from convnets.deploy.folding import error_summary, fold_batchnorm
from convnets.runtime import PrecisionName, check_precision, precision_dtype

__all__ = ["OptimizedModel", "compile_unavailable_reason", "num_threads", "optimize_with_torch"]

log = logging.getLogger(__name__)


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
    compiled graph), ``threads`` (``torch.set_num_threads`` for the length of each call, the
    process's own count put back after it; ``None``: the process's) and, copied from the source
    model, ``num_classes`` / ``class_names`` / ``spec`` when present; ``engine`` is ``"torch"``.

    A compiled graph is specialised to each new input shape (batch size) at its first call, which
    is therefore slow. If compilation fails, the module logs a warning and stays eager.
    """

    engine = "torch"

    def __init__(self, module: nn.Module, *, precision: PrecisionName, device: torch.device,
                 graph: Callable[[Tensor], Tensor] | None, threads: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.precision: PrecisionName = precision
        self.device = device
        self.threads = threads
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
        with torch.no_grad(), num_threads(self.threads):
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


@contextlib.contextmanager
def num_threads(count: int | None) -> Iterator[None]:
    """``torch.set_num_threads(count)`` inside the block, the process's count put back after it
    (``None``: left alone). The count is process-wide: scoped to each call, a model built with
    ``threads`` changes no other code of the caller's."""
    if count is None or count == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
                        compile: bool = True, settings: EngineSettings = DEFAULT_SETTINGS) -> OptimizedModel:
    """The ``torch`` engine: a folded copy of ``model`` in the compute dtype, channels_last, compiled.

    Args:
        model: a classifier in eval mode (not modified).
        precision: checked for ``device`` here.
        device: where to run.
        compile: use ``torch.compile`` (falls back to eager, with a warning, when unavailable).
        settings: how it runs: ``threads``, ``torch.set_num_threads`` during each call (:class:`OptimizedModel`;
            ``None``: the process's count).
    """
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
