"""Preprocessing and result helpers, compatible with upstream ``nvidia_convnets_processing_utils``.

Upstream usage keeps working::

    utils = processing_utils.get_utils()       # what the hub entry point returns
    batch = utils.prepare_input_from_uri(["cat.jpg", "https://example.com/dog.jpg"])
    utils.pick_n_best(torch.softmax(model(batch), dim=1), n=5)

and each function is also importable directly from this package.

This package is a facade: the implementation lives in :mod:`convnets.preprocessing` (imports go
``processing_utils -> convnets``, never the other way).
"""

from __future__ import annotations

from convnets.errors import ImageDecodeError, ImageDownloadError, ImageLoadError, ImageNotFoundError

from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes, get_imgnet_synsets
from convnets.preprocessing.io import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, ImageInput, open_image
from convnets.preprocessing.pipeline import PreparedBatch, load_image, prepare_batch, prepare_input_from_uri
from convnets.preprocessing.results import pick_n_best
from convnets.preprocessing.transforms import IMAGENET_MEAN, IMAGENET_STD, preprocess_image, to_rgb

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TIMEOUT",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NUM_CLASSES",
    "ImageDecodeError",
    "ImageDownloadError",
    "ImageInput",
    "ImageLoadError",
    "ImageNotFoundError",
    "PreparedBatch",
    "Processing",
    "get_imgnet_classes",
    "get_imgnet_synsets",
    "get_utils",
    "load_image",
    "open_image",
    "pick_n_best",
    "preprocess_image",
    "prepare_batch",
    "prepare_input_from_uri",
    "to_rgb",
]


class Processing:
    """The object upstream's ``nvidia_convnets_processing_utils()`` returns: the helpers as methods."""

    prepare_input_from_uri = staticmethod(prepare_input_from_uri)
    pick_n_best = staticmethod(pick_n_best)
    get_imgnet_classes = staticmethod(get_imgnet_classes)
    get_imgnet_synsets = staticmethod(get_imgnet_synsets)
    prepare_batch = staticmethod(prepare_batch)
    load_image = staticmethod(load_image)


def get_utils() -> Processing:
    """The helpers object for the ``nvidia_convnets_processing_utils`` hub entry point.

    Returns:
        A :class:`Processing` instance.
    """
    return Processing()
