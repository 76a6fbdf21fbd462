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

from typing import Any as _Any  # noqa: E402  (private: hub lists public callables)

import convnets  # noqa: E402
import processing_utils  # noqa: E402


def nvidia_resnet50(pretrained: bool = True, **kwargs: _Any) -> "convnets.ResNet":
    """ResNet-50 v1.5 (25.6M parameters) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.resnet50(pretrained=True, **kwargs)``; ``help(convnets.resnet50)`` lists
    the keywords. ``pretrained_from_file=PATH`` loads a local checkpoint of any supported layout.
    """
    return convnets.resnet50(pretrained=pretrained, **kwargs)


def nvidia_resnext101_32x4d(pretrained: bool = True, **kwargs: _Any) -> "convnets.ResNet":
    """ResNeXt101-32x4d (44.2M parameters, 80.19% top-1) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.resnext101_32x4d(pretrained=True, **kwargs)``; ``help(convnets.resnext101_32x4d)``
    lists the keywords. ``pretrained_from_file=PATH`` loads a local checkpoint of any supported layout.
    """
    return convnets.resnext101_32x4d(pretrained=pretrained, **kwargs)


def nvidia_resneXt(pretrained: bool = True, **kwargs: _Any) -> "convnets.ResNet":
    """Upstream's alias of ``nvidia_resnext101_32x4d``: ResNeXt101-32x4d with NGC ImageNet weights.

    Same as ``convnets.resnext101_32x4d(pretrained=True, **kwargs)``.
    """
    return convnets.resnext101_32x4d(pretrained=pretrained, **kwargs)


def nvidia_se_resnext101_32x4d(pretrained: bool = True, **kwargs: _Any) -> "convnets.ResNet":
    """SE-ResNeXt101-32x4d (45.3M parameters, 80.90% top-1) with NVIDIA's NGC ImageNet weights by default.

    Same as ``convnets.se_resnext101_32x4d(pretrained=True, **kwargs)``;
    ``help(convnets.se_resnext101_32x4d)`` lists the keywords. ``pretrained_from_file=PATH`` loads a
    local checkpoint of any supported layout.
    """
    return convnets.se_resnext101_32x4d(pretrained=pretrained, **kwargs)


def nvidia_convnets_processing_utils() -> "processing_utils.Processing":
    """Upstream's preprocessing and result helpers, with its defects fixed.

    Returns an object with ``prepare_input_from_uri(uri, cuda=False, ...)`` (a path, http(s) URL,
    bytes, PIL image or a list of them -> a normalised ``[N, 3, 224, 224]`` batch; EXIF and every
    image mode handled; timeouts and size caps on downloads), ``pick_n_best(predictions, n=5)``
    (prints and returns ``(class_name, "87.3%")`` per sample) and ``get_imgnet_classes()``
    (bundled, never downloaded). See ``help(processing_utils)``.
    """
    return processing_utils.get_utils()
