"""The module that engines other than ``torch`` return: a runner per input shape behind ``nn.Module``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["RunnerModel", "engine_model", "folded_copy", "lazy_folded_copy"]

Runner = Callable[[Tensor], Tensor]


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
