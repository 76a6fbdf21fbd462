"""The builders: one explicit, typed function per registered model, as in timm and torchvision.

``convnets.resnet50``, ``convnets.get_model("resnet50")`` and the torch.hub entry points all end in
the function here (the hub entry points and the package's names are taken from this module; nothing
else lists the models). Adding a model is its :func:`~convnets.models.specs.register_model` call
(the architecture, torch.hub names) and its function here, named after it and in ``__all__``.
"""

from __future__ import annotations

from typing import Any

from convnets.models.features import ResNetFeatures
from convnets.models.resnet import ResNet
from convnets.registry import _build, builder

__all__ = ["resnet50", "resnext101_32x4d", "se_resnext101_32x4d"]


@builder
def resnet50(pretrained: bool = False, **kwargs: Any) -> ResNet | ResNetFeatures:
    """ResNet-50 v1.5 (25,557,032 parameters), NVIDIA's training recipe.

    Paper: https://arxiv.org/abs/1512.03385 ; v1.5 moves the stride to the 3x3 convolution.
    """
    return _build("resnet50", pretrained, **kwargs)


@builder
def resnext101_32x4d(pretrained: bool = False, **kwargs: Any) -> ResNet | ResNetFeatures:
    """ResNeXt101-32x4d (44,177,704 parameters): ResNet-101 with 32-group 3x3 convolutions.

    Paper: https://arxiv.org/abs/1611.05431 . NGC weights: 80.19% ImageNet top-1 (AMP, 250 epochs).
    """
    return _build("resnext101_32x4d", pretrained, **kwargs)


@builder
def se_resnext101_32x4d(pretrained: bool = False, **kwargs: Any) -> ResNet | ResNetFeatures:
    """SE-ResNeXt101-32x4d (45,251,128 parameters): ResNeXt101-32x4d with NVIDIA's SE blocks.

    Papers: https://arxiv.org/abs/1611.05431 , https://arxiv.org/abs/1709.01507 . The SE squeeze is
    a fixed 16 channels (not C/16 as in timm). NGC weights: 80.90% ImageNet top-1 (AMP, 250 epochs).
    """
    return _build("se_resnext101_32x4d", pretrained, **kwargs)
