"""convnets: NVIDIA's ResNet-family image classifiers with verified, offline-capable NGC weights.

Quick start::

    import convnets
    model = convnets.se_resnext101_32x4d(pretrained=True)   # or get_model("resnext101_32x4d", ...)
    model = convnets.load_model("checkpoint.pth.tar")        # any supported checkpoint, self-describing
    convnets.predict(model, "photos/")                       # top-5 per image; a table in Jupyter
    convnets.explain(model, "photos/")                       # Grad-CAM heat maps (the explain extra)
    backbone = convnets.resnext101_32x4d(pretrained=True, features_only=True)  # timm's spelling

Upstream's torch.hub calls work unchanged against this repository (see ``hubconf.py``).

``import convnets`` is cheap: the errors and the model names are loaded at once, everything else
(PyTorch, the builders, the inference and training stacks) on first use of the name that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from convnets.errors import (
    CheckpointError,
    ConvnetsError,
    DataError,
    ExportError,
    ImageDecodeError,
    ImageDownloadError,
    ImageLoadError,
    ImageNotFoundError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ManifestError,
    MissingDependencyError,
    ServeError,
    TrainingDivergedError,
    UnknownArgumentError,
    UnknownModelError,
    UnsupportedPrecisionError,
    WeightsUnavailableError,
)
from convnets.constants import VERSION
from convnets.models.specs import ArchSpec, list_models

if TYPE_CHECKING:
    from convnets.backbones import fpn_backbone
    from convnets.deploy.optimize import optimize_for_inference
    from convnets.inference.embed import embed
    from convnets.explanations import Explanation, Explanations, explain
    from convnets.inference.predict import Predictions, predict
    from convnets.models.features import ResNetFeatures
    from convnets.models.resnet import ResNet
    from convnets.builders import *  # noqa: F403  # every model's builder, convnets.builders.__all__
    from convnets.registry import get_model, load_model
    from convnets.evaluation.loop import evaluate_model

__version__ = VERSION

#: public name -> module that defines it, imported on first access (PEP 562). Every registered
#: model's builder (``convnets.resnet50``, ...) comes from :mod:`convnets.builders`.
_LAZY: dict[str, str] = {
    "ResNet": "convnets.models.resnet",
    "ResNetFeatures": "convnets.models.features",
    "fpn_backbone": "convnets.backbones",
    "embed": "convnets.inference.embed",
    "explain": "convnets.explanations",
    "Explanation": "convnets.explanations",
    "Explanations": "convnets.explanations",
    "predict": "convnets.inference.predict",
    "Predictions": "convnets.inference.predict",
    "get_model": "convnets.registry",
    "load_model": "convnets.registry",
    "optimize_for_inference": "convnets.deploy.optimize",
    "evaluate_model": "convnets.evaluation.loop",
    **{name: "convnets.builders" for name in list_models()},
}

__all__ = [
    "ArchSpec",
    "CheckpointError",
    "ConvnetsError",
    "DataError",
    "Explanation",
    "Explanations",
    "ExportError",
    "ImageDecodeError",
    "ImageDownloadError",
    "ImageLoadError",
    "ImageNotFoundError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "ManifestError",
    "MissingDependencyError",
    "Predictions",
    "ResNet",
    "ResNetFeatures",
    "ServeError",
    "TrainingDivergedError",
    "UnknownArgumentError",
    "UnknownModelError",
    "UnsupportedPrecisionError",
    "WeightsUnavailableError",
    "embed",
    "evaluate_model",
    "explain",
    "fpn_backbone",
    "get_model",
    "list_models",
    "load_model",
    "optimize_for_inference",
    "predict",
    *list_models(),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
