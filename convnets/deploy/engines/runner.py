"""What the engines' ``build`` returns: an ``nn.Module`` that takes a float batch and returns float32 logits.

:class:`OptimizedModel` is the torch engine's (its folded network, compiled or eager), :class:`RunnerModel`
every other engine's (a runner per input shape). Both import PyTorch, so engine modules import this one
when they build, never at their own import.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from convnets.deploy.folding import error_summary
from convnets.runtime import PrecisionName, precision_dtype

__all__ = ["OptimizedModel", "RunnerModel", "engine_model", "folded_copy", "lazy_folded_copy", "num_threads"]

log = logging.getLogger(__name__)

Runner = Callable[[Tensor], Tensor]


class OptimizedModel(nn.Module):
    """The module that the torch engine builds (:func:`~convnets.deploy.engines.torch.optimize_with_torch`).

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



class RunnerModel(nn.Module):
    """An engine's compiled graph(s) as a module: NCHW float batch in (any size), float32 logits out.

    Graphs have a dynamic batch axis but a fixed image size, so one runner is built per
    ``(channels, height, width)`` at the first batch of that shape (that call includes the build,
    as a compiled torch model's first call includes compilation). Attributes: ``engine``,
    ``precision``, ``device`` (the CPU), ``compiled`` (True: the engine runs its own graph).
    """

    compiled = True

    def __init__(self, make_runner: Callable[[tuple[int, ...]], Runner], *, engine: str, precision: str) -> None:
        super().__init__()
        self.engine = engine
        self.precision = precision
        self.device = torch.device("cpu")
        # Plain attributes, outside the module tree: runners are not nn.Modules.
        self.__dict__["_make_runner"] = make_runner
        self.__dict__["_runners"] = {}

    def runner(self, shape: tuple[int, ...]) -> Runner:
        """The runner for inputs of per-image ``shape`` ``(C, H, W)``, built on first use."""
        runners: dict[tuple[int, ...], Runner] = self.__dict__["_runners"]
        if shape not in runners:
            runners[shape] = self.__dict__["_make_runner"](shape)
        return runners[shape]

    def forward(self, x: Tensor) -> Tensor:
        x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return self.runner(tuple(x.shape[1:]))(x)

    def extra_repr(self) -> str:
        return f"engine={self.engine!r}, precision={self.precision!r}"


def engine_model(make_runner: Callable[[tuple[int, ...]], Runner], *, engine: str, precision: str,
                 source: nn.Module, shape: tuple[int, ...] | None = None) -> RunnerModel:
    """A :class:`RunnerModel` carrying ``source``'s ``num_classes`` / ``class_names`` / ``spec`` / ``input_size``.

    The runner for ``shape`` (default: the model's input size, ``source.input_size`` or 224) is
    built here, so that build errors surface at once rather than at the first call.
    """
    module = RunnerModel(make_runner, engine=engine, precision=precision)
    for attr in ("num_classes", "class_names", "spec", "input_size"):
        if hasattr(source, attr):
            setattr(module, attr, getattr(source, attr))
    size = int(getattr(source, "input_size", 224))
    module.runner(shape or (3, size, size))
    return module


def folded_copy(model: nn.Module) -> nn.Module:
    """A float32 CPU copy of ``model`` with BatchNorm folded (:func:`~convnets.deploy.folding.fold_batchnorm`):
    what the ONNX Runtime and OpenVINO engines convert, as the exports do."""
    import copy

    from convnets.deploy.folding import fold_batchnorm

    return fold_batchnorm(copy.deepcopy(model).eval().cpu().float()).requires_grad_(False)


def lazy_folded_copy(model: nn.Module) -> Callable[[], nn.Module]:
    """:func:`folded_copy` of ``model``, made at the first call and kept: engines fold only when they
    convert, not when they load a cached graph (:mod:`convnets.deploy.cache`)."""
    made: list[nn.Module] = []

    def get() -> nn.Module:
        if not made:
            made.append(folded_copy(model))
        return made[0]
    return get
