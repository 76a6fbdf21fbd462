"""torch.hub entry points with upstream's names and defaults (``pretrained=True``).

    model = torch.hub.load("<owner>/<repo>", "nvidia_se_resnext101_32x4d")
    utils = torch.hub.load("<owner>/<repo>", "nvidia_convnets_processing_utils")

The model entry points are generated from the registry (:data:`convnets.models.specs.MODELS`): each
registered model's ``hub_names`` (e.g. ``nvidia_resnext101_32x4d`` and upstream's alias
``nvidia_resneXt``) forward to the ``convnets`` builder of the same architecture; all logic lives in
the package. Keywords: ``pretrained_from_file``, ``num_classes``, ``progress``, ``memory_format``,
``device``, ``state_dict_key_map_fn``, ``use_ema``, architecture overrides (``layers``,
``widths``, ``expansion``, ``cardinality``, ``se_squeeze``, ``stem_width``), upstream's
``last_bn_0_init``, ``conv_init``, ``trt``, ``fused_se``, and the backbone options
(``features_only``, ``out_indices``, ``output_stride``, ``frozen_stages``, ``norm_eval``,
``norm_layer``)::

    backbone = torch.hub.load("<owner>/<repo>", "nvidia_resnext101_32x4d", features_only=True)
"""

dependencies = ["torch", "torchvision", "numpy", "PIL", "requests", "validators", "filelock", "tqdm"]

# Everything but the entry points is private: torch.hub lists the public callables of this module.
from collections.abc import Callable as _Callable  # noqa: E402
from typing import TYPE_CHECKING as _TYPE_CHECKING  # noqa: E402
from typing import Any as _Any  # noqa: E402

import convnets  # noqa: E402
import processing_utils  # noqa: E402
from convnets.models.specs import MODELS as _MODELS  # noqa: E402
from convnets.models.specs import ModelInfo as _ModelInfo  # noqa: E402
from convnets.weights.manifest import load_manifest as _load_manifest  # noqa: E402


def _entry_point(info: _ModelInfo, hub_name: str,
                 has_weights: bool) -> _Callable[..., "convnets.ResNet | convnets.ResNetFeatures"]:
    """The hub entry point ``hub_name`` for one registered model (upstream: ``pretrained=True``)."""
    name = info.name

    def entry(pretrained: bool = has_weights, **kwargs: _Any) -> "convnets.ResNet | convnets.ResNetFeatures":
        return getattr(convnets, name)(pretrained=pretrained, **kwargs)

    title = (getattr(convnets, name).__doc__ or name).strip().splitlines()[0]
    alias = "" if hub_name == info.hub_names[0] else f"Upstream's alias of ``{info.hub_names[0]}``.\n    "
    weights = ("with NVIDIA's NGC ImageNet weights by default" if has_weights
               else "with random weights by default (no pretrained weights are published)")
    entry.__name__ = entry.__qualname__ = hub_name
    entry.__doc__ = (
        f"{title}\n\n    {alias}Builds it {weights}: the same as\n"
        f"    ``convnets.{name}(pretrained={has_weights}, **kwargs)``. ``help(convnets.{name})`` lists the "
        "keywords;\n    ``pretrained_from_file=PATH`` loads a local checkpoint of any supported layout;\n"
        "    ``features_only=True`` returns the backbone alone (timm's spelling).\n    ")
    return entry


def _add_entry_points() -> None:
    published = _load_manifest()
    for info in _MODELS.values():
        for hub_name in info.hub_names:
            if hub_name in globals():
                raise RuntimeError(f"hub name {hub_name!r} of model {info.name!r} is already taken in hubconf.py")
            globals()[hub_name] = _entry_point(info, hub_name, info.name in published)


def nvidia_convnets_processing_utils() -> "processing_utils.Processing":
    """Upstream's preprocessing and result helpers, with its defects fixed.

    Returns an object with ``prepare_input_from_uri(uri, cuda=False, ...)`` (a path, http(s) URL,
    bytes, PIL image or a list of them -> a normalised ``[N, 3, 224, 224]`` batch; EXIF and every
    image mode handled; timeouts and size caps on downloads), ``pick_n_best(predictions, n=5)``
    (prints and returns ``(class_name, "87.3%")`` per sample) and ``get_imgnet_classes()``
    (bundled, never downloaded). See ``help(processing_utils)``.
    """
    return processing_utils.get_utils()


_add_entry_points()  # last, so that a hub name clashing with anything above is caught

if _TYPE_CHECKING:
    # What _add_entry_points defines, for type checkers and IDEs: each hub name is its model's
    # builder (the same signature; the default of ``pretrained`` differs, which types do not show).
    from convnets.registry import Builder as _Builder

    def __getattr__(name: str) -> _Builder:
        raise AttributeError(name)
