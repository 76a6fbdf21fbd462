"""Architectures: the ResNet family as data (:mod:`~convnets.models.specs`, no torch needed) and
one network definition (:mod:`~convnets.models.resnet`, imported on first use)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from convnets.models.specs import (
    ARCH_FIELDS,
    MODEL_SPECS,
    MODELS,
    ArchSpec,
    ModelInfo,
    list_models,
    register_model,
    registered_name,
)

if TYPE_CHECKING:
    from convnets.models.resnet import Bottleneck, ResNet, SqueezeExcitation, count_parameters

__all__ = ["ARCH_FIELDS", "MODELS", "MODEL_SPECS", "ArchSpec", "Bottleneck", "ModelInfo", "ResNet",
           "SqueezeExcitation", "count_parameters", "list_models", "register_model", "registered_name"]

_LAZY = {"Bottleneck", "ResNet", "SqueezeExcitation", "count_parameters"}


def __getattr__(name: str) -> Any:
    # The network definition imports torch; the specs alone do not.
    if name in _LAZY:
        return getattr(importlib.import_module("convnets.models.resnet"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
