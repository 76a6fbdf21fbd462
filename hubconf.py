"""torch.hub entry points with upstream's names and defaults (``pretrained=True``).

    model = torch.hub.load("<owner>/<repo>", "nvidia_se_resnext101_32x4d")
    utils = torch.hub.load("<owner>/<repo>", "nvidia_convnets_processing_utils")

Each entry point only forwards to the ``convnets`` builder of the same architecture; all logic
lives in the package. Keywords: ``pretrained_from_file``, ``num_classes``, ``progress``,
``memory_format``, ``device``, ``state_dict_key_map_fn``, ``use_ema``, architecture overrides
(``layers``, ``widths``, ``expansion``, ``cardinality``, ``se_squeeze``, ``stem_width``) and
upstream's ``last_bn_0_init``, ``conv_init``, ``trt``, ``fused_se``.
"""

dependencies = ["torch", "torchvision", "numpy", "PIL", "requests", "validators", "filelock", "tqdm"]

from typing import Any  # noqa: E402

import convnets  # noqa: E402


def nvidia_resnet50(pretrained: bool = True, **kwargs: Any) -> "convnets.ResNet":
    """ResNet-50 v1.5 (25.6M parameters) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.resnet50(pretrained=True, **kwargs)``; ``help(convnets.resnet50)`` lists
    the keywords. ``pretrained_from_file=PATH`` loads a local checkpoint of any supported layout.
    """
    return convnets.resnet50(pretrained=pretrained, **kwargs)


def nvidia_resnext101_32x4d(pretrained: bool = True, **kwargs: Any) -> "convnets.ResNet":
    """ResNeXt101-32x4d (44.2M parameters, 80.19% top-1) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.resnext101_32x4d(pretrained=True, **kwargs)``; ``help(convnets.resnext101_32x4d)``
    lists the keywords. ``pretrained_from_file=PATH`` loads a local checkpoint of any supported layout.
    """
    return convnets.resnext101_32x4d(pretrained=pretrained, **kwargs)


def nvidia_resneXt(pretrained: bool = True, **kwargs: Any) -> "convnets.ResNet":
    """Upstream's alias of ``nvidia_resnext101_32x4d``: ResNeXt101-32x4d with NGC ImageNet weights.

    Same as ``convnets.resnext101_32x4d(pretrained=True, **kwargs)``.
    """
    return convnets.resnext101_32x4d(pretrained=pretrained, **kwargs)


def nvidia_se_resnext101_32x4d(pretrained: bool = True, **kwargs: Any) -> "convnets.ResNet":
    """SE-ResNeXt101-32x4d (45.3M parameters, 80.90% top-1) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.se_resnext101_32x4d(pretrained=True, **kwargs)``;
    ``help(convnets.se_resnext101_32x4d)`` lists the keywords. ``pretrained_from_file=PATH`` loads a
    local checkpoint of any supported layout.
    """
    return convnets.se_resnext101_32x4d(pretrained=pretrained, **kwargs)
