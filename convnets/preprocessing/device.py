"""JPEGs decoded and preprocessed as tensors on the model's device: ``--decode device`` (``decode="device"``).

The CPU path (:mod:`~convnets.preprocessing.pipeline`) decodes with Pillow and resizes PIL images, all on
the CPU, which bounds ``predict`` on a GPU. The device path splits the work:

* the loading threads and worker processes read each input's bytes and parse its header only
  (:func:`load_for_device`): a JPEG that the device decodes as Pillow would stays encoded (a 1-D uint8
  tensor); any other input goes the CPU path there and then, as a uint8 crop (a 3-D tensor);
* the main process decodes the encoded ones of a batch in one call of ``torchvision.io.decode_jpeg`` on
  the model's device (nvJPEG on CUDA, libjpeg-turbo on the CPU), then resizes them (antialiased, the
  preset's interpolation), centre-crops them there as tensors (:func:`crops_on_device`); the caller
  normalises the stacked uint8 crops with :func:`~convnets.preprocessing.transforms.normalize_uint8`.

What goes the CPU path, per image, so that a run never fails because of the choice: every format but
JPEG, greyscale and CMYK JPEGs, progressive ones, MPO (multi-picture) files, photos whose EXIF orientation
rotates them, and any JPEG that ``decode_jpeg`` refuses (a truncated one then gets the CPU path's error).
Unreadable inputs fail with the CPU path's errors, word for word.

Faithfulness: on the CPU, ``decode_jpeg`` gives Pillow's pixels bit for bit (both are libjpeg-turbo); the
tensor resize is computed in float32 and rounded, and differs from Pillow's by at most one uint8 level
with bilinear interpolation (a few with bicubic). tests/test_device_decode.py checks the logits against
the CPU path; on CUDA nvJPEG's IDCT and chroma upsampling differ slightly more (tests/test_cuda.py).
``processing_utils.prepare_input_from_uri`` never takes this path: it keeps upstream's PIL semantics.
"""

from __future__ import annotations

import io
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torchvision.transforms.functional as F
from PIL import Image, JpegImagePlugin
from torchvision.transforms import InterpolationMode

from convnets.constants import DECODES
from convnets.errors import ImageLoadError, InvalidArgumentError

from .decode import check_size, input_error, load_encoded_image
from .io import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, describe_input, read_input
from .pipeline import _default_workers, _map_in_order
from .presets import EvalPreset
from .transforms import _exif_orientation, resize_and_crop

__all__ = ["DECODES", "crops_on_device", "decode_jpegs", "is_device_jpeg", "load_batch_for_device", "load_for_device", "pil_crop",
           "resize_and_crop_tensor", "resolve_decode", "thumbnail_of_tensor"]

log = logging.getLogger(__name__)

#: The most float32 values resized at once (images of one size are stacked up to this).
_GROUP_VALUES = 1 << 26

# Pillow's NEAREST samples pixel centres: torch's "nearest-exact", not its legacy "nearest".
_TENSOR_INTERPOLATION = {"nearest": InterpolationMode.NEAREST_EXACT, "bilinear": InterpolationMode.BILINEAR,
                         "bicubic": InterpolationMode.BICUBIC}


def resolve_decode(decode: str, device: torch.device | str) -> str:
    """``"cpu"`` or ``"device"``: what ``decode`` (one of :data:`~convnets.constants.DECODES`) means for ``device``.

    ``"auto"`` is the device path on CUDA (where the CPU's decoding bounds the throughput), the CPU path
    elsewhere (where it is the same cores either way and the CPU path is upstream's, exact).

    Raises:
        InvalidArgumentError: ``decode`` is not one of :data:`~convnets.constants.DECODES`.
    """
    if decode not in DECODES:
        raise InvalidArgumentError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}", keyword="decode")
    if decode == "auto":
        return "device" if torch.device(device).type == "cuda" else "cpu"
    return decode


def is_device_jpeg(image: Image.Image) -> bool:
    """Whether an opened image (its header read) is a JPEG that the device decodes as Pillow does: baseline
    (not progressive), three YCbCr/RGB channels, upright (no EXIF rotation), a single picture."""
    return (type(image) is JpegImagePlugin.JpegImageFile and image.mode == "RGB"
            and not image.info.get("progressive") and not image.info.get("progression")
            and _exif_orientation(image) == 1)


def pil_crop(image: Image.Image, preset: EvalPreset) -> torch.Tensor:
    """The CPU path's resize and crop of an RGB image as uint8 ``[3, crop, crop]`` (normalised later, as the
    device path's crops are: :func:`~convnets.preprocessing.transforms.normalize_uint8` gives the CPU path's
    numbers bit for bit)."""
    return F.pil_to_tensor(resize_and_crop(image, preset))


def load_for_device(source: str | os.PathLike[str] | bytes, preset: EvalPreset, *, timeout: float = DEFAULT_TIMEOUT,
                    max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int | None = None, allow_private: bool = True,
                    draft: int | None = None,
                    on_image: Callable[[Image.Image], None] | None = None) -> torch.Tensor:
    """One input read for the device path (on a loading thread or worker process).

    Args:
        source: a local path, an http(s) URL or encoded bytes.
        preset: the resize and crop of inputs that go the CPU path.
        timeout, max_bytes, max_pixels, allow_private: as for :func:`~convnets.preprocessing.decode.load_image`.
        draft: the ``fast_decode`` draft size of the inputs that go the CPU path; ``None``: exact.
        on_image: called with the decoded RGB image of an input that goes the CPU path (a thumbnail).

    Returns:
        A 1-D uint8 tensor (the encoded JPEG, for :func:`crops_on_device`), or the CPU path's uint8
        ``[3, crop, crop]`` crop.

    Raises:
        ImageLoadError: or a subclass: what the CPU path raises for ``source``.
    """
    if isinstance(source, bytes):
        data = source
    else:
        data = read_input(source, timeout=timeout, max_bytes=max_bytes, allow_private=allow_private)
    header: Image.Image | None
    try:
        header = Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not an image Pillow knows: the CPU path says why, in its words
        header = None
    if header is not None and is_device_jpeg(header):
        check_size(header, describe_input(source), max_pixels, preset.resize_size)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    image = load_encoded_image(data, source, max_pixels=max_pixels, draft=draft, resize=preset.resize_size)
    if on_image is not None:
        on_image(image)
    return pil_crop(image, preset)


def decode_jpegs(encoded: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor | None]:
    """Decode JPEGs to uint8 RGB ``[3, H, W]`` on ``device`` in one batched call; ``None`` where refused.

    One refused image fails ``decode_jpeg``'s whole batch, so a failed batch is decoded again one image at a
    time to find it (rare: :func:`load_for_device` sends only baseline colour JPEGs here).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    if not encoded:
        return []
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image codecs for TorchCodec's (not installed here, and without a
        # batched nvJPEG decoder of images yet); the warning would come once per batch.
        warnings.filterwarnings("ignore", message=".*image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        try:
            return list(decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device))
        except RuntimeError as batch_error:
            log.debug("decode_jpeg refused a batch (%s); decoding its images one by one", batch_error)
        decoded: list[torch.Tensor | None] = []
        for data in encoded:
            try:
                decoded.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
            except RuntimeError as error:
                log.debug("decode_jpeg refused an image (%s); it goes the CPU path", error)
                decoded.append(None)
        return decoded


def resize_and_crop_tensor(image: torch.Tensor, preset: EvalPreset) -> torch.Tensor:
    """:func:`~convnets.preprocessing.transforms.resize_and_crop` of a uint8 ``[3, H, W]`` tensor (or a batch
    ``[N, 3, H, W]`` of one size), on its device.

    The shorter side resized to ``preset.resize_size`` (antialiased, the preset's interpolation; the
    longer side as torchvision computes it for PIL images too), computed in float32 and rounded to uint8 as
    Pillow rounds, then the centre crop.

    Returns:
        uint8 ``[3, crop, crop]`` (``[N, 3, crop, crop]``) on the device of ``image``.
    """
    resized = F.resize(image.float(), [preset.resize_size], interpolation=_TENSOR_INTERPOLATION[preset.interpolation],
                       antialias=True)
    crop = F.center_crop(resized, [preset.crop_size, preset.crop_size])
    return crop.round_().clamp_(0, 255).to(torch.uint8)


def crops_on_device(loaded: Sequence[torch.Tensor], sources: Sequence[str | bytes], preset: EvalPreset,
                    device: torch.device | str, *, max_pixels: int | None = None, draft: int | None = None,
                    on_image: Callable[[int, torch.Tensor | Image.Image], None] | None = None,
                    ) -> list[torch.Tensor | ImageLoadError]:
    """One batch's inputs from :func:`load_for_device` as uint8 ``[3, crop, crop]`` crops on ``device``.

    Args:
        loaded: per input, its encoded JPEG (1-D) or its CPU-path crop (3-D).
        sources: the inputs, named in errors.
        preset: the resize and crop.
        device: where JPEGs are decoded and the crops are put.
        max_pixels, draft: for a JPEG the device refuses, which goes the CPU path here.
        on_image: called with each position and its full decoded image (a ``[3, H, W]`` tensor on ``device``,
            or the PIL image of a refused JPEG): a thumbnail.

    Returns:
        Per input, its crop on ``device``, or the CPU path's error for a JPEG that neither path decodes.
    """
    encoded = [i for i, tensor in enumerate(loaded) if tensor.dim() == 1]
    decoded = dict(zip(encoded, decode_jpegs([loaded[i] for i in encoded], device)))
    crops: dict[int, torch.Tensor | ImageLoadError] = {}
    same_size: dict[tuple[int, ...], list[int]] = {}
    for i, tensor in enumerate(loaded):
        if i not in decoded:  # the CPU path's crop
            crops[i] = tensor.to(device, non_blocking=tensor.is_pinned())
            continue
        image = decoded[i]
        if image is None:  # refused by decode_jpeg: Pillow decodes it, or says why not
            try:
                pil = load_encoded_image(tensor.numpy().tobytes(), sources[i], max_pixels=max_pixels, draft=draft,
                                         resize=preset.resize_size)
            except ImageLoadError as error:
                crops[i] = error
                continue
            if on_image is not None:
                on_image(i, pil)
            crops[i] = pil_crop(pil, preset).to(device)
            continue
        if on_image is not None:
            on_image(i, image)
        same_size.setdefault(tuple(image.shape), []).append(i)
    for shape, positions in same_size.items():
        # Images of one size are resized together (a few kernels for the batch rather than per image), in
        # groups of at most _GROUP_VALUES float32 values (256 MB): 12-megapixel photos go one by one.
        group = max(1, _GROUP_VALUES // math.prod(shape))
        for start in range(0, len(positions), group):
            chunk = positions[start:start + group]
            images = torch.stack([decoded[i] for i in chunk])  # type: ignore[misc]
            crops.update(zip(chunk, resize_and_crop_tensor(images, preset)))
    return [crops[i] for i in range(len(loaded))]


def thumbnail_of_tensor(image: torch.Tensor, size: int) -> Image.Image:
    """A uint8 ``[3, H, W]`` image scaled to fit a ``size`` square (antialiased), as a PIL image on the CPU."""
    height, width = image.shape[-2:]
    scale = size / max(height, width)
    shape = [max(1, round(height * scale)), max(1, round(width * scale))]
    small = F.resize(image.float(), shape, interpolation=InterpolationMode.BICUBIC, antialias=True)
    pixels = small.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(pixels)


def load_batch_for_device(sources: Sequence[str | bytes], preset: EvalPreset, *, workers: int | None = None,
                          timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True, draft: int | None = None,
                          on_image: Callable[[int, Image.Image], None] | None = None,
                          ) -> list[torch.Tensor | ImageLoadError]:
    """:func:`load_for_device` of many inputs on ``workers`` threads (as :func:`~convnets.preprocessing.pipeline.prepare_batch`
    uses them: ``None``, one per usable core, at least 8 with URLs); an input's error in its place."""
    def load(position: int) -> torch.Tensor | ImageLoadError:
        seen = None if on_image is None else (lambda image: on_image(position, image))
        try:
            return load_for_device(sources[position], preset, timeout=timeout, allow_private=allow_private,
                                   draft=draft, on_image=seen)
        except ImageLoadError as error:
            return error
        except Exception as error:  # noqa: BLE001 - one bad input is one bad record, as on the CPU path
            return input_error(sources[position], error)

    count = min(workers or _default_workers(list(sources)), max(len(sources), 1))
    return _map_in_order(load, list(range(len(sources))), count)
