"""Detection backbones: a registered model with a feature pyramid, shaped like torchvision's ``resnet_fpn_backbone``.

::

    from torchvision.models.detection import FasterRCNN
    backbone = convnets.fpn_backbone("resnext101_32x4d", pretrained=True, trainable_layers=3)
    detector = FasterRCNN(backbone, num_classes=91)

The module returned has ``out_channels`` and maps an image batch to an ``OrderedDict`` of pyramid
levels (``"0"`` .. ``"3"`` and ``"pool"``), which is what torchvision's ``FasterRCNN``, ``MaskRCNN``
and ``RetinaNet`` take. Its body is the ``features_only`` model of :mod:`convnets.models.features`,
so the weights, ``output_stride`` and freezing are those of ``convnets.get_model``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from convnets.errors import InvalidArgumentError, short_repr
from convnets.models.features import ResNetFeatures
from convnets.registry import get_model

__all__ = ["BackboneWithFPN", "fpn_backbone"]


class BackboneWithFPN(nn.Module):
    """A ``features_only`` backbone followed by torchvision's ``FeaturePyramidNetwork``.

    torchvision's own ``BackboneWithFPN`` wraps its backbone in an ``IntermediateLayerGetter``, a
    new container whose ``train()`` is ``nn.Module``'s: the frozen stages would leave eval mode.
    This one keeps the backbone as it is.

    Args:
        body: the backbone; its ``feature_info.channels()`` are the pyramid's inputs.
        out_channels: channels of every pyramid level.
        extra_blocks: torchvision's ``ExtraFPNBlock`` after the last level (default
            ``LastLevelMaxPool``, which adds ``"pool"``).

    Attributes:
        out_channels: what torchvision's detectors read.
    """

    def __init__(self, body: ResNetFeatures, out_channels: int = 256, extra_blocks: nn.Module | None = None) -> None:
        super().__init__()
        from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

        self.body = body
        self.fpn = FeaturePyramidNetwork(in_channels_list=list(body.feature_info.channels()),
                                         out_channels=out_channels,
                                         extra_blocks=LastLevelMaxPool() if extra_blocks is None else extra_blocks)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        """The pyramid: ``"0"`` for the first returned stage, then one key per level, then the extra ones."""
        features = OrderedDict((str(i), f) for i, f in enumerate(self.body(x)))
        return self.fpn(features)


def fpn_backbone(
    name: str,
    pretrained: bool = False,
    *,
    trainable_layers: int = 3,
    returned_layers: Sequence[int] | None = None,
    extra_blocks: nn.Module | None = None,
    norm_layer: Any = None,
    out_channels: int = 256,
    **kwargs: Any,
) -> BackboneWithFPN:
    """A registered model with an FPN on top, as torchvision's ``resnet_fpn_backbone`` builds one.

    Args:
        name: a registered model, e.g. ``"resnext101_32x4d"``.
        pretrained: NVIDIA's ImageNet weights (the head is dropped).
        trainable_layers: how many of ``layer4``, ``layer3``, ``layer2``, ``layer1`` and the stem
            train, counted from the last (0 to 5; torchvision's meaning). The others get no
            gradient and stay in eval mode: ``frozen_stages = 4 - trainable_layers``.
        returned_layers: the stages the pyramid takes, among 1 .. 4 (default all four).
        extra_blocks: torchvision's ``ExtraFPNBlock`` (default ``LastLevelMaxPool``; RetinaNet
            uses ``LastLevelP6P7``).
        norm_layer: the backbone's BatchNorm: ``torchvision.ops.FrozenBatchNorm2d`` (the default,
            as torchvision's) or ``torch.nn.BatchNorm2d``.
        out_channels: channels of every pyramid level.
        **kwargs: the builders' other keywords: ``pretrained_from_file``, ``output_stride``,
            ``norm_eval``, ``device``, architecture overrides (``layers``, ``widths``, ...).

    Returns:
        A :class:`BackboneWithFPN`, in train mode (the frozen layers in eval mode).

    Raises:
        InvalidArgumentError: ``trainable_layers`` out of 0 .. 5, ``returned_layers`` not stages,
            ``frozen_stages`` or ``features_only`` given (this function sets them).
    """
    if isinstance(trainable_layers, bool) or not isinstance(trainable_layers, int) or not 0 <= trainable_layers <= 5:
        raise InvalidArgumentError(f"trainable_layers must be an integer from 0 to 5, got "
                                   f"{short_repr(trainable_layers)}", keyword="trainable_layers")
    for taken in ("frozen_stages", "features_only", "out_indices", "num_classes"):
        if taken in kwargs:
            raise InvalidArgumentError(f"fpn_backbone sets {taken} itself; use trainable_layers and returned_layers",
                                       keyword=taken)
    layers = (1, 2, 3, 4) if returned_layers is None else returned_layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= 4 for i in layers):
        raise InvalidArgumentError(f"returned_layers must be stages among 1, 2, 3, 4, got "
                                   f"{short_repr(returned_layers)}", keyword="returned_layers")
    if norm_layer is None:
        from torchvision.ops import FrozenBatchNorm2d

        norm_layer = FrozenBatchNorm2d
    body = get_model(name, pretrained, features_only=True, out_indices=tuple(layers),
                     frozen_stages=4 - trainable_layers, norm_layer=norm_layer, **kwargs)
    return BackboneWithFPN(body.train(), out_channels=out_channels, extra_blocks=extra_blocks)
