"""Architectures: the ResNet family as data (:class:`ArchSpec`) and one network definition."""

from convnets.models.resnet import (
    ARCH_FIELDS,
    MODEL_SPECS,
    ArchSpec,
    Bottleneck,
    ResNet,
    SqueezeExcitation,
    count_parameters,
)

__all__ = ["ARCH_FIELDS", "MODEL_SPECS", "ArchSpec", "Bottleneck", "ResNet", "SqueezeExcitation",
           "count_parameters"]
