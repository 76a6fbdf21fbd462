"""Bad input raises one documented exception that names the input and the reason, and fast.

Network cases run against a real HTTP server on 127.0.0.1 (``processing_support.http_server``), so they
pass ``allow_private=True``, the default (as upstream: loopback URLs are fetched).
"""

from __future__ import annotations

import io
import socket
import time
from pathlib import Path

import pytest
from PIL import Image, ImageFile
from processing_support import encode, http_server, photo, png_declaring_size  # noqa: F401

from processing_utils import (
    ImageDecodeError,
    ImageDownloadError,
    ImageLoadError,
    ImageNotFoundError,
    prepare_input_from_uri,
)


def _jpeg() -> bytes:
    with Image.open(photo("chelsea.png")) as img:
        return encode(img.convert("RGB"), "JPEG", quality=90)


def _raises(source: object, error: type[Exception], *reasons: str, **options: object) -> str:
    """Assert ``source`` raises ``error`` naming the input and every reason; return the message."""
    with pytest.raises(error) as caught:
        prepare_input_from_uri(source, **options)
    message = str(caught.value)
    assert isinstance(caught.value, ImageLoadError)
    for reason in reasons:
        assert reason in message, f"{reason!r} not in {message!r}"
    return message


# ---- local files and bytes -------------------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "no-such-cat.jpg"
    _raises(path, ImageNotFoundError, "no-such-cat.jpg", "no such file")
    with pytest.raises(FileNotFoundError):  # also what existing callers catch
        prepare_input_from_uri(str(path))


def test_directory(tmp_path: Path) -> None:
    folder = tmp_path / "holiday-photos"
    folder.mkdir()
    message = _raises(str(folder), ImageLoadError, "holiday-photos", "directory")
    assert "ImageNotFoundError" not in message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    _raises(path, ImageDecodeError, "empty.jpg", "empty")


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.jpg"
    path.write_text("these are not pixels\n" * 20)
    _raises(path, ImageDecodeError, "notes.jpg", "not a recognised image")


def test_truncated_jpeg_is_an_error(tmp_path: Path) -> None:
    data = _jpeg()
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[: len(data) // 2])
    _raises(path, ImageDecodeError, "cut.jpg", "truncated")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncated_png(tmp_path: Path) -> None:
    with Image.open(photo("chelsea.png")) as img:
        data = encode(img, "PNG")
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) // 3])
    _raises(path, ImageDecodeError, "cut.png", "corrupt or truncated")


def test_decompression_bomb_over_pillow_limit(tmp_path: Path) -> None:
    path = tmp_path / "bomb.png"
    path.write_bytes(png_declaring_size(20000, 20000))
    assert path.stat().st_size < 1000
    _raises(path, ImageDecodeError, "bomb.png", "decompression bomb")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_under_pillow_error_limit(tmp_path: Path) -> None:
    # 144M pixels: Pillow only warns (between MAX_IMAGE_PIXELS and twice that); we refuse.
    path = tmp_path / "big.png"
    path.write_bytes(png_declaring_size(12000, 12000))
    _raises(path, ImageDecodeError, "big.png", "12000x12000", "decompression bomb")


def test_max_pixels_option(tmp_path: Path) -> None:
    path = photo("chelsea.png")  # 451x300 = 135300 pixels
    _raises(path, ImageDecodeError, "chelsea.png", "451x300", "135300", max_pixels=100_000)
    assert prepare_input_from_uri(path, max_pixels=135_300).shape == (1, 3, 224, 224)


def test_pillow_globals_unchanged() -> None:
    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    with pytest.raises(ImageDecodeError):
        prepare_input_from_uri(png_declaring_size(20000, 20000))
    prepare_input_from_uri(photo("chelsea.png"), max_pixels=10**9)
    assert (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES) == before


def test_bytes_that_are_not_an_image() -> None:
    _raises(b"<html>nope</html>", ImageDecodeError, "17 bytes", "not a recognised image")
    _raises(b"", ImageDecodeError, "0 bytes", "empty")


def test_truncated_pil_image_input() -> None:
    data = _jpeg()
    lazy = Image.open(io.BytesIO(data[: len(data) // 2]))  # opened, not yet decoded
    _raises(lazy, ImageDecodeError, "PIL image", "truncated")


def test_mode_without_rgb_conversion() -> None:
    _raises(Image.new("La", (32, 32)), ImageDecodeError, "mode La", "cannot convert mode 'La'")


def test_unsupported_input_type() -> None:
    with pytest.raises(TypeError, match="int"):
        prepare_input_from_uri(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["ftp://example.com/cat.jpg", "file:///tmp/cat.jpg",
                                 "s3://bucket/cat.jpg"])
def test_unsupported_scheme(url: str) -> None:
    _raises(url, ImageDownloadError, url, "unsupported URL scheme")


def test_invalid_http_url() -> None:
    _raises("http://exa mple.com/cat.jpg", ImageDownloadError, "exa mple", "not a valid")


def test_long_inputs_are_abbreviated_in_messages() -> None:
    url = "ftp://example.com/" + "a" * 3000 + "/the-cat.jpg"
    message = _raises(url, ImageDownloadError, "ftp://example.com/", "the-cat.jpg")
    assert len(message) < 500
    _raises(b"\x00" * 100_000, ImageDecodeError, "100000 bytes")


# ---- downloads ---------------------------------------------------------------------------------

def test_http_404(http_server: str) -> None:
    url = f"{http_server}/missing.jpg"
    _raises(url, ImageDownloadError, url, "HTTP 404", allow_private=True)


def test_http_500(http_server: str) -> None:
    url = f"{http_server}/broken.jpg"
    _raises(url, ImageDownloadError, url, "HTTP 500", allow_private=True)


def test_html_page_with_status_200(http_server: str) -> None:
    url = f"{http_server}/page.html"
    _raises(url, ImageDownloadError, url, "text/html", "not an image", allow_private=True)


@pytest.mark.parametrize(("route", "options", "reason", "within"), [
    # No answer at all until long after the timeout.
    ("slow.png", {"timeout": 0.5}, "did not finish within timeout=0.5 s", 10.0),
    # One byte every 50 ms never trips a per-read timeout of 0.5 s, and the whole image would
    # take minutes: only a total deadline stops it.
    ("drip.png", {"timeout": 0.5}, "did not finish within timeout=0.5 s", 10.0),
    # Bytes flow for 4 s, then stop: a fresh per-read timeout would end the call at ~5 s.
    ("stall.png", {"timeout": 1.0}, "did not finish within timeout=1 s", 3.0),
    # Zeros forever, as fast as they can be read.
    ("endless.png", {"max_bytes": 2**20}, "larger than max_bytes=1048576", 5.0),
])
def test_misbehaving_server_is_cut_off(http_server: str, route: str, options: dict[str, float],
                                       reason: str, within: float) -> None:
    url = f"{http_server}/{route}"
    start = time.monotonic()
    _raises(url, ImageDownloadError, url, reason, allow_private=True, **options)
    assert time.monotonic() - start < within


def test_announced_size_over_cap_fails_before_reading(http_server: str) -> None:
    url = f"{http_server}/huge.png"
    _raises(url, ImageDownloadError, url, "1000000000000 bytes", "max_bytes", allow_private=True)


def test_connection_closed_early(http_server: str) -> None:
    url = f"{http_server}/truncated.png"
    _raises(url, ImageDownloadError, url, "closed", allow_private=True)


def test_connection_refused() -> None:
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/cat.jpg"
    _raises(url, ImageDownloadError, url, "download failed", allow_private=True)
