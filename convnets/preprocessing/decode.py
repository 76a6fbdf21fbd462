"""Decode one image input safely, into the upright 8-bit RGB image the transforms take.

:func:`open_image` opens a path, URL, bytes or PIL image (read by :mod:`.io`) and decodes its first frame,
checking its pixel count from the header before any pixel is decoded (a decompression bomb, or an image so
thin that resizing it would explode: :func:`check_size`, :func:`check_resize`); :func:`load_image` makes it
upright RGB, every failure one :class:`ImageLoadError` naming the input. Decoding never changes Pillow's
global settings (``LOAD_TRUNCATED_IMAGES``, ``MAX_IMAGE_PIXELS``, warning filters), so it is safe from many
threads. ``fast_decode`` (:data:`FAST_DECODE_MARGIN`) decodes large JPEGs at a reduced DCT scale.
Batches of them: :mod:`.pipeline`.
"""

from __future__ import annotations

import io
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError

from convnets.errors import (ConvnetsError, ImageDecodeError, ImageDownloadError, ImageLoadError, ImageNotFoundError,
                             Interface, InvalidArgumentTypeError, message_for)

from .io import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT, ImageInput, describe_input, download, is_url, open_path
from .presets import EvalPreset
from .transforms import to_rgb

__all__ = ["FAST_DECODE_MARGIN", "check_resize", "check_size", "fast_decode_draft", "input_error", "load_encoded_image", "load_image",
           "load_thumbnail", "open_encoded", "open_image", "thumbnail_of"]

logger = logging.getLogger(__name__)

# What Pillow raises on corrupt data varies by plugin; these are the ones it documents or uses.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error,
                  Image.DecompressionBombError)


#: ``fast_decode``: a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that keeps its shorter
#: side at least ``FAST_DECODE_MARGIN * resize_size``, then resized and cropped as usual (bilinear,
#: antialiased). Measured on 12-megapixel photo-like JPEGs (quality 90, 3.4 MB; benchmarks/bench_fast_decode.py),
#: against the exact path, in normalised units: margin 2 differs by 0.005 on average (0.07 at most,
#: about 1/3 and 4 uint8 levels) and preprocesses with 2.3-2.9x less CPU time (41 against 96-119 ms
#: per image); margin 1 takes only about 1.2x less again (33 ms) but more than doubles the
#: difference (0.011 mean, 0.19 max). Pillow's ``reducing_gap`` after the draft either changed
#: nothing (1.5: the remaining resize ratio is below 4) or gave margin 1's difference without its
#: speed (1.0), so it is not used.
FAST_DECODE_MARGIN = 2


def fast_decode_draft(preset: EvalPreset) -> int:
    """The side that ``fast_decode`` drafts JPEGs to: :data:`FAST_DECODE_MARGIN` times the resize size."""
    return FAST_DECODE_MARGIN * preset.resize_size


def load_image(source: ImageInput, *, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
               max_pixels: int | None = None, allow_private: bool = True, draft: int | None = None,
               resize: int | None = None) -> Image.Image:
    """Open one image and make it upright 8-bit RGB (see :func:`open_image`).

    Args:
        source: a local path, an ``http(s)://`` URL, encoded bytes or a PIL image.
        timeout: total seconds allowed for a download.
        max_bytes: largest accepted download, in bytes.
        max_pixels: largest accepted width x height; ``None`` uses ``PIL.Image.MAX_IMAGE_PIXELS``.
        allow_private: download from loopback, private and link-local addresses (default;
            ``False`` refuses them, see :func:`~convnets.preprocessing.io.download`).
        draft: decode large JPEGs at a reduced DCT scale keeping both sides at least ``draft``
            (see ``open_image``; :func:`fast_decode_draft` gives the ``fast_decode`` size); ``None``:
            exact.
        resize: the length the shorter side will be resized to: an image so thin that the resized
            one would exceed ``max_pixels`` is refused before it is decoded (see ``open_image``).

    Returns:
        An RGB image with the EXIF orientation applied (a PIL input is not modified).

    Raises:
        ImageLoadError: or a subclass, for any input that cannot be used, whatever went wrong
            (``MemoryError`` included); see ``open_image``.
        InvalidArgumentTypeError: ``source`` is none of the accepted types (a ``TypeError``).
    """
    return _upright_rgb(source, lambda: open_image(source, timeout=timeout, max_bytes=max_bytes, max_pixels=max_pixels,
                                                   allow_private=allow_private, draft=draft, resize=resize))


def load_encoded_image(data: bytes, source: str | os.PathLike[str] | bytes, *, max_pixels: int | None = None,
                       draft: int | None = None, resize: int | None = None) -> Image.Image:
    """:func:`load_image` of bytes already read from ``source`` (a path or URL): the same image, the same errors.

    Args:
        data: what :func:`~convnets.preprocessing.io.read_input` read from ``source``.
        source: the input (a path, URL or the bytes themselves), named in errors.
        max_pixels, draft, resize: as for :func:`load_image`.

    Returns:
        An RGB image with the EXIF orientation applied.

    Raises:
        ImageLoadError: or a subclass, as :func:`load_image` raises for ``source``.
    """
    return _upright_rgb(source, lambda: open_encoded(data, describe_input(source), max_pixels=max_pixels, draft=draft,
                                                     resize=resize))


def _upright_rgb(source: ImageInput, opener: Callable[[], Image.Image]) -> Image.Image:
    """``to_rgb`` of the image ``opener`` decodes from ``source``, every failure an error naming ``source``."""
    try:
        image = opener()
    except ConvnetsError:
        raise
    except Exception as exc:  # noqa: BLE001 - see input_error
        raise input_error(source, exc) from exc
    try:
        return to_rgb(image)
    except (ValueError, OSError) as exc:
        raise ImageDecodeError(
            f"Cannot load image {describe_input(source)}: cannot convert mode {image.mode!r} to "
            f"RGB ({exc}).") from exc
    except Exception as exc:  # noqa: BLE001 - see input_error
        raise input_error(source, exc) from exc


def input_error(source: object, error: Exception) -> ImageDecodeError:
    """What an unexpected failure while decoding or preprocessing the input ``source`` is raised as.

    One bad input is one bad record, whatever went wrong with it: a ``MemoryError`` from one
    image, or any other exception of a decoder or a transform, becomes an :class:`ImageDecodeError`
    that names the input (this package's own errors need no such translation).

    Args:
        source: the input.
        error: what was raised.

    Returns:
        The error to raise instead (from ``error``).
    """
    logger.debug("input %s failed", describe_input(source), exc_info=error)
    what = "ran out of memory" if isinstance(error, MemoryError) else "failed"
    detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return ImageDecodeError(f"Cannot load image {describe_input(source)}: decoding or preprocessing it {what} "
                            f"({type(error).__name__}{': ' + detail if detail else ''}).")


def load_thumbnail(source: str, size: int, *, timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True,
                   interface: Interface = "python") -> tuple[Image.Image | None, str | None]:
    """``source`` read (again) and scaled to fit a ``size`` square, or ``(None, why it cannot be)``.

    For pictures of results (contact sheets, notebooks): a failure is logged and returned, not raised.

    Args:
        source: a local path or an http(s) URL.
        size: the side of the square, in pixels.
        timeout: total seconds allowed for a download.
        allow_private: as for :func:`load_image`.
        interface: the words of the reason: ``"python"`` or ``"cli"``.
    """
    try:
        image = load_image(source, timeout=timeout, allow_private=allow_private)
    except ImageLoadError as e:
        logger.warning("no thumbnail for %s: %s", source, e)
        return None, message_for(e, interface)
    return thumbnail_of(image, size), None


def thumbnail_of(image: Image.Image, size: int) -> Image.Image:
    """``image`` scaled to fit a ``size`` square (upstream's notebook: ``img.thumbnail((256, 256))``).

    Scaled both ways: small images (32-pixel datasets) fill their square too. LANCZOS: upstream's
    ANTIALIAS. An image that already fits exactly is returned as it is.
    """
    return ImageOps.contain(image, (size, size), Image.Resampling.LANCZOS)


def _draft(image: Image.Image, draft: int | None) -> None:
    """Ask the JPEG decoder for a reduced DCT scale (1/2, 1/4, 1/8) keeping both sides >= ``draft``.

    Only JPEGs (MPO phone photos included) with both sides at least ``2 * draft`` are touched, so
    every other image decodes exactly as without ``draft``.
    """
    if draft is not None and isinstance(image, JpegImagePlugin.JpegImageFile) and min(image.size) >= 2 * draft:
        image.draft("RGB", (draft, draft))


def _pixel_limit(max_pixels: int | None) -> int | None:
    return Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels


def check_resize(width: int, height: int, resize: int, label: str, max_pixels: int | None = None) -> None:
    """Refuse an image whose shorter side resized to ``resize`` would have more pixels than the limit.

    The decompression-bomb limit counts the pixels of the image as stored; resizing multiplies them
    for a thin image: a 467-byte 1x100000 PNG resized to 256 would take 256x25600000 pixels (20 GB).

    Args:
        width, height: the image's size.
        resize: the length its shorter side is resized to.
        label: the input's name for the message (:func:`~convnets.preprocessing.io.describe_input`).
        max_pixels: the limit; ``None`` uses ``PIL.Image.MAX_IMAGE_PIXELS`` (no limit if that is ``None``).

    Raises:
        ImageDecodeError: the resized image would exceed the limit.
    """
    limit = _pixel_limit(max_pixels)
    short, long = min(width, height), max(width, height)
    if limit is None or short <= 0:
        return
    longer = long * resize // short  # torchvision's resize: the longer side scaled, rounded down
    if resize * longer <= limit:
        return
    size = f"{resize}x{longer}" if width < height else f"{longer}x{resize}"
    problem = (f"Cannot load image {label}: image {width}x{height} is too thin: resizing its shorter side to "
               f"{resize} px would make it {size} = {resize * longer} pixels, more than the limit of {limit}.")
    raise ImageDecodeError(f"{problem} Pass a larger max_pixels if the image is trusted.", cli=problem,
                           keyword="max_pixels")


def check_size(image: Image.Image, label: str, max_pixels: int | None = None, resize: int | None = None) -> None:
    """Refuse an opened (not yet decoded) image with more pixels than the limit, or too thin to resize.

    Args:
        image: an image whose header has been read (``Image.open``).
        label: the input's name for the message (:func:`~convnets.preprocessing.io.describe_input`).
        max_pixels: the limit; ``None`` uses ``PIL.Image.MAX_IMAGE_PIXELS``.
        resize: the length its shorter side will be resized to (:func:`check_resize`); ``None``: not checked.

    Raises:
        ImageDecodeError: the image, or the resized image, would exceed the limit.
    """
    limit = _pixel_limit(max_pixels)
    if limit is not None and image.width * image.height > limit:
        problem = (f"Cannot load image {label}: {image.width}x{image.height} = "
                   f"{image.width * image.height} pixels is more than the limit of {limit} (a possible "
                   f"decompression bomb).")
        raise ImageDecodeError(f"{problem} Pass a larger max_pixels if the image is trusted.", cli=problem,
                               keyword="max_pixels")
    if resize is not None:
        check_resize(image.width, image.height, resize, label, max_pixels)


def _decode(fp: BinaryIO, label: str, max_pixels: int | None, draft: int | None = None,
            resize: int | None = None) -> Image.Image:
    """Decode the first frame of an encoded image, checking its size (and resized size) before decoding pixels."""
    try:
        image = Image.open(fp)
        # Image.open reads only the header, so the pixel count is known before any decoding.
        check_size(image, label, max_pixels, resize)
        _draft(image, draft)
        image.load()
    except ImageLoadError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(
            f"Cannot load image {label}: too many pixels, a possible decompression bomb ({exc})."
        ) from exc
    except UnidentifiedImageError as exc:
        raise ImageDecodeError(
            f"Cannot load image {label}: not a recognised image format (a text, HTML or other "
            f"non-image file?).") from exc
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(
            f"Cannot load image {label}: the data is corrupt or truncated ({exc}).") from exc
    return image


def open_image(source: ImageInput, *, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
               max_pixels: int | None = None, allow_private: bool = True, draft: int | None = None,
               resize: int | None = None) -> Image.Image:
    """Open and fully decode one image, in its original mode and orientation.

    Args:
        source: a local path (``str`` or ``os.PathLike``), an ``http(s)://`` URL, encoded image
            bytes (``bytes``/``bytearray``) or a ``PIL.Image.Image`` (returned as is, loaded).
        timeout: total seconds allowed for a download.
        max_bytes: largest accepted download, in bytes.
        max_pixels: largest accepted width x height of encoded inputs; ``None`` uses
            ``PIL.Image.MAX_IMAGE_PIXELS``.
        allow_private: download from loopback, private and link-local addresses (default;
            ``False`` refuses them, see :func:`~convnets.preprocessing.io.download`).
        draft: decode JPEGs whose sides are both at least ``2 * draft`` at a reduced DCT scale
            (``Image.draft``: 1/2, 1/4 or 1/8) that keeps both sides at least ``draft`` (much faster,
            slightly different pixels); other inputs, and all with ``None`` (default), decode exactly.
        resize: the length the caller will resize the shorter side to: an image so thin that the
            resized one would have more than ``max_pixels`` is refused before it is decoded
            (:func:`check_resize`); ``None``: not checked.

    Returns:
        The decoded (first frame of the) image.

    Raises:
        InvalidArgumentTypeError: ``source`` is none of the accepted types (a ``TypeError``).
        ImageNotFoundError: a path that does not exist.
        ImageDownloadError: a URL that cannot be fetched (see :func:`~convnets.preprocessing.io.download`).
        ImageDecodeError: data that is empty, not an image, corrupt, truncated or too large (or,
            with ``resize``, too thin).
        ImageLoadError: any other unusable input (a directory, an unreadable file).
    """
    label = describe_input(source)
    if isinstance(source, Image.Image):
        if resize is not None:
            check_resize(source.width, source.height, resize, label, max_pixels)
        try:
            source.load()
        except _DECODE_ERRORS as exc:
            raise ImageDecodeError(
                f"Cannot load image {label}: the data is corrupt or truncated ({exc}).") from exc
        return source
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise ImageDecodeError(f"Cannot load image {label}: the data is empty.")
        return _decode(io.BytesIO(source), label, max_pixels, draft, resize)
    if isinstance(source, str) and is_url(source):
        data = download(source, timeout=timeout, max_bytes=max_bytes, allow_private=allow_private)
        if not data:
            raise ImageDownloadError(f"Cannot load image {label}: the server sent an empty body.")
        return _decode(io.BytesIO(data), label, max_pixels, draft, resize)
    if isinstance(source, (str, os.PathLike)):
        if os.fspath(source) == "":
            raise ImageNotFoundError("Cannot load image '': the path is empty.")
        return open_path(Path(source), label, lambda fp: _decode(fp, label, max_pixels, draft, resize))
    raise InvalidArgumentTypeError(
        f"Cannot load image {label}: expected a path, an http(s) URL, bytes or a PIL image, got "
        f"{type(source).__name__}.")


def open_encoded(data: bytes, label: str, *, max_pixels: int | None = None, draft: int | None = None,
                 resize: int | None = None) -> Image.Image:
    """Decode bytes that :func:`~convnets.preprocessing.io.read_input` read, failing as :func:`open_image` fails for the input ``label`` names.

    Args:
        data: the encoded image.
        label: the input's name in messages (:func:`~convnets.preprocessing.io.describe_input` of the path or URL).
        max_pixels, draft, resize: as for :func:`open_image`.

    Returns:
        The decoded (first frame of the) image.

    Raises:
        ImageDecodeError: data that is not an image, corrupt, truncated or too large.
    """
    if not data:
        raise ImageDecodeError(f"Cannot load image {label}: the data is empty.")
    return _decode(io.BytesIO(data), label, max_pixels, draft, resize)
