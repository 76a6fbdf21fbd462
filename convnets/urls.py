"""The one way convnets fetches an http(s) URL: redirects by hand, one deadline, addresses checked.

Both downloaders use it: images (:func:`convnets.preprocessing.io.download`) and pretrained weights
(:mod:`convnets.weights.download`). ``requests`` alone is unsafe for untrusted URLs in three ways,
each fixed here:

* it reads the whole body of every redirect response into memory before the caller sees
  anything (even with ``allow_redirects=False``: ``Session.send`` still builds ``Response.next``,
  which consumes the body), so a redirect whose body never ends exhausts memory whatever the
  caller's timeout and size cap. :func:`open_url` follows redirects itself and closes each
  redirect response without reading a byte of its body;
* its timeout applies per request, so a chain of redirects multiplies it: here one deadline
  covers the whole chain, each hop getting only the time that is left;
* it follows up to 30 redirects, to any host. Here at most :data:`~convnets.constants.MAX_REDIRECTS`
  hops, to ``http``/``https`` only, and (if the caller asks) never to a loopback, private or
  link-local address (:func:`check_public`).

Redirect bodies are never read, so the byte budget of a fetch is the final body's alone
(:func:`read_chunks` callers count it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3

from convnets.constants import MAX_REDIRECTS

__all__ = ["BlockedAddressError", "RedirectError", "check_public", "open_url", "read_chunks", "set_read_timeout"]

_SCHEMES = ("http", "https")


class RedirectError(Exception):
    """A redirect that is not followed (too many, or to a scheme other than http/https); ``str``: why."""


class BlockedAddressError(Exception):
    """A URL whose host resolves to a loopback, private or link-local address, which is not allowed.

    Attributes:
        url: the URL (the first one, or a redirect's target).
        address: the refused address.
    """

    def __init__(self, url: str, address: str) -> None:
        super().__init__(f"{url!r} resolves to {address}, a loopback, private or link-local address")
        self.url = url
        self.address = address


def _refused(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 reaches 127.0.0.1
    return ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified  # 0.0.0.0: this host


def check_public(url: str) -> None:
    """Refuse ``url`` if its host resolves to any loopback, private or link-local address.

    Every address ``socket.getaddrinfo`` returns (IPv4 and IPv6) is checked, and one refused
    address refuses the URL. The check runs before connecting, and the connection resolves the
    name again: a DNS server that answers differently the second time (DNS rebinding) is not
    caught. It keeps honest mistakes and simple server-side request forgery out, not a
    determined attacker who controls a DNS server; run untrusted URLs where the network itself
    is isolated for that.

    Raises:
        BlockedAddressError: the host (or a literal address in the URL) is not public.
        requests.ConnectionError: the host name cannot be resolved.
    """
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return  # no host: the request fails on its own with a clear error
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        port = 80  # an invalid port: let the request report it
    try:
        addresses = _addresses(host, port)
    except (socket.gaierror, UnicodeError) as e:
        raise requests.ConnectionError(f"cannot resolve the host {host!r} ({e})") from e
    for address in addresses:
        if _refused(address):
            raise BlockedAddressError(url, address)


def _addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6), as strings."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


class _NoRedirectSession(requests.Session):
    """A session that never looks for a redirect target, so no redirect body is ever read."""

    def get_redirect_target(self, resp: requests.Response) -> None:
        return None


@contextlib.contextmanager
def open_url(url: str, *, deadline: float, headers: Mapping[str, str], allow_private: bool,
             max_redirects: int = MAX_REDIRECTS, connect_timeout: float | None = None,
             read_timeout: float | None = None) -> Iterator[requests.Response]:
    """GET ``url``, following redirects by hand; yield the final response with its body unread.

    Args:
        url: an ``http(s)://`` URL (the caller checks the first one's scheme).
        deadline: ``time.monotonic()`` value by which every hop must have answered; the body's
            reading is the caller's (:func:`read_chunks` takes the same deadline).
        headers: request headers, sent on every hop.
        allow_private: also connect to loopback, private and link-local addresses; else every
            hop's host is checked with :func:`check_public` first.
        max_redirects: redirects followed at most; one more is an error.
        connect_timeout, read_timeout: caps on each connection attempt and each socket read
            (within the deadline); ``None``: only the deadline.

    Yields:
        The final, non-redirect response (any status); closed on leaving the block.

    Raises:
        TimeoutError: the deadline passed between hops.
        RedirectError: more than ``max_redirects`` redirects, or one to another scheme.
        BlockedAddressError: a hop's host is not public and ``allow_private`` is false.
        requests.RequestException: what ``requests`` raises (timeouts, connection errors).
    """
    with _NoRedirectSession() as session:
        hops = 0
        while True:
            if not allow_private:
                check_public(url)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the deadline passed before {url!r} was requested")
            timeout = urllib3.Timeout(total=remaining, connect=connect_timeout, read=read_timeout)
            # requests hands a urllib3 Timeout to urllib3 as it is (HTTPAdapter.send); its annotation
            # of `timeout` lists only floats and tuples.
            response = session.get(url, stream=True, allow_redirects=False, headers=dict(headers),
                                   timeout=timeout)  # type: ignore[arg-type]
            location = response.headers.get("Location") if response.is_redirect else None
            if location is None:
                break
            response.close()  # closes the connection without reading the redirect's body
            hops += 1
            target = urljoin(response.url, location)
            if hops > max_redirects:
                raise RedirectError(f"more than {max_redirects} redirects (the last one to {target!r}); "
                                    f"at most {max_redirects} are followed")
            scheme = urlsplit(target).scheme.lower()
            if scheme not in _SCHEMES:
                raise RedirectError(f"redirected to {target!r}; only redirects to http and https URLs "
                                    "are followed")
            url = target
        with response:
            yield response


def set_read_timeout(response: requests.Response, seconds: float) -> None:
    """Bound the next socket read so that one stalled read cannot overrun the total deadline.

    ``requests`` only has a per-read timeout, set once on the socket; shortening it before each
    read makes the deadline exact. Best effort: urllib3 2 exposes the socket on the connection,
    except for close-delimited bodies, where only http.client's response still holds it. Where
    neither is found the deadline is checked between reads, so a stalled read may overrun it
    by up to the request's read timeout.
    """
    raw: Any = response.raw
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    if sock is None:
        buffered = getattr(getattr(raw, "_fp", None), "fp", None)
        sock = getattr(getattr(buffered, "raw", None), "_sock", None)
    if isinstance(sock, socket.socket):
        sock.settimeout(max(seconds, 0.001))


def read_chunks(response: requests.Response, *, deadline: float, chunk_bytes: int,
                max_silence: float | None = None) -> Iterator[bytes]:
    """The (content-decoded) body of ``response`` in chunks, each read bounded by ``deadline``.

    ``read1`` returns after a single network read, so a server that drips bytes slowly is still
    stopped at the deadline; ``read`` would block until a whole chunk had arrived.

    Args:
        response: a streamed response whose body is unread.
        deadline: ``time.monotonic()`` value by which the whole body must have arrived.
        chunk_bytes: the most bytes one read returns.
        max_silence: the longest a single read may wait (within the deadline); ``None``: the deadline.

    Raises:
        TimeoutError: the deadline passed between reads.
        urllib3.exceptions.HTTPError: what urllib3 raises (``ReadTimeoutError`` when a read waited
            past the deadline or ``max_silence``, ``ProtocolError`` for a broken connection).
    """
    read = getattr(response.raw, "read1", response.raw.read)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed")
        set_read_timeout(response, remaining if max_silence is None else min(remaining, max_silence))
        chunk = read(chunk_bytes, decode_content=True)
        if not chunk:
            return
        yield chunk
