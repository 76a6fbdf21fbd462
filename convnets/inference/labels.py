"""The names of a model's outputs, for every command that shows classes (predict, explain, serve)."""

from __future__ import annotations

from convnets.models.resnet import ResNet
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes

__all__ = ["class_labels"]


def class_labels(model: ResNet) -> list[str]:
    """Names of the model's outputs: the checkpoint's, ImageNet's for 1000 classes, else indices."""
    if model.class_names is not None:
        return list(model.class_names)
    if model.num_classes == NUM_CLASSES:
        return [str(name) for name in get_imgnet_classes()]
    return [f"class {i}" for i in range(model.num_classes)]
