"""The endpoints clients reach: an HTTP, a metrics and a gRPC front before Triton, which listens on unix sockets only.

Triton 2.51 (the one PyTriton 0.7 ships) has no limit of its own on what it parses: a form body of
4 MiB, a JSON body nested 100,000 levels deep, or a header it reads differently from a proxy
crashes it, and it reads any body whole. So nothing a client sends reaches Triton as sent: each
front parses the request with a strict parser, checks it, and sends Triton a request of its own:

* HTTP and metrics (:mod:`convnets.serve.http_front`): httptools parses each request (HTTP/1.1, one value
  per header, a ``Content-Length`` of at most ``max_request_bytes``, no transfer or content coding,
  a JSON or octet-stream content type, JSON nested at most :data:`MAX_JSON_DEPTH` levels); Triton
  gets a new request with the front's own headers only;
* gRPC (:mod:`convnets.serve.grpc_front`): each message is parsed as the KServe protobuf its method
  takes (tritonclient's ``service_pb2``), unknown fields dropped, and sent to Triton as a new
  message, without the client's metadata (a ``ModelInfer`` as the HTTP request that asks the same:
  :mod:`convnets.serve.kserve`).

Everything is bounded, across all clients (:class:`Limits`): open connections, request bytes held
at once, the time a client may take to send a request's head and body; requests over a bound are
refused and counted in :data:`REFUSED_METRIC`, which the metrics front appends to Triton's metrics.
All fronts run on one asyncio event loop in a thread of its own (:class:`convnets.serve.fronts.Fronts`): a
held connection or stream costs no thread.
"""

from __future__ import annotations

import ctypes
import http.client
import logging
import re
import socket
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["BUSY_MESSAGE", "DEFAULT_MAX_CONNECTIONS", "HEAD_TIMEOUT_S", "IDLE_TIMEOUT_S", "MAX_JSON_DEPTH",
           "MIN_RPCS", "REFUSED_METRIC", "Limits", "UNAVAILABLE_MESSAGE", "UnixHTTPConnection", "json_too_deep",
           "return_freed_memory"]

log = logging.getLogger(__name__)

#: The deepest JSON nesting passed on (a KServe v2 request needs about 4 + the tensor's rank).
MAX_JSON_DEPTH = 32
#: Connections open at once on the HTTP and metrics fronts together, and on the gRPC front (more are closed as they
#: come).
DEFAULT_MAX_CONNECTIONS = 4096
#: The fewest gRPC calls (unary calls and streams) served at once by default; more are refused with
#: ``RESOURCE_EXHAUSTED``. gRPC reads a call's message whole before the front sees it, so the calls bound what the
#: gRPC front holds: ``max_rpcs * max_request_bytes`` (see :class:`Limits`).
MIN_RPCS = 64
#: Seconds a client may take to send a request's head from its first byte (HTTP), or to open its connection (gRPC's
#: handshake: the HTTP/2 preface and settings).
HEAD_TIMEOUT_S = 10.0
#: Seconds a connection (HTTP, metrics or gRPC) may stay idle before the front closes it.
IDLE_TIMEOUT_S = 120.0
#: What a client is told when the request bytes held for all clients are at their bound (HTTP 503, gRPC
#: RESOURCE_EXHAUSTED), and when Triton does not answer (HTTP 503, gRPC UNAVAILABLE).
BUSY_MESSAGE = "the server holds as many request bytes as it may; try again shortly"
UNAVAILABLE_MESSAGE = "the model server is not answering (it is restarting); try again in a few seconds"
#: The counter of requests the fronts refused before Triton saw them, by protocol and reason.
REFUSED_METRIC = "convnets_front_requests_refused_total"

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)  # a JSON string, also one left open (linear)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPEN_AS_ONE = bytes.maketrans(b"{}", b"[]")
_OPEN = ord("[")
_CHUNK = 1 << 20
_SMALL = 256


def json_too_deep(text: bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays and objects more than ``limit`` levels (or closes more than it opens,
    or leaves one open).

    One pass at C speed, whatever the nesting: strings dropped, the brackets kept, and their running depth
    summed by numpy in chunks of a MiB (79 MiB of ``[``, of 32-deep arrays, or of one string: 0.5-0.6 s each on
    this project's loaded 2-core machine, 2026-11-29; the old check held the GIL 41 s on the first).
    """
    brackets = _STRING.sub(b"", text).translate(_OPEN_AS_ONE, _NOT_BRACKETS)
    depth = 0
    if len(brackets) <= _SMALL:  # a KServe request's JSON: a few dozen brackets, fewer steps than numpy's calls take
        for bracket in brackets:
            depth += 1 if bracket == _OPEN else -1
            if depth > limit or depth < 0:
                return True
        return depth != 0
    import numpy as np

    steps = np.frombuffer(brackets, dtype=np.uint8)
    for start in range(0, len(steps), _CHUNK):
        levels = np.cumsum(np.where(steps[start:start + _CHUNK] == _OPEN, 1, -1), dtype=np.int64) + depth
        if levels.max() > limit or levels.min() < 0:
            return True
        depth = int(levels[-1])
    return depth != 0


def return_freed_memory() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    gRPC reads each message in pieces of its own, from the allocator's arenas: after 20 messages of 79 MiB at once, the
    front's process kept 1.5 GiB, free, until the allocator was asked to trim."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


@dataclass
class Limits:
    """What the fronts hold at once, across all clients, and the refusals so far (one event loop: no lock).

    Attributes:
        max_request_bytes: the largest HTTP body or gRPC message.
        max_bytes_in_flight: request bytes held at once by all requests together (default: 4 of the largest).
        max_connections: HTTP and metrics connections open at once.
        max_grpc_connections: gRPC connections open at once (gRPC closes more as it accepts them).
        max_rpcs: gRPC calls at once (default: :data:`MIN_RPCS`, or more where ``max_bytes_in_flight`` holds more
            of the largest messages); they bound the gRPC front's memory, as gRPC holds a message whole before
            the front can count it: ``max_rpcs * max_request_bytes`` at most.
    """

    max_request_bytes: int
    max_bytes_in_flight: int = 0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_grpc_connections: int = DEFAULT_MAX_CONNECTIONS
    max_rpcs: int = 0
    bytes_in_flight: int = 0
    connections: int = 0
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.max_bytes_in_flight = self.max_bytes_in_flight or 4 * self.max_request_bytes
        self.max_rpcs = self.max_rpcs or max(MIN_RPCS, self.max_bytes_in_flight // self.max_request_bytes)

    def take(self, size: int) -> bool:
        """Hold ``size`` request bytes if the total stays within :attr:`max_bytes_in_flight`."""
        if self.bytes_in_flight + size > self.max_bytes_in_flight:
            return False
        self.bytes_in_flight += size
        return True

    def give_back(self, size: int) -> None:
        self.bytes_in_flight -= size

    def refuse(self, protocol: str, reason: str) -> None:
        """Count a refusal (see :data:`REFUSED_METRIC`)."""
        self.refused[(protocol, reason)] += 1
        log.debug("%s request refused: %s", protocol, reason)

    def metrics(self) -> bytes:
        """The refusals in Prometheus' text format."""
        lines = [f"# HELP {REFUSED_METRIC} Requests the server's front refused before Triton saw them.",
                 f"# TYPE {REFUSED_METRIC} counter"]
        lines += [f'{REFUSED_METRIC}{{protocol="{p}",reason="{r}"}} {n}' for (p, r), n in sorted(self.refused.items())]
        return ("\n".join(lines) + "\n").encode()


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to the server listening on the unix socket ``path`` (Triton's readiness, for the supervisor)."""

    def __init__(self, path: str, *, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock
