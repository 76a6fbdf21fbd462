"""Evaluation presets: the one description of how an image becomes a model's input.

An :class:`EvalPreset` says how large the center crop is, what the shorter side is resized to
first, with which interpolation, and which mean and standard deviation normalise the pixels.
Each weights entry owns one (:attr:`convnets.weights.manifest.WeightsEntry.preset`), a model
trained with ``convnets train`` gets one from its recorded image size (:func:`preset_for_model`),
and every evaluation path takes its numbers from a preset: ``prepare_input_from_uri`` /
``prepare_batch``, ``convnets.inference.predict``, the ``pytorch`` validation loader, the DALI validation
pipeline and export verification. ``round(size * 256 / 224)`` lives in
:meth:`EvalPreset.for_image_size` only.

This module imports no torch, so the manifest and the CLI can build presets cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from convnets.constants import MAX_IMAGE_SIZE
from convnets.errors import InvalidArgumentError, short_repr

__all__ = ["DEFAULT_PRESET", "IMAGENET_MEAN", "IMAGENET_STD", "INTERPOLATIONS", "MAX_RESIZE_SIZE", "EvalPreset",
           "preset_for_model"]

#: ImageNet per-channel mean and standard deviation (RGB, 0..1 scale), as upstream uses them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: Interpolations every evaluation path (PIL, torchvision tensors, DALI) can apply.
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")

# The ratio of NVIDIA's (and torchvision's) ImageNet evaluation: resize 256, crop 224.
_RESIZE_RATIO = (256, 224)

#: The largest ``resize_size``: that of the largest crop (:data:`~convnets.constants.MAX_IMAGE_SIZE`)
#: at the ImageNet ratio, 4681 px.
MAX_RESIZE_SIZE = round(MAX_IMAGE_SIZE * _RESIZE_RATIO[0] / _RESIZE_RATIO[1])


def _size(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        raise InvalidArgumentError(f"EvalPreset {name} must be a positive int of at most {limit}, "
                                   f"got {short_repr(value)}.")
    return value


def _channels(name: str, value: object, *, positive: bool) -> tuple[float, float, float]:
    numbers: tuple[float, ...] = ()
    if isinstance(value, Collection):
        try:
            numbers = tuple(float(v) for v in value if not isinstance(v, bool))
        except (TypeError, ValueError):
            pass
        if len(numbers) != len(value):  # a bool among them
            numbers = ()
    if len(numbers) != 3 or not all(math.isfinite(v) and (v > 0 or not positive) for v in numbers):
        kind = "three positive finite numbers" if positive else "three finite numbers"
        raise InvalidArgumentError(f"EvalPreset {name} must be {kind} (RGB, 0..1 scale), got {value!r}.")
    return numbers[0], numbers[1], numbers[2]


@dataclass(frozen=True)
class EvalPreset:
    """How an image is resized, cropped and normalised for evaluation.

    Attributes:
        crop_size: side of the square center crop (the model's input size), at most
            :data:`~convnets.constants.MAX_IMAGE_SIZE` (the input of a larger one alone would take
            gigabytes).
        resize_size: length of the shorter side after resizing, before the crop; at least
            ``crop_size``, at most :data:`MAX_RESIZE_SIZE`.
        interpolation: one of :data:`INTERPOLATIONS`; the resize is antialiased.
        mean: per-channel normalisation mean (RGB, 0..1 scale).
        std: per-channel normalisation standard deviation (RGB, 0..1 scale, positive).

    Raises:
        InvalidArgumentError: a field that is not of the kind above.
    """

    crop_size: int
    resize_size: int
    interpolation: str = "bilinear"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        crop = _size("crop_size", self.crop_size, MAX_IMAGE_SIZE)
        resize = _size("resize_size", self.resize_size, MAX_RESIZE_SIZE)
        if crop > resize:
            raise InvalidArgumentError(
                f"EvalPreset crop_size={crop} is larger than resize_size={resize}; the center crop "
                f"must fit inside the resized image (ImageNet evaluation uses 224 and 256).")
        if self.interpolation not in INTERPOLATIONS:
            raise InvalidArgumentError(
                f"EvalPreset interpolation must be one of {', '.join(INTERPOLATIONS)}, got "
                f"{self.interpolation!r}.")
        # Lists (JSON) become tuples so that presets compare equal and stay hashable.
        object.__setattr__(self, "mean", _channels("mean", self.mean, positive=False))
        object.__setattr__(self, "std", _channels("std", self.std, positive=True))

    @classmethod
    def for_image_size(cls, size: int, **fields: Any) -> EvalPreset:
        """The ImageNet-style preset for a crop of ``size``: resize to ``round(size * 256 / 224)``.

        Args:
            size: the center-crop size (224 gives the upstream 256 / 224).
            **fields: ``interpolation``, ``mean`` or ``std`` to use instead of the defaults.

        Returns:
            The preset.

        Raises:
            InvalidArgumentError: ``size`` is not a positive int of at most
                :data:`~convnets.constants.MAX_IMAGE_SIZE`, or a bad field.
        """
        size = _size("crop_size", size, MAX_IMAGE_SIZE)
        return cls(crop_size=size, resize_size=round(size * _RESIZE_RATIO[0] / _RESIZE_RATIO[1]), **fields)

    def with_crop_size(self, size: int) -> EvalPreset:
        """This preset for another crop size: resize scaled as in :meth:`for_image_size`.

        Args:
            size: the new center-crop size.

        Returns:
            ``self`` when ``size`` is already its crop size, else a preset with the same
            interpolation, mean and std.
        """
        if size == self.crop_size:
            return self
        return EvalPreset.for_image_size(size, interpolation=self.interpolation, mean=self.mean, std=self.std)


#: The upstream evaluation: resize 256 (bilinear, antialiased), center-crop 224, ImageNet mean/std.
DEFAULT_PRESET = EvalPreset.for_image_size(224)


def preset_for_model(model: object) -> EvalPreset:
    """The evaluation preset of a model.

    Uses ``model.input_size`` when the model has one (``convnets`` models do; loading a
    ``convnets train`` checkpoint sets it from the recorded image size), else
    :data:`DEFAULT_PRESET`.

    Args:
        model: a ``convnets`` model, or any module.

    Returns:
        The preset for the model's input size.

    Raises:
        InvalidArgumentError: ``model.input_size`` is set but not a positive int.
    """
    size = getattr(model, "input_size", None)
    return DEFAULT_PRESET if size is None else DEFAULT_PRESET.with_crop_size(size)
