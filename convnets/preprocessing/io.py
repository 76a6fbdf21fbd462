"""Read an image input's bytes from a local path or an http(s) URL, safely (decoding them: :mod:`.decode`).

Every failure a user can cause (missing file, a directory or a pipe, HTTP error, slow or endless server,
HTML page, oversized body) raises one :class:`ImageLoadError` subclass whose message names the input
and the reason.

URLs are fetched through :func:`convnets.urls.open_url`: one deadline and one size cap for the
whole redirect chain, at most five redirects, and, with ``allow_private=False``
(``--deny-private-urls`` on the command line), no loopback, private or link-local address.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from collections.abc import Callable
from typing import BinaryIO, TypeVar, Union

import requests
import urllib3
import validators
from PIL import Image

from convnets.constants import DEFAULT_TIMEOUT, MAX_REDIRECTS, PRIVATE_URLS_OPTION
from convnets.errors import (
    ImageDecodeError,
    ImageDownloadError,
    ImageLoadError,
    ImageNotFoundError,
)
from convnets.preprocessing.sources import is_url, url_scheme
from convnets.urls import BlockedAddressError, RedirectError, open_url, read_chunks

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TIMEOUT",
    "ImageInput",
    "describe_input",
    "download",
    "is_url",
    "open_path",
    "read_input",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: What :func:`~convnets.preprocessing.decode.open_image` accepts: a local path, an ``http(s)://`` URL, encoded bytes or a PIL image.
ImageInput = Union[str, os.PathLike[str], bytes, bytearray, Image.Image]

DEFAULT_MAX_BYTES = 64 * 2**20

USER_AGENT = f"convnets-processing-utils (python-requests/{requests.__version__})"
_CHUNK_BYTES = 64 * 1024
# Content types that are certainly not an image: an error or login page served with status 200.
_NON_IMAGE_TYPES = ("text/", "application/json", "application/xml", "application/xhtml+xml",
                    "application/javascript")


def _abbreviate(text: str, limit: int = 160) -> str:
    """Shorten ``text`` to about ``limit`` characters, keeping both ends (a URL's host and file)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}...{text[-(limit - head - 3):]}"


def describe_input(source: object) -> str:
    """A short, human-readable name of an input for error messages and logs.

    Args:
        source: anything that was passed as an image input.

    Returns:
        The quoted (and, when long, abbreviated) path or URL, or a summary of bytes or PIL inputs.
    """
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes of image data>"
    if isinstance(source, Image.Image):
        return f"<PIL image, mode {source.mode}, {source.width}x{source.height}>"
    if isinstance(source, (str, os.PathLike)):
        return repr(_abbreviate(os.fspath(source)))
    return _abbreviate(repr(source))


def _timed_out(label: str, timeout: float) -> ImageDownloadError:
    # cli: the command that offers the timeout adds its option (see convnets.errors).
    return ImageDownloadError(
        f"Cannot load image {label}: the download did not finish within timeout={timeout:g} s "
        f"(the limit for connecting and receiving the whole image). Retry, or pass a larger "
        f"timeout.",
        cli=f"Cannot load image {label}: the download did not finish within {timeout:g} s (the limit "
            f"for connecting and receiving the whole image).", keyword="timeout")


def _read_body(response: requests.Response, label: str, deadline: float, max_bytes: int) -> bytes:
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ImageDownloadError(
            f"Cannot load image {label}: the server announces {int(declared)} bytes, more than "
            f"max_bytes={max_bytes}. Pass a larger max_bytes if the image is really that big.",
            cli=f"Cannot load image {label}: the server announces {int(declared)} bytes, more than "
                f"the limit of {max_bytes}.", keyword="max_bytes")
    chunks: list[bytes] = []
    received = 0
    for chunk in read_chunks(response, deadline=deadline, chunk_bytes=_CHUNK_BYTES):
        received += len(chunk)
        if received > max_bytes:
            raise ImageDownloadError(
                f"Cannot load image {label}: the response is larger than max_bytes={max_bytes}; "
                f"stopped reading. Pass a larger max_bytes if the image is really that big.",
                cli=f"Cannot load image {label}: the response is larger than the limit of {max_bytes} "
                    f"bytes; stopped reading.", keyword="max_bytes")
        chunks.append(chunk)
    encoded = response.headers.get("Content-Encoding", "identity").lower() != "identity"
    if declared is not None and declared.isdigit() and not encoded and received < int(declared):
        raise ImageDownloadError(
            f"Cannot load image {label}: the connection closed after {received} of {declared} "
            f"bytes. Retry the download.")
    return b"".join(chunks)


def _blocked(label: str, error: BlockedAddressError) -> ImageDownloadError:
    first = "" if describe_input(error.url) == label else f" (redirected to {describe_input(error.url)})"
    problem = (f"Cannot load image {label}{first}: its host resolves to {error.address}, a loopback, private or "
               f"link-local address")
    return ImageDownloadError(f"{problem}, refused because allow_private=False. Leave it out if you trust the URL.",
                              cli=f"{problem}, refused because of {PRIVATE_URLS_OPTION}. Leave it out if you trust "
                                  "the URL.",
                              keyword="allow_private")


def download(url: str, *, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
             allow_private: bool = True) -> bytes:
    """Download an image's bytes over http(s) with a total deadline and a size cap.

    Redirects are followed by hand (:func:`convnets.urls.open_url`): at most
    :data:`~convnets.constants.MAX_REDIRECTS`, to http(s) URLs only, without reading their bodies,
    all within the one ``timeout``.

    Args:
        url: an ``http://`` or ``https://`` URL.
        timeout: seconds for the whole download (connecting, every redirect, headers and body).
        max_bytes: largest accepted body, in bytes (after content decoding); redirect bodies are
            never read.
        allow_private: fetch from hosts that resolve to loopback, private or link-local addresses
            (``localhost``, ``10.x``, ``192.168.x``, ``169.254.x``, ``::1``, ...), as upstream and
            every download tool do (default). ``False`` refuses such a URL, or a redirect to one:
            use it for URLs that come from someone else (a server's clients). The addresses are
            then checked before connecting (:func:`convnets.urls.check_public`, which says what that
            does not catch).

    Returns:
        The response body.

    Raises:
        ImageDownloadError: unsupported scheme, invalid URL, a private address without
            ``allow_private``, too many redirects or one to another scheme, connection error,
            HTTP 4xx/5xx, non-image content type, timeout, body over ``max_bytes`` or cut short.
    """
    label = describe_input(url)
    scheme = url_scheme(url)
    if scheme not in ("http", "https"):
        hint = " Pass the local path instead." if scheme == "file" else (
            " Download it yourself and pass the path or the bytes.")
        raise ImageDownloadError(
            f"Cannot load image {label}: unsupported URL scheme {scheme!r}; only http and https "
            f"URLs are downloaded.{hint}")
    # simple_host accepts intranet names such as http://my-nas/; strict_query=False accepts
    # queries like "?raw" or "?a=1&b" that CDNs use.
    if not validators.url(url, simple_host=True, strict_query=False):
        raise ImageDownloadError(f"Cannot load image {label}: not a valid http(s) URL.")
    start = time.monotonic()
    deadline = start + timeout
    try:
        # Each hop gets the time left until the deadline (connect + response headers); the body
        # is bounded by the same deadline in _read_body.
        with open_url(url, deadline=deadline, allow_private=allow_private, max_redirects=MAX_REDIRECTS,
                      headers={"User-Agent": USER_AGENT, "Accept": "image/*,*/*;q=0.8"}) as resp:
            resp.raise_for_status()
            content_type = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if content_type.startswith(_NON_IMAGE_TYPES):
                raise ImageDownloadError(
                    f"Cannot load image {label}: the server sent {content_type!r} content, not an "
                    f"image (an error or web page?). Use the direct address of the image file.")
            body = _read_body(resp, label, deadline, max_bytes)
    except ImageLoadError:
        raise
    except BlockedAddressError as exc:
        raise _blocked(label, exc) from exc
    except RedirectError as exc:
        raise ImageDownloadError(f"Cannot load image {label}: {exc}.") from exc
    except requests.HTTPError as exc:
        response = exc.response
        status = f"{response.status_code} {response.reason}" if response is not None else str(exc)
        raise ImageDownloadError(
            f"Cannot load image {label}: the server answered HTTP {status}. Check the URL."
        ) from exc
    except (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError) as exc:
        raise _timed_out(label, timeout) from exc
    except (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError) as exc:
        raise ImageDownloadError(
            f"Cannot load image {label}: the connection was closed or broken before the whole "
            f"image arrived ({exc}). Retry the download.") from exc
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise ImageDownloadError(
            f"Cannot load image {label}: the download failed ({type(exc).__name__}: {exc}). "
            f"Check the URL and your network connection.") from exc
    logger.debug("downloaded %s: %d bytes in %.2f s", label, len(body), time.monotonic() - start)
    return body


def open_path(path: str | os.PathLike[str], label: str, read: Callable[[BinaryIO], _T]) -> _T:
    """``read`` applied to the opened regular file ``path``; every failure to open or read it is an ImageLoadError."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer forever; opened this way it
        # returns at once and is refused below (for regular files the flag changes nothing).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as fp:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageLoadError(f"Cannot load image {label}: it is not a regular file (a pipe, socket or "
                                     f"device). Pass image files.")
            os.set_blocking(fd, True)
            if os.fstat(fp.fileno()).st_size == 0:
                raise ImageDecodeError(f"Cannot load image {label}: the file is empty (0 bytes).")
            return read(fp)
    except FileNotFoundError as exc:
        raise ImageNotFoundError(
            f"Cannot load image {label}: no such file (working directory: {os.getcwd()!r}). Check "
            f"the path, or pass an http(s) URL.") from exc
    except IsADirectoryError as exc:
        raise ImageLoadError(
            f"Cannot load image {label}: it is a directory, not an image file. Pass the image "
            f"files it contains.") from exc
    except ImageLoadError:
        raise
    except OSError as exc:  # permission denied, I/O error: reading the file itself failed
        raise ImageLoadError(f"Cannot load image {label}: cannot read the file ({exc}).") from exc


def read_input(source: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
               allow_private: bool = True) -> bytes:
    """The encoded bytes of a local path or an ``http(s)://`` URL, undecoded (the device path decodes them).

    Reading fails exactly as :func:`~convnets.preprocessing.decode.open_image` does for the same input (missing file, directory, pipe,
    empty file, download errors).

    Args:
        source: a local path or an http(s) URL.
        timeout, max_bytes, allow_private: as for :func:`~convnets.preprocessing.decode.open_image`.

    Returns:
        The file's (or the response's) bytes, never empty.

    Raises:
        ImageNotFoundError, ImageDownloadError, ImageDecodeError, ImageLoadError: as :func:`~convnets.preprocessing.decode.open_image`.
    """
    label = describe_input(source)
    if isinstance(source, str) and is_url(source):
        data = download(source, timeout=timeout, max_bytes=max_bytes, allow_private=allow_private)
        if not data:
            raise ImageDownloadError(f"Cannot load image {label}: the server sent an empty body.")
        return data
    if os.fspath(source) == "":
        raise ImageNotFoundError("Cannot load image '': the path is empty.")
    return open_path(Path(source), label, lambda fp: fp.read())
