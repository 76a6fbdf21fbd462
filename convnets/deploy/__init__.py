"""Deployment: a fast inference path, verified exports (a registry of formats) with Triton model
repositories, and throughput benchmarks.

* :func:`optimize_for_inference` (:mod:`convnets.deploy.optimize`), run by an inference engine of
  :mod:`convnets.deploy.engines` (one module each, or ``auto``; built with an :class:`EngineSettings`;
  the torch engine's code in :mod:`convnets.deploy.engines.torch`); BatchNorm folding in
  :mod:`convnets.deploy.folding`
* :func:`~convnets.deploy.export.export_model`, :mod:`convnets.deploy.formats` (one module per
  format) and :mod:`convnets.deploy.triton` (``convnets export``)
* :mod:`convnets.deploy.benchmark` (``convnets benchmark``)

Nothing is imported until used, so that the command line can list the export formats without
importing PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from convnets.deploy.engines.base import EngineSettings
    from convnets.deploy.optimize import OptimizedModel, fold_batchnorm, optimize_for_inference

__all__ = ["EngineSettings", "OptimizedModel", "fold_batchnorm", "optimize_for_inference"]

# Where each name lives (EngineSettings: without PyTorch).
_HOMES = {"EngineSettings": "convnets.deploy.engines.base"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_HOMES.get(name, "convnets.deploy.optimize")), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
