"""Downloads against hostile servers: redirects (endless bodies, slow chains, too many, other schemes),
loopback and private addresses, and the weights download's overall deadline and size cap.

Every server is a real HTTP server on 127.0.0.1 started here. Loopback and private addresses are
fetched by default, as upstream; the tests of the refusal pass ``allow_private=False`` /
``--deny-private-urls``, and every test that names a private address other than loopback refuses
it, so that no packet leaves this machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, cli_in_process, command_lines, randomize_bn

import convnets
import processing_utils
from convnets import urls
from convnets.errors import ImageDownloadError, WeightsUnavailableError
from convnets.preprocessing.decode import open_image
from convnets.preprocessing.io import download
from convnets.weights import download as weights_download
from convnets.weights.manifest import load_manifest

SE = "se_resnext101_32x4d"
IMAGE = (REPO / "examples" / "coffee.png").read_bytes()
HOP_DELAY_S = 1.5
ENDLESS_LIMIT_S = 20.0  # every endless route stops after this, even if the client never hangs up


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stopping: threading.Event
    sent: Counter  # path -> body bytes written


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _redirect(self, location: str, status: int = 302) -> None:
        self.send_response(status)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _endless(self, status: int, headers: dict[str, str]) -> None:
        """Zeros as fast as the client reads them (no Content-Length), counted in ``sent``."""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        zeros = bytes(64 * 1024)
        started = time.monotonic()
        while time.monotonic() - started < ENDLESS_LIMIT_S and not self.server.stopping.is_set():
            self.wfile.write(zeros)
            self.server.sent[self.path] += len(zeros)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path
        try:
            if path == "/image.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(IMAGE)))
                self.end_headers()
                self.wfile.write(IMAGE)
            elif path == "/redir-endless":  # a redirect whose own body never ends
                self._endless(302, {"Location": "/image.png", "Content-Type": "image/png"})
            elif path == "/redir-endless-to-endless":  # the same, to an image that never ends either
                self._endless(302, {"Location": "/w/endless", "Content-Type": "image/png"})
            elif path.startswith("/hop/"):  # /hop/N: 1.5 s of silence, then a redirect to /hop/N+1
                hop = int(path.split("/")[2])
                if not self.server.stopping.wait(HOP_DELAY_S):
                    self._redirect(f"/hop/{hop + 1}" if hop < 10 else "/image.png")
            elif path.startswith("/chain/"):  # /chain/N: N redirects before the image
                left = int(path.split("/")[2])
                self._redirect(f"/chain/{left - 1}" if left > 1 else "/image.png", 301 if left % 2 else 307)
            elif path == "/to-file":
                self._redirect("file:///etc/passwd")
            elif path == "/to-ftp":
                self._redirect("ftp://127.0.0.1/image.png")
            elif path.startswith("/to-localhost/"):  # /to-localhost/PORT: to this server, named localhost
                self._redirect(f"http://localhost:{path.split('/')[2]}/image.png")
            elif path == "/w/endless":  # weights that never end
                self._endless(200, {"Content-Type": "application/octet-stream"})
            elif path == "/w/drip":  # weights at 1 KiB per 50 ms, no length
                self.send_response(200)
                self.end_headers()
                while not self.server.stopping.wait(0.05):
                    self.wfile.write(bytes(1024))
                    self.wfile.flush()
            elif path == "/w/huge":  # announces more than any cap
                self.send_response(200)
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, _Server]]:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("NO_PROXY", "no_proxy"):
            patch.setenv(name, "127.0.0.1,localhost")
        httpd = _Server(("127.0.0.1", 0), _Handler)
        httpd.stopping, httpd.sent = threading.Event(), Counter()
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
        finally:
            httpd.stopping.set()
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)


# ---- redirects ---------------------------------------------------------------------------------

_MEMORY_PROBE = textwrap.dedent("""
    import resource, sys, time
    from convnets.errors import ImageDownloadError
    from convnets.preprocessing.io import download

    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = size + int(1.5 * 2**30)  # 1.5 GB over what the interpreter holds now
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = time.monotonic()
    try:
        download(sys.argv[1], timeout=2, allow_private=True)
    except ImageDownloadError as e:
        print(f"{time.monotonic() - start:.2f}", str(e).replace(chr(10), " "))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
@pytest.mark.parametrize("route", ["/redir-endless", "/redir-endless-to-endless"])
def test_redirect_with_an_endless_body_is_not_read(server, route: str) -> None:
    """requests reads a redirect's body into memory before anyone can stop it: ours is never read.

    In a process allowed 1.5 GB more than it holds: reading the body would end in MemoryError.
    """
    base, httpd = server
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, f"{base}{route}"], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    if route == "/redir-endless":  # the redirect leads to the image: the download succeeds, nothing printed
        assert done.stdout == ""
    else:  # the image never ends: one error line, at the size cap (64 MiB) or the 2 s timeout
        (line,) = done.stdout.splitlines()
        elapsed, message = line.split(" ", 1)
        assert float(elapsed) < 2 + 3 and f"{base}{route}" in message
        assert "max_bytes=" in message or "within timeout=2 s" in message
    # Socket buffers hold a few MiB at most: the redirect's body was not read on.
    assert httpd.sent[route] < 64 * 2**20


def test_ten_slow_hops_end_at_the_one_deadline(server) -> None:
    base, _ = server
    start = time.monotonic()
    with pytest.raises(ImageDownloadError, match=r"did not finish within timeout=2 s") as caught:
        download(f"{base}/hop/1", timeout=2, allow_private=True)
    elapsed = time.monotonic() - start
    assert elapsed < 8.0, f"{elapsed:.1f} s: the timeout was applied per hop"  # per hop: 15 s
    assert "\n" not in str(caught.value) and f"{base}/hop/1" in str(caught.value)


def test_five_redirects_are_followed_and_a_sixth_is_refused(server) -> None:
    base, _ = server
    assert download(f"{base}/chain/5", allow_private=True) == IMAGE
    with pytest.raises(ImageDownloadError, match=r"more than 5 redirects") as caught:
        download(f"{base}/chain/6", allow_private=True)
    assert f"{base}/chain/6" in str(caught.value) and f"{base}/image.png" in str(caught.value)


@pytest.mark.parametrize("route, scheme", [("/to-file", "file:///etc/passwd"), ("/to-ftp", "ftp://")])
def test_redirect_to_another_scheme_is_refused(server, route: str, scheme: str) -> None:
    base, _ = server
    with pytest.raises(ImageDownloadError, match="only redirects to http and https") as caught:
        open_image(f"{base}{route}", allow_private=True)
    assert scheme in str(caught.value) and f"{base}{route}" in str(caught.value)


# ---- private addresses -------------------------------------------------------------------------

def test_loopback_is_fetched_by_default_as_upstream_and_refused_on_request(server, tmp_path: Path) -> None:
    base, httpd = server
    url = f"{base}/image.png"
    # Upstream's call on a local URL (a Jupyter server's /files/, an intranet image server) works.
    local = tmp_path / "image.png"
    local.write_bytes(IMAGE)
    torch.testing.assert_close(processing_utils.prepare_input_from_uri(url),
                               processing_utils.prepare_input_from_uri(str(local)), rtol=0, atol=0)
    with pytest.raises(ImageDownloadError) as caught:
        processing_utils.prepare_input_from_uri(url, allow_private=False)
    message = str(caught.value)
    assert url in message and "127.0.0.1" in message and "allow_private=False" in message
    assert "--deny-private-urls" not in message and caught.value.keyword == "allow_private"
    assert "--deny-private-urls" in caught.value.message_for("cli")


@pytest.mark.parametrize("url", ["http://10.1.2.3/a.png", "http://192.168.0.7/a.png", "http://169.254.169.254/x",
                                 "http://[::1]/a.png", "http://[fe80::1]/a.png", "http://[::ffff:127.0.0.1]/a.png",
                                 "http://0.0.0.0/a.png"])
def test_private_and_link_local_addresses_are_refused(url: str) -> None:
    with pytest.raises(urls.BlockedAddressError):
        urls.check_public(url)
    with pytest.raises(ImageDownloadError, match="loopback, private or link-local"):
        download(url, timeout=1, allow_private=False)


def test_every_resolved_address_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name with a public and a private address (IPv4 or IPv6) is refused."""
    monkeypatch.setattr(urls, "_addresses", lambda host, port: ["93.184.215.14", "fd00::5"])
    with pytest.raises(urls.BlockedAddressError, match="fd00::5"):
        urls.check_public("http://both.example/a.png")


def test_a_redirect_to_a_private_address_is_refused(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first URL passes the check (its name resolves to a public address here), its redirect to
    localhost does not: every hop's target is checked."""
    base, httpd = server
    port = httpd.server_address[1]
    real = urls._addresses
    # The first hop: pretend that 127.0.0.1 is public (only for the check; the connection is real).
    monkeypatch.setattr(urls, "_addresses", lambda host, port: ["93.184.215.14"] if host == "127.0.0.1"
                        else real(host, port))
    with pytest.raises(ImageDownloadError) as caught:
        download(f"{base}/to-localhost/{port}", allow_private=False)
    message = str(caught.value)
    assert f"http://localhost:{port}/image.png" in message and "allow_private=False" in message
    assert "127.0.0.1" in message or "::1" in message


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, num_classes=3, **TINY[SE]))
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["a", "b", "c"], "epoch": 1}, path)
    return path


def test_cli_fetches_loopback_and_refuses_it_with_the_option(server, tiny_checkpoint: Path) -> None:
    base, _ = server
    url = f"{base}/image.png"
    done = cli_in_process("predict", "--weights", str(tiny_checkpoint), "--json", "--topk", "1", url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["input"] == url
    done = cli_in_process("predict", "--weights", str(tiny_checkpoint), "--json", "--topk", "1", "--deny-private-urls",
                          url)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    first = command_lines(done.stderr)[0]
    assert url in first and "127.0.0.1" in first and "--deny-private-urls" in first
    assert "allow_private" not in first


# ---- weights: deadline, cap, redirects ---------------------------------------------------------

def _entry(url: str, **changes: object):
    return dataclasses.replace(load_manifest()[SE], url=url, file_name="tiny.pth.tar", **changes)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_weights_download_stops_at_the_size_cap(server, isolated_cache: Path) -> None:
    base, _ = server
    entry = _entry(f"{base}/w/endless", size_bytes=3 * 2**20)  # the cap is the recorded size
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError) as caught:
        weights_download.fetch_weights(entry, progress=False)
    message = str(caught.value)
    assert f"{base}/w/endless" in message and f"limit of {3 * 2**20} bytes" in message and "\n" not in message
    assert time.monotonic() - start < 10 and _leftovers(isolated_cache) == []


def test_weights_cap_without_a_recorded_size_is_a_multiple_of_the_parameters(server, isolated_cache: Path) -> None:
    base, _ = server
    entry = _entry(f"{base}/w/huge")
    assert weights_download.size_cap(entry) >= 4 * 4 * entry.num_params  # room for EMA and optimizer state
    with pytest.raises(WeightsUnavailableError, match=f"announces {10**12} bytes, more than the limit of "
                                                      f"{weights_download.size_cap(entry)}"):
        weights_download.fetch_weights(entry, progress=False)
    assert _leftovers(isolated_cache) == []


def test_weights_download_stops_at_its_deadline(server, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = server
    monkeypatch.setattr(weights_download, "DOWNLOAD_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError) as caught:
        weights_download.fetch_weights(_entry(f"{base}/w/drip"), progress=False)
    message = str(caught.value)
    assert f"{base}/w/drip" in message and "did not finish within 1 s" in message and "\n" not in message
    assert time.monotonic() - start < 8 and _leftovers(isolated_cache) == []  # the drip goes on for minutes


def test_weights_redirects_follow_the_same_rules(server, isolated_cache: Path) -> None:
    base, httpd = server
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError, match="did not finish within 2 s"):
        weights_download.fetch_weights(_entry(f"{base}/hop/1"), progress=False, timeout=2)
    assert time.monotonic() - start < 8.0  # per hop: 15 s
    with pytest.raises(WeightsUnavailableError, match="more than 5 redirects"):
        weights_download.fetch_weights(_entry(f"{base}/chain/6"), progress=False)
    with pytest.raises(WeightsUnavailableError, match="only redirects to http and https"):
        weights_download.fetch_weights(_entry(f"{base}/to-file"), progress=False)
    assert _leftovers(isolated_cache) == []
    # Loopback mirrors are fine for weights; the redirect's endless body is not read.
    before = httpd.sent["/redir-endless"]
    path = weights_download.fetch_weights(_entry(f"{base}/redir-endless"), progress=False)
    assert path.read_bytes() == IMAGE and httpd.sent["/redir-endless"] - before < 64 * 2**20
