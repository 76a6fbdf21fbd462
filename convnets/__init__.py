"""convnets: NVIDIA's ResNet-family image classifiers with verified, offline-capable NGC weights.

Quick start::

    import convnets
    model = convnets.se_resnext101_32x4d(pretrained=True)   # or get_model("resnext101_32x4d", ...)
    model = convnets.load_model("checkpoint.pth.tar")        # any supported checkpoint, self-describing

Upstream's torch.hub calls work unchanged against this repository (see ``hubconf.py``).
"""

from convnets.errors import (
    CheckpointError,
    ConvnetsError,
    ManifestError,
    UnknownModelError,
    WeightsUnavailableError,
)
from convnets.deploy.optimize import optimize_for_inference
from convnets.models.resnet import ArchSpec, ResNet
from convnets.registry import (
    get_model,
    list_models,
    load_model,
    resnet50,
    resnext101_32x4d,
    se_resnext101_32x4d,
)

__version__ = "0.1.0"

__all__ = [
    "ArchSpec",
    "CheckpointError",
    "ConvnetsError",
    "ManifestError",
    "ResNet",
    "UnknownModelError",
    "WeightsUnavailableError",
    "get_model",
    "list_models",
    "load_model",
    "optimize_for_inference",
    "resnet50",
    "resnext101_32x4d",
    "se_resnext101_32x4d",
]
