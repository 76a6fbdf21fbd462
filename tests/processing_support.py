"""Shared helpers for the processing_utils tests: real photos, the upstream reference transform,
and a real HTTP server on 127.0.0.1 that misbehaves on request.

Imported by the ``test_processing_*`` modules (pytest puts this directory on ``sys.path``).
"""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
# The upstream transform, spelled as upstream spells it.
UPSTREAM = transforms.Compose([
    transforms.Resize(256),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=MEAN, std=STD),
])


def _package_dir(name: str) -> Path:
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (pip install -e .[test])")
    return Path(list(spec.submodule_search_locations)[0])


def photo(name: str) -> Path:
    """Path of a real photo shipped with scikit-image (``skimage/data``) or scikit-learn."""
    for path in (_package_dir("skimage") / "data" / name,
                 _package_dir("sklearn") / "datasets" / "images" / name):
        if path.is_file():
            return path
    pytest.skip(f"sample photo {name} is not installed")


def reference(image: Image.Image) -> torch.Tensor:
    """Upstream's Compose on an RGB image: the independent expected value ``[3, 224, 224]``."""
    assert image.mode == "RGB", "the reference takes RGB images only"
    return UPSTREAM(image)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def png_declaring_size(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height`` 1-bit pixels (a decompression bomb)."""
    data = bytearray(encode(Image.new("1", (8, 8)), "PNG"))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    body = bytes(data[ihdr:ihdr + 17])  # chunk type + 13 bytes of IHDR data
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(body))
    return bytes(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # never wait for a handler still streaming at shutdown
    stopping: threading.Event
    image: bytes
    barriers: dict[str, threading.Barrier]
    barriers_lock: threading.Lock


MAX_STREAM_SECONDS = 20.0  # bound on every endless route, even if the client never hangs up


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _headers(self, status: int, content_type: str, length: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; False when it is."""
        return not self.server.stopping.wait(seconds)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        route = self.path.split("?")[0]
        image = self.server.image
        started = time.monotonic()
        try:
            if route == "/image.png":
                self._headers(200, "image/png", len(image))
                self.wfile.write(image)
            elif route == "/image.bin":  # some servers do not label images properly
                self._headers(200, "application/octet-stream", len(image))
                self.wfile.write(image)
            elif route.startswith("/delay/"):  # /delay/<milliseconds>/...
                if self._wait(int(route.split("/")[2]) / 1000):
                    self._headers(200, "image/png", len(image))
                    self.wfile.write(image)
            elif route.startswith("/together/"):  # /together/<name>/<n>/...: answered once n requests wait at once
                name, count = route.split("/")[2:4]
                with self.server.barriers_lock:
                    barrier = self.server.barriers.setdefault(name, threading.Barrier(int(count)))
                try:
                    barrier.wait(MAX_STREAM_SECONDS)
                except threading.BrokenBarrierError:  # fewer came together: a client that fetches one at a time
                    self.send_error(504)
                else:
                    self._headers(200, "image/png", len(image))
                    self.wfile.write(image)
            elif route == "/page.html":
                page = b"<!doctype html><html><body>Please log in</body></html>"
                self._headers(200, "text/html; charset=utf-8", len(page))
                self.wfile.write(page)
            elif route == "/missing.jpg":
                self.send_error(404)
            elif route == "/broken.jpg":
                self.send_error(500)
            elif route == "/slow.png":  # no answer at all until long after any small timeout
                if self._wait(MAX_STREAM_SECONDS):
                    self._headers(200, "image/png", len(image))
                    self.wfile.write(image)
            elif route == "/drip.png":  # headers at once, then one byte every 50 ms
                self._headers(200, "image/png", None)
                for byte in image:
                    if time.monotonic() - started > MAX_STREAM_SECONDS or not self._wait(0.05):
                        break
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
            elif route == "/stall.png":  # 80 bytes over 4 s, then silence
                self._headers(200, "image/png", len(image))
                for byte in image[:80]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    if not self._wait(0.05):
                        break
                self._wait(MAX_STREAM_SECONDS)
            elif route == "/endless.png":  # zeros as fast as the client reads them
                self._headers(200, "image/png", None)
                zeros = bytes(64 * 1024)
                while time.monotonic() - started < MAX_STREAM_SECONDS and not self.server.stopping.is_set():
                    self.wfile.write(zeros)
            elif route == "/huge.png":  # announces far more than any cap, sends nothing
                self._headers(200, "image/png", 10**12)
            elif route == "/truncated.png":  # announces the whole image, sends half, hangs up
                self._headers(200, "image/png", len(image))
                self.wfile.write(image[: len(image) // 2])
                self.close_connection = True
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as the size cap and the deadline make it do


@pytest.fixture(scope="session")
def http_server() -> Iterator[str]:
    """Base URL (``http://127.0.0.1:PORT``) of a server whose routes serve ``small_png()``."""
    with pytest.MonkeyPatch.context() as patch:
        # Requests honours proxy variables; the test traffic must stay on this machine.
        for name in ("NO_PROXY", "no_proxy"):
            patch.setenv(name, "127.0.0.1,localhost")
        server = _Server(("127.0.0.1", 0), _Handler)
        server.stopping = threading.Event()
        server.image = small_png()
        server.barriers, server.barriers_lock = {}, threading.Lock()
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.stopping.set()
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


def small_png() -> bytes:
    """A real photo (scikit-image's cat, downscaled to 300x200) as PNG bytes."""
    with Image.open(photo("chelsea.png")) as img:
        return encode(img.convert("RGB").resize((300, 200), Image.Resampling.BILINEAR), "PNG")
