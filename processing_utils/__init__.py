"""Preprocessing and result helpers, compatible with upstream ``nvidia_convnets_processing_utils``.

Upstream usage keeps working::

    utils = processing_utils.get_utils()       # what the hub entry point returns
    batch = utils.prepare_input_from_uri(["cat.jpg", "https://example.com/dog.jpg"])
    utils.pick_n_best(torch.softmax(model(batch), dim=1), n=5)

and each function is also importable directly from this package. Beyond upstream, ``classify``
runs the model between the two, optionally through an inference engine (the ``engine=`` keyword
of :func:`convnets.optimize_for_inference`, re-exported here as ``optimize_for_inference``)::

    utils.classify(model, ["cat.jpg", "dog.jpg"], n=5, engine="auto", precision="bf16")

This package is a facade: the implementation lives in :mod:`convnets.preprocessing` (imports go
``processing_utils -> convnets``, never the other way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from convnets.errors import ImageDecodeError, ImageDownloadError, ImageLoadError, ImageNotFoundError

from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes, get_imgnet_synsets
from convnets.preprocessing.decode import load_image, open_image
from convnets.preprocessing.io import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, ImageInput
from convnets.preprocessing.pipeline import PreparedBatch, prepare_batch, prepare_input_from_uri
from convnets.preprocessing.results import pick_n_best
from convnets.preprocessing.transforms import IMAGENET_MEAN, IMAGENET_STD, preprocess_image, to_rgb

if TYPE_CHECKING:
    import torch

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
    "classify",
    "get_imgnet_classes",
    "get_imgnet_synsets",
    "get_utils",
    "load_image",
    "open_image",
    "optimize_for_inference",
    "pick_n_best",
    "preprocess_image",
    "prepare_batch",
    "prepare_input_from_uri",
    "to_rgb",
]


def optimize_for_inference(model: torch.nn.Module, precision: str = "fp32", device: Any = None,
                           engine: str = "torch", calibration_data: Any = None, compile: bool = True) -> torch.nn.Module:
    """:func:`convnets.optimize_for_inference` (the same arguments): ``model`` run by ``engine``.

    Build it once and call it like the model, e.g. ``probs = torch.softmax(fast(batch), dim=1)``.
    """
    from convnets.deploy.optimize import optimize_for_inference as optimize

    return optimize(model, precision, device=device, engine=engine, calibration_data=calibration_data,
                    compile=compile)


def classify(model: Callable[[torch.Tensor], torch.Tensor],
             uri: ImageInput | list[ImageInput] | tuple[ImageInput, ...], n: int = 5, *,
             engine: str | None = None, precision: str = "fp32", calibration_data: Any = None,
             verbose: bool = True, **prepare_options: Any) -> list[list[tuple[str, str]]]:
    """Upstream's three steps in one call: ``prepare_input_from_uri`` -> softmax of ``model`` -> ``pick_n_best``.

    Args:
        model: an ImageNet classifier (1000 outputs) in eval mode, or any callable from a
            normalised batch to logits (e.g. what :func:`optimize_for_inference` returned).
        uri: what :func:`prepare_input_from_uri` takes: a path, URL, bytes, PIL image or a list.
        n: classes per image, as for :func:`pick_n_best`.
        engine: ``None`` (default): call ``model`` as it is. An engine name (``"torch"``,
            ``"onnxruntime"``, ``"openvino"``, ``"auto"``): run it through
            :func:`optimize_for_inference` with ``precision`` (and ``calibration_data`` for
            ``"int8"``) first. That build costs seconds to a minute, on every call: to classify
            many batches, build once with :func:`optimize_for_inference` and pass the result.
        precision: the engine's precision (with ``engine`` only).
        calibration_data: for ``precision="int8"`` (with ``engine`` only).
        verbose: print ``sample {i}: [...]`` per image, as upstream's ``pick_n_best``.
        **prepare_options: keywords of :func:`prepare_input_from_uri` (``device``, ``image_size``,
            ``timeout``, ``allow_private=False`` to refuse URLs on loopback or private addresses, ...).

    Returns:
        Per image, ``n`` tuples ``(class_name, "87.3%")``, best first (as :func:`pick_n_best`).

    Raises:
        InvalidArgumentError: ``precision`` / ``calibration_data`` without ``engine``, or what
            :func:`optimize_for_inference`, :func:`prepare_input_from_uri` or
            :func:`pick_n_best` raise.
    """
    import torch

    from convnets.errors import InvalidArgumentError, InvalidArgumentTypeError

    if engine is None:
        if precision != "fp32" or calibration_data is not None:
            raise InvalidArgumentError("precision and calibration_data choose how an engine runs the model: "
                                       "pass engine='auto' (or 'torch', 'onnxruntime', 'openvino') with them")
    elif not isinstance(model, torch.nn.Module):
        raise InvalidArgumentTypeError(f"engine={engine!r} runs a torch.nn.Module, got {type(model).__name__}; "
                                       "call classify without engine to use this callable as it is")
    else:
        model = optimize_for_inference(model, precision, engine=engine, calibration_data=calibration_data)
    batch = prepare_input_from_uri(uri, **prepare_options)
    with torch.inference_mode():
        probabilities = torch.softmax(model(batch).float(), dim=1)
    return pick_n_best(probabilities, n=n, verbose=verbose)


class Processing:
    """The object upstream's ``nvidia_convnets_processing_utils()`` returns: the helpers as methods."""

    prepare_input_from_uri = staticmethod(prepare_input_from_uri)
    pick_n_best = staticmethod(pick_n_best)
    get_imgnet_classes = staticmethod(get_imgnet_classes)
    get_imgnet_synsets = staticmethod(get_imgnet_synsets)
    prepare_batch = staticmethod(prepare_batch)
    load_image = staticmethod(load_image)
    classify = staticmethod(classify)
    optimize_for_inference = staticmethod(optimize_for_inference)


def get_utils() -> Processing:
    """The helpers object for the ``nvidia_convnets_processing_utils`` hub entry point.

    Returns:
        A :class:`Processing` instance.
    """
    return Processing()
