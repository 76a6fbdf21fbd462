"""Turn a decoded PIL image into the normalised tensor that the ImageNet classifiers expect.

:func:`to_rgb` fixes what real-world files bring (EXIF orientation, grayscale, palette, alpha,
CMYK, 16-bit); :func:`preprocess_image` is the upstream evaluation transform
``Resize(256) -> CenterCrop(224) -> ToTensor -> Normalize(mean, std)`` with the numbers of an
:class:`~convnets.preprocessing.presets.EvalPreset`: torchvision's functional resize and crop
(:func:`resize_and_crop`), then the same float32 arithmetic as ``ToTensor`` + ``Normalize``, so
that its numbers equal the upstream ``transforms.Compose`` bit for bit. :func:`normalize_uint8`
is that arithmetic on uint8 tensors (the training loaders normalise on the device with it), so a
validation batch equals what ``prepare_batch`` gives for the same files, bit for bit.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import ExifTags, Image, ImageOps
from torchvision.transforms import InterpolationMode

from convnets.errors import InvalidArgumentError

from .presets import DEFAULT_PRESET, IMAGENET_MEAN, IMAGENET_STD, EvalPreset

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "normalize_uint8", "preprocess_image", "resize_and_crop", "to_rgb"]

logger = logging.getLogger(__name__)


# 16-bit integer modes. Pillow's convert() clips these at 255 (almost everything turns white), so
# they are scaled to 8 bits instead. Mode "I" (32-bit) is what some decoders give 16-bit grayscale
# files, so it is treated as 16-bit data too (values outside 0..65535 are clipped).
_WIDE_INT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N", "I;16S"})


def _exif_orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception as exc:  # malformed EXIF must not make an otherwise good photo unusable
        logger.warning("ignoring unreadable EXIF data of an image: %s", exc)
        return 1


def to_rgb(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation and convert any image mode to 8-bit RGB.

    Alpha is dropped, not composited (``Image.convert('RGB')`` semantics); palette images with
    transparency go through RGBA so that Pillow does not warn; 16-bit modes are scaled by 1/257
    (rounded), so 65535 becomes 255 rather than everything above 255 saturating. The input image
    is never modified.

    Args:
        image: a decoded PIL image of any mode.

    Returns:
        An RGB image (``image`` itself when it is already upright RGB).

    Raises:
        ValueError: a mode that Pillow cannot convert to RGB.
    """
    orientation = _exif_orientation(image)
    if orientation in range(2, 9):
        # Checked first because exif_transpose copies the whole image even when upright.
        logger.debug("applying EXIF orientation %d", orientation)
        image = ImageOps.exif_transpose(image)
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _WIDE_INT_MODES:
        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        # (v + 128) // 257 == round(v / 257) for integers: v / 257 is never exactly x.5.
        return Image.fromarray(((wide + 128) // 257).astype(np.uint8)).convert("RGB")
    if mode in ("P", "PA") and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def resize_and_crop(image: Image.Image, preset: EvalPreset = DEFAULT_PRESET) -> Image.Image:
    """Resize the shorter side to ``preset.resize_size`` (antialiased) and center-crop ``preset.crop_size``.

    Args:
        image: a PIL image (any mode Pillow can resize).
        preset: the sizes and interpolation.

    Returns:
        A ``crop_size`` x ``crop_size`` PIL image.
    """
    image = F.resize(image, [preset.resize_size], interpolation=InterpolationMode(preset.interpolation),
                     antialias=True)
    return F.center_crop(image, [preset.crop_size, preset.crop_size])


def normalize_uint8(images: torch.Tensor, preset: EvalPreset = DEFAULT_PRESET) -> torch.Tensor:
    """Normalise uint8 CHW / NCHW pixels with the float32 operations of :func:`preprocess_image`.

    ``x / 255``, then ``- mean``, then ``/ std``, each rounded to float32 in that order: on the CPU
    the result equals :func:`preprocess_image` of the same pixels bit for bit (tested). The
    divisors are tensors on the device because CUDA turns a division by a Python number into a
    multiplication by its reciprocal, which rounds differently; on CUDA the same IEEE operations
    should give the same bits, but no test here has a GPU to check that.

    Args:
        images: a uint8 tensor ``[3, H, W]`` or ``[N, 3, H, W]`` on any device.
        preset: mean and std to use.

    Returns:
        A float32 tensor of the same shape and device.
    """
    shape = (3, 1, 1) if images.dim() == 3 else (1, 3, 1, 1)
    device = images.device
    scale = torch.full((), 255, dtype=torch.float32, device=device)
    mean = torch.tensor(preset.mean, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(preset.std, dtype=torch.float32, device=device).view(shape)
    return (images.float() / scale - mean) / std


def preprocess_image(image: Image.Image, *, image_size: int = DEFAULT_PRESET.crop_size,
                     resize_size: int = DEFAULT_PRESET.resize_size,
                     preset: EvalPreset | None = None) -> torch.Tensor:
    """Resize the shorter side, center-crop and normalise an RGB image, as upstream does.

    Args:
        image: an RGB PIL image (see :func:`to_rgb`).
        image_size: side of the square center crop (ignored when ``preset`` is given).
        resize_size: length of the shorter side after the bilinear, antialiased resize (ignored
            when ``preset`` is given).
        preset: all the numbers at once (sizes, interpolation, mean, std); default: the ImageNet
            preset with ``image_size`` and ``resize_size``.

    Returns:
        A float32 tensor ``[3, crop, crop]`` normalised with the preset's mean and std.

    Raises:
        InvalidArgumentError: ``image`` is not in RGB mode (a ``ValueError``).
    """
    if image.mode != "RGB":
        raise InvalidArgumentError(f"preprocess_image needs an RGB image, got mode {image.mode!r}; convert "
                                   f"it with to_rgb() first.")
    if preset is None:
        preset = EvalPreset(crop_size=image_size, resize_size=resize_size)
    image = resize_and_crop(image, preset)
    # ToTensor + Normalize in numpy, with the same float32 operations in the same order (so the
    # result is bit-identical): torch would run each small op as an OpenMP parallel region, which
    # costs milliseconds per image when the cores are busy, e.g. with the other loader threads.
    pixels = np.asarray(image, dtype=np.float32)
    pixels /= np.float32(255)
    pixels -= np.asarray(preset.mean, dtype=np.float32)
    pixels /= np.asarray(preset.std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
