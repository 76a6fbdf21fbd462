"""Evaluation preprocessing: the one home of image loading, transforms, presets and class names.

Modules, in import order (each imports only those before it):

* :mod:`~convnets.preprocessing.presets`: :class:`EvalPreset` (crop, resize, interpolation,
  mean, std), ``DEFAULT_PRESET``, ``preset_for_model``; no torch.
* :mod:`~convnets.preprocessing.sources`: ``is_url``, whether an input names a URL or a local path;
  standard library only.
* :mod:`~convnets.preprocessing.io`: read an input's bytes from a path or URL, safely.
* :mod:`~convnets.preprocessing.transforms`: EXIF / mode normalisation and the eval transform.
* :mod:`~convnets.preprocessing.decode`: decode one input (a path, URL, bytes or PIL image) safely into
  upright RGB (pixel limits before decoding, ``fast_decode``), thumbnails.
* :mod:`~convnets.preprocessing.pipeline`: many inputs into one batch, concurrently.
* :mod:`~convnets.preprocessing.device`: the device path (``--decode device``): JPEGs decoded and
  preprocessed as tensors on the model's device, the rest through ``pipeline``.
* :mod:`~convnets.preprocessing.classes`, :mod:`~convnets.preprocessing.results`: ImageNet class
  names (bundled TSV) and top-k picking.

The top-level ``processing_utils`` package is the upstream-compatible facade over this one.
Importing this package is cheap: a name is imported from its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> module that defines it, imported on first access (PEP 562)
_LAZY: dict[str, str] = {
    **dict.fromkeys(["DEFAULT_PRESET", "IMAGENET_MEAN", "IMAGENET_STD", "INTERPOLATIONS", "EvalPreset",
                     "preset_for_model"], "presets"),
    **dict.fromkeys(["DEFAULT_MAX_BYTES", "DEFAULT_TIMEOUT", "ImageInput"], "io"),
    **dict.fromkeys(["load_image", "open_image"], "decode"),
    **dict.fromkeys(["normalize_uint8", "preprocess_image", "resize_and_crop", "to_rgb"], "transforms"),
    **dict.fromkeys(["PreparedBatch", "prepare_batch", "prepare_input_from_uri"], "pipeline"),
    **dict.fromkeys(["NUM_CLASSES", "get_imgnet_classes", "get_imgnet_synsets"], "classes"),
    "pick_n_best": "results",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
