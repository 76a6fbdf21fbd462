"""Lazy names of a package (PEP 562): the submodule that defines a name is imported on its first use.

``convnets.train``, ``convnets.inference`` and ``convnets.evaluation`` export names whose modules
import PyTorch; importing the package itself (e.g. to read ``TrainConfig``'s defaults while the
command line is parsed) must stay cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``modules`` maps each lazy name to its submodule.

    Args:
        package: the package's ``__name__``.
        modules: name -> the submodule of ``package`` that defines it, e.g. ``{"fit": "loop"}``.

    Returns:
        The function to assign to the package's ``__getattr__``.
    """
    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)
    return __getattr__
