"""From image inputs to one normalised batch tensor, loading many inputs concurrently (each: :mod:`.decode`).

Decoding, resizing and downloading release the GIL, so a thread pool scales over cores for
lists of inputs. The pool is created per call: starting and joining it cost about 2 ms on the
(busy) 2-core development machine, against 50 ms or more to decode one camera photo, and a
per-call pool cannot deadlock when callers themselves run in threads or in forked processes.

``fast_decode=True`` (``--fast-decode`` on the command line) decodes large JPEGs at a reduced DCT
scale first; see :data:`~convnets.preprocessing.decode.FAST_DECODE_MARGIN` for what that costs in
pixels and gains in time.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

import torch
from PIL import Image

from convnets.errors import ConvnetsError, ImageLoadError, InvalidArgumentError, InvalidArgumentTypeError
from convnets.runtime import usable_cores

from .decode import input_error, fast_decode_draft, load_image
from .io import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, ImageInput, is_url
from .presets import DEFAULT_PRESET, EvalPreset
from .transforms import preprocess_image

__all__ = ["PreparedBatch", "prepare_batch", "prepare_input_from_uri"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_INPUT_TYPES = (str, os.PathLike, bytes, bytearray, Image.Image)
# Downloads wait on the network rather than on a core, so lists with URLs get more threads.
_MIN_WORKERS_WITH_URLS = 8

@dataclass(frozen=True)
class _Options:
    preset: EvalPreset
    timeout: float
    max_bytes: int
    max_pixels: int | None
    workers: int | None
    allow_private: bool
    fast_decode: bool = False

    def prepare(self, source: ImageInput, seen: Callable[[Image.Image], None] | None = None) -> torch.Tensor:
        image = load_image(source, timeout=self.timeout, max_bytes=self.max_bytes, max_pixels=self.max_pixels,
                           allow_private=self.allow_private, resize=self.preset.resize_size,
                           draft=fast_decode_draft(self.preset) if self.fast_decode else None)
        try:
            if seen is not None:
                seen(image)
            return preprocess_image(image, preset=self.preset)
        except ConvnetsError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad input is one bad record (input_error)
            raise input_error(source, exc) from exc


def _positive_int(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        kind = "a positive int or None" if optional else "a positive int"
        raise InvalidArgumentError(f"{name} must be {kind}, got {value!r}.")


def _preset(image_size: int, resize_size: int, preset: EvalPreset | None) -> EvalPreset:
    _positive_int("image_size", image_size)
    _positive_int("resize_size", resize_size)
    if preset is not None:
        if not isinstance(preset, EvalPreset):
            raise InvalidArgumentError(f"preset must be an EvalPreset, got {type(preset).__name__}.")
        # The sizes have non-None defaults (upstream's signature), so only a contradiction is an error.
        if (image_size, resize_size) not in ((DEFAULT_PRESET.crop_size, DEFAULT_PRESET.resize_size),
                                             (preset.crop_size, preset.resize_size)):
            raise InvalidArgumentError(
                f"image_size={image_size} / resize_size={resize_size} contradict preset={preset}; pass "
                f"either preset= or the sizes.")
        return preset
    if image_size > resize_size:
        raise InvalidArgumentError(
            f"image_size={image_size} is larger than resize_size={resize_size}; the center crop "
            f"must fit inside the resized image (upstream uses 224 and 256).")
    return EvalPreset(crop_size=image_size, resize_size=resize_size)


def _options(preset: EvalPreset, timeout: float, max_bytes: int, max_pixels: int | None,
             workers: int | None, allow_private: bool, fast_decode: bool = False) -> _Options:
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    _positive_int("max_bytes", max_bytes)
    _positive_int("max_pixels", max_pixels, optional=True)
    _positive_int("workers", workers, optional=True)
    if not isinstance(allow_private, bool):
        raise InvalidArgumentTypeError(f"allow_private must be True or False, got {allow_private!r}.")
    if not isinstance(fast_decode, bool):
        raise InvalidArgumentTypeError(f"fast_decode must be True or False, got {fast_decode!r}.")
    return _Options(preset, float(timeout), max_bytes, max_pixels, workers, allow_private, fast_decode)


def _target(cuda: bool, device: str | torch.device | None, dtype: torch.dtype,
            memory_format: torch.memory_format) -> torch.device:
    if not isinstance(cuda, bool):
        raise InvalidArgumentTypeError(f"cuda must be True or False, got {cuda!r}.")
    try:
        target = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device={device!r} is not a valid torch device ({exc}).") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device {str(target)!r} was requested but CUDA is not available here; pass "
            f"cuda=False (or device='cpu').")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(f"dtype must be a floating-point torch.dtype, got {dtype!r}.")
    if memory_format not in (torch.contiguous_format, torch.channels_last):
        raise InvalidArgumentError(
            f"memory_format must be torch.contiguous_format or torch.channels_last, got "
            f"{memory_format!r}.")
    return target


def _check_inputs(inputs: object) -> list[ImageInput]:
    if not isinstance(inputs, (list, tuple)):
        raise InvalidArgumentTypeError(
            f"inputs must be a list or tuple of images, got {type(inputs).__name__}; wrap a single "
            f"input in a list.")
    for index, source in enumerate(inputs):
        if not isinstance(source, _INPUT_TYPES):
            raise InvalidArgumentTypeError(
                f"input {index} has type {type(source).__name__}; expected a path, an http(s) "
                f"URL, bytes or a PIL image.")
    return list(inputs)


def _default_workers(inputs: Sequence[ImageInput]) -> int:
    """Decoding threads: one per usable core, at least 8 when some input waits on the network."""
    cores = usable_cores()
    if any(is_url(source) for source in inputs):
        cores = max(cores, _MIN_WORKERS_WITH_URLS)
    return max(1, min(len(inputs), cores))


def _map_in_order(function: Callable[[int], _T], inputs: list[int], workers: int) -> list[_T]:
    """``[function(x) for x in inputs]`` on ``workers`` threads; the first exception is raised."""
    if workers == 1:
        return [function(source) for source in inputs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convnets-preprocess") as pool:
        futures: list[Future[_T]] = [pool.submit(function, source) for source in inputs]
        try:
            return [future.result() for future in futures]
        finally:
            # On an error (or Ctrl-C) do not start the inputs that are still queued.
            for future in futures:
                future.cancel()


class PreparedBatch(NamedTuple):
    """Result of :func:`prepare_batch`.

    Attributes:
        tensor: ``[len(indices), 3, image_size, image_size]``; row ``j`` is ``inputs[indices[j]]``.
        indices: positions in ``inputs`` of the images that loaded, in input order.
        errors: ``(position, error)`` for each input that failed, in input order (empty with
            ``on_error="raise"``).
    """

    tensor: torch.Tensor
    indices: list[int]
    errors: list[tuple[int, ImageLoadError]]


def prepare_batch(
    inputs: Sequence[ImageInput],
    *,
    on_error: Literal["raise", "collect"] = "raise",
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
    image_size: int = DEFAULT_PRESET.crop_size,
    resize_size: int = DEFAULT_PRESET.resize_size,
    preset: EvalPreset | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int | None = None,
    workers: int | None = None,
    allow_private: bool = True,
    fast_decode: bool = False,
    on_image: Callable[[int, Image.Image], None] | None = None,
) -> PreparedBatch:
    """Load and preprocess many images concurrently into one batch, reporting failures per input.

    With ``on_error="collect"`` a bad input does not stop the others: the batch holds the images
    that loaded and ``errors`` says which inputs failed and why (what ``convnets predict`` needs).

    Args:
        inputs: a list or tuple of paths, ``http(s)://`` URLs, encoded bytes or PIL images.
        on_error: ``"raise"`` raises the error of the first failing input (in input order) and
            stops queued work; ``"collect"`` returns the failures in ``errors``.
        device: where the batch is put (default CPU).
        dtype: floating-point dtype of the batch; values are computed in float32 first.
        memory_format: ``torch.contiguous_format`` or ``torch.channels_last``.
        image_size: side of the square center crop.
        resize_size: shorter side after resizing; at least ``image_size``.
        preset: crop, resize, interpolation, mean and std at once (e.g. a weights entry's
            ``preset``); ``image_size``/``resize_size`` must then be left out or agree with it.
        timeout: total seconds allowed for each download.
        max_bytes: largest accepted download, in bytes.
        max_pixels: largest accepted width x height; ``None`` uses ``PIL.Image.MAX_IMAGE_PIXELS``.
        workers: threads to use; default: the usable CPU cores (at least 8 when there are URLs),
            at most one per input. ``1`` runs in the calling thread.
        allow_private: download from loopback, private and link-local addresses (default, as
            upstream). ``False``: a URL whose host resolves to one (``localhost``, ``192.168.x``,
            ...) fails with an ``ImageDownloadError``; use it for URLs that come from someone else.
        fast_decode: decode JPEGs much larger than the resize target at a reduced DCT scale
            (``Image.draft``) to at least :data:`FAST_DECODE_MARGIN` times ``resize_size``, then
            resize and crop as usual: 2.3-2.9x less CPU time on 12-megapixel photos, pixels 0.005
            apart on average (0.07 at most) in normalised units. Other images are unaffected. Default
            ``False``: the exact (upstream) preprocessing.
        on_image: called with each input's position and its decoded, upright RGB image before it is
            preprocessed (on the loading threads): what a contact sheet keeps of it, without reading
            the input twice (see :func:`thumbnail_of`).

    Returns:
        A :class:`PreparedBatch` ``(tensor, indices, errors)``.

    Raises:
        ImageLoadError: (or a subclass) with ``on_error="raise"``, for the first failing input.
        InvalidArgumentTypeError: ``inputs`` is not a list/tuple, or holds an unsupported type
            (a ``TypeError``).
        InvalidArgumentError: an invalid option (a ``ValueError``).
    """
    if on_error not in ("raise", "collect"):
        raise InvalidArgumentError(f"on_error must be 'raise' or 'collect', got {on_error!r}.")
    options = _options(_preset(image_size, resize_size, preset), timeout, max_bytes, max_pixels, workers,
                       allow_private, fast_decode)
    target = _target(False, device, dtype, memory_format)
    sources = _check_inputs(inputs)

    def prepare(position: int) -> torch.Tensor | ImageLoadError:
        seen = None if on_image is None else functools.partial(on_image, position)
        if on_error == "raise":
            return options.prepare(sources[position], seen)
        try:
            return options.prepare(sources[position], seen)
        except ImageLoadError as exc:
            return exc

    count = options.workers or _default_workers(sources)
    results = _map_in_order(prepare, list(range(len(sources))), min(count, max(len(sources), 1)))
    indices = [i for i, result in enumerate(results) if isinstance(result, torch.Tensor)]
    tensors = [result for result in results if isinstance(result, torch.Tensor)]
    errors = [(i, result) for i, result in enumerate(results) if isinstance(result, ImageLoadError)]
    for index, error in errors:
        logger.info("input %d failed: %s", index, error)
    if indices:
        tensor = torch.stack(tensors)
    else:
        size = options.preset.crop_size
        tensor = torch.empty((0, 3, size, size))
    tensor = tensor.to(device=target, dtype=dtype, memory_format=memory_format)
    return PreparedBatch(tensor, indices, errors)


def prepare_input_from_uri(
    uri: ImageInput | list[ImageInput] | tuple[ImageInput, ...],
    cuda: bool = False,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
    image_size: int = DEFAULT_PRESET.crop_size,
    resize_size: int = DEFAULT_PRESET.resize_size,
    preset: EvalPreset | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int | None = None,
    workers: int | None = None,
    allow_private: bool = True,
) -> torch.Tensor:
    """Load and preprocess images exactly as upstream ``prepare_input_from_uri`` does, safely.

    ``Resize(resize_size)`` (bilinear, antialiased, shorter side) -> ``CenterCrop(image_size)`` ->
    ``ToTensor`` -> ``Normalize(IMAGENET_MEAN, IMAGENET_STD)``, after applying the EXIF orientation
    and converting any mode to RGB. A list or tuple is loaded concurrently into one batch.

    Args:
        uri: a local path, an ``http(s)://`` URL, encoded bytes, a PIL image, or a list/tuple of
            these.
        cuda: put the result on the default CUDA device (as upstream); ``device`` overrides it.
        device: where the result is put.
        dtype: floating-point dtype of the result; values are computed in float32 first.
        memory_format: ``torch.contiguous_format`` or ``torch.channels_last``.
        image_size: side of the square center crop (upstream 224).
        resize_size: shorter side after resizing (upstream 256); at least ``image_size``.
        preset: crop, resize, interpolation, mean and std at once; see :func:`prepare_batch`.
        timeout: total seconds allowed for each download (connection, headers and body).
        max_bytes: largest accepted download, in bytes (default 64 MiB).
        max_pixels: largest accepted width x height; ``None`` uses ``PIL.Image.MAX_IMAGE_PIXELS``.
        workers: threads for a list; see :func:`prepare_batch`.
        allow_private: download from loopback, private and link-local addresses (default;
            ``False`` refuses them); see :func:`prepare_batch`.

    Returns:
        ``[1, 3, image_size, image_size]`` for one input, ``[N, 3, image_size, image_size]`` for a
        list of N inputs (in input order).

    Raises:
        ImageNotFoundError: a local path does not exist.
        ImageDownloadError: a URL cannot be fetched as an image.
        ImageDecodeError: data that is empty, not an image, corrupt, truncated or too large.
        ImageLoadError: any other unusable input (base class of the above).
        InvalidArgumentTypeError: an unsupported input type (a ``TypeError``).
        InvalidArgumentError: an invalid option (a ``ValueError``).
    """
    target = _target(cuda, device, dtype, memory_format)
    batch = prepare_batch(
        uri if isinstance(uri, (list, tuple)) else [uri], device=target, dtype=dtype,
        memory_format=memory_format, image_size=image_size, resize_size=resize_size, preset=preset,
        timeout=timeout, max_bytes=max_bytes, max_pixels=max_pixels, workers=workers,
        allow_private=allow_private)
    return batch.tensor
