"""The endpoints clients reach: small HTTP and gRPC proxies in front of Triton's own, which are unix sockets.

Triton 2.51 (the one PyTriton 0.7 ships) has no limit of its own on what it parses: one HTTP request
with ``Content-Type: application/x-www-form-urlencoded`` and a body of 4 MiB, or a JSON body nested
100,000 levels deep, crashes it, and it reads any body whole (a 1 GiB request kept gigabytes).
Triton itself listens on unix sockets only, in a directory only this user can enter (see
:mod:`convnets.serve.server`): no other user of the machine reaches it around the fronts. The fronts
check every request before Triton sees it:

* HTTP (:class:`HttpFront`, also in front of the metrics port): a body needs a ``Content-Length``
  (no chunked transfer) of at most ``max_body_bytes``, else ``413`` before a byte of it is read; no
  compressed bodies (a small gzip body can inflate to gigabytes in Triton); the content type is
  JSON, ``application/octet-stream`` or none; the JSON part (all of it, or the first
  ``Inference-Header-Content-Length`` bytes of a binary request) is nested at most
  :data:`MAX_JSON_DEPTH` levels. Then the request goes to Triton unchanged and its answer back.
  While Triton does not answer (it is restarting), clients get ``503``, readiness included.
* metrics: the same front, which also moves the requests the model refused
  (:data:`~convnets.serve.backend.REFUSED_METRIC`) from Triton's ``nv_inference_request_success`` to
  its ``nv_inference_request_failure{reason="BACKEND"}`` (:func:`count_refusals_as_failures`).
* gRPC (:class:`GrpcFront`): every method is passed on as bytes; messages above ``max_body_bytes``
  are refused by gRPC itself (``RESOURCE_EXHAUSTED``) from their length prefix.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "GrpcFront", "HttpFront", "UnixHTTPConnection", "count_refusals_as_failures",
           "json_too_deep"]

log = logging.getLogger(__name__)

#: The deepest JSON nesting passed on (a KServe v2 request needs about 4 + the tensor's rank).
MAX_JSON_DEPTH = 32
#: Content types passed on (without parameters); a form type makes Triton parse the body as a form.
_CONTENT_TYPES = ("", "application/json", "application/octet-stream")
# Headers that belong to one connection, never passed on.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
               "content-length"}
# A JSON string, also one left open at the end (matching it never fails, so the scan stays linear).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"\[\]|\{\}")
# A remaining time longer than this (a year) means the gRPC client set no deadline.
_NO_DEADLINE_S = 365 * 86400.0
# How much of a refused body is read and dropped before closing, so that the client reads the answer.
_DRAIN_BYTES = 1 << 20


def json_too_deep(text: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays and objects more than ``limit`` levels (or leaves one unclosed).

    Linear in the text for each level: strings are dropped, then each pass removes the innermost level.
    """
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = _INNERMOST.sub(b"", brackets)
    return bool(brackets)


_SAMPLE = re.compile(r'^(?P<name>\w+)\{(?P<labels>[^}]*)\} (?P<value>\d+)$', re.M)
_MODEL_VERSION = re.compile(r'model="(?P<model>(?:[^"\\]|\\.)*)".*version="(?P<version>(?:[^"\\]|\\.)*)"')


def count_refusals_as_failures(text: str) -> str:
    """Triton's Prometheus ``text`` with each model's refused requests (the backend's
    :data:`~convnets.serve.backend.REFUSED_METRIC`) counted as failures (reason ``BACKEND``), not successes."""
    from convnets.serve.backend import REFUSED_METRIC

    refused: dict[tuple[str, str], int] = {}
    for sample in _SAMPLE.finditer(text):
        key = _MODEL_VERSION.search(sample["labels"])
        if sample["name"] == REFUSED_METRIC and key:
            refused[(key["model"], key["version"])] = int(sample["value"])

    def corrected(sample: re.Match[str]) -> str:
        key = _MODEL_VERSION.search(sample["labels"])
        count = refused.get((key["model"], key["version"]), 0) if key else 0
        if sample["name"] == "nv_inference_request_success":
            count = -count
        elif not (sample["name"] == "nv_inference_request_failure" and 'reason="BACKEND"' in sample["labels"]):
            count = 0
        return f'{sample["name"]}{{{sample["labels"]}}} {int(sample["value"]) + count}' if count else sample[0]
    return _SAMPLE.sub(corrected, text) if refused else text


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to the server listening on the unix socket ``path`` (Triton's own endpoints)."""

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


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    """One client connection: each request checked, then passed to Triton on one connection of its own."""

    protocol_version = "HTTP/1.1"
    server: HttpFront
    #: Seconds a client may stay silent (reading a request, or between requests) before it is dropped.
    timeout = 120
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 (the base class's naming)
        self._pass_on()

    do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = do_GET  # noqa: N815

    def _pass_on(self) -> None:
        try:
            body = self._checked_body()
        except _Refused as refused:
            self._answer(refused.status, str(refused))
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            status, reason, answer_headers, answer = self._forward(headers, body)
        except OSError:
            self._answer(503, "the model server is not answering (it is restarting); try again in a few seconds")
            return
        if self.server.metrics and status == 200 and self.path.split("?")[0] == "/metrics":
            answer = count_refusals_as_failures(answer.decode("utf-8", errors="replace")).encode()
        self.send_response_only(status, reason)
        for key, value in answer_headers:
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer)

    def _forward(self, headers: dict[str, str], body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """The request to Triton, once more on a new connection if the kept one was closed meanwhile."""
        for attempt in (0, 1):
            if self._upstream is None:
                self._upstream = UnixHTTPConnection(self.server.target, timeout=600)
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                response = self._upstream.getresponse()
                return response.status, response.reason, response.getheaders(), response.read()
            except (OSError, http.client.HTTPException) as e:
                self._upstream.close()
                self._upstream = None
                if attempt or not isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                                 ConnectionResetError)):
                    raise OSError(str(e)) from e
        raise AssertionError("unreachable")

    def _checked_body(self) -> bytes:
        """The request's body, read only once its headers pass; :class:`_Refused` says why not."""
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(411, "send the body with a Content-Length (chunked transfer is not accepted)")
        if self.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
            raise _Refused(415, "compressed request bodies are not accepted; send the body uncompressed")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise _Refused(400, "Content-Length is not a number") from None
        if length < 0:
            raise _Refused(400, "Content-Length is negative")
        if length > self.server.max_body_bytes:
            self._drop_body(length)
            raise _Refused(413, f"the request body ({length} bytes) is larger than the server's limit of "
                                f"{self.server.max_body_bytes} bytes")
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type not in _CONTENT_TYPES:
            self._drop_body(length)
            raise _Refused(415, f"Content-Type {content_type!r} is not accepted: send application/json (with "
                                "binary tensor data after the JSON header, as tritonclient does), or no type")
        body = self.rfile.read(length) if length else b""
        if len(body) < length:
            self.close_connection = True
            raise _Refused(400, f"the body ended after {len(body)} of its {length} bytes")
        header = self.headers.get("Inference-Header-Content-Length")
        json_part = body
        if header is not None:
            if not header.strip().isdigit() or int(header) > length:
                raise _Refused(400, f"Inference-Header-Content-Length {header!r} is not a length within the body")
            json_part = body[:int(header)]
        if json_too_deep(json_part):
            raise _Refused(400, f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep, or not closed")
        return body

    def _drop_body(self, length: int) -> None:
        """Read a little of a refused body (so the client sees the answer), then end the connection."""
        self.close_connection = True
        self.connection.settimeout(1)
        try:
            self.rfile.read(min(length, _DRAIN_BYTES))
        except OSError:
            pass

    def _answer(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def finish(self) -> None:
        super().finish()
        if self._upstream is not None:
            self._upstream.close()


class HttpFront(ThreadingHTTPServer):
    """An HTTP proxy on ``address`` that checks each request (see the module doc) and passes it to
    the HTTP server on the unix socket ``target``; :meth:`start` serves it on a thread of its own. With ``metrics``, Triton's
    ``/metrics`` text counts refused requests as failures.

    Raises:
        OSError: the address cannot be bound.
    """

    daemon_threads = True
    allow_reuse_address = True  # Triton binds with SO_REUSEADDR too: a port in TIME_WAIT is usable
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], target: str, max_body_bytes: int, *,
                 metrics: bool = False) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.target = target
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="convnets-http-front", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()


class GrpcFront:
    """A gRPC proxy on ``host:port`` that passes every method to the gRPC server on the unix socket ``target``
    as bytes, refusing
    messages larger than ``max_message_bytes``.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, target: str, max_message_bytes: int) -> None:
        # Triton is started by fork: gRPC's fork handlers are not needed there (and would log each time).
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        import grpc

        self._channel = grpc.insecure_channel(f"unix:{target}", options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        self._server = grpc.server(ThreadPoolExecutor(max_workers=32, thread_name_prefix="convnets-grpc-front"),
                                   handlers=[_GrpcPassOn(self._channel)], options=[
                                       ("grpc.max_receive_message_length", max_message_bytes),
                                       ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from e
        if not bound:
            raise OSError(f"cannot listen on {address}")

    def start(self) -> None:
        """Serve (gRPC's own threads)."""
        self._server.start()

    def stop(self) -> None:
        """Stop serving (calls in flight get a second) and close the channel to Triton."""
        self._server.stop(grace=1).wait()
        self._channel.close()


def _grpc_pass_on_handler(channel: Any, method: str, streaming: bool) -> Any:
    import grpc

    def metadata(context: Any) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in context.invocation_metadata() if not k.startswith(":") and k != "user-agent"]

    def timeout(context: Any) -> float | None:
        # The client's deadline; without one gRPC reports a remaining time too large to pass on.
        remaining: float | None = context.time_remaining()
        return remaining if remaining is not None and remaining < _NO_DEADLINE_S else None

    def unary(request: bytes, context: Any) -> bytes:
        try:
            response: bytes = channel.unary_unary(method)(request, metadata=metadata(context),
                                                          timeout=timeout(context))
            return response
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")  # raises
            raise

    def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        try:
            yield from channel.stream_stream(method)(requests, metadata=metadata(context),
                                                     timeout=timeout(context))
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")

    return grpc.stream_stream_rpc_method_handler(stream) if streaming else grpc.unary_unary_rpc_method_handler(unary)


class _GrpcPassOn:
    """A generic gRPC handler: any method, its messages as bytes (KServe v2's one streaming method streamed)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel

    def service(self, details: Any) -> Any:
        method: str = details.method
        return _grpc_pass_on_handler(self._channel, method, streaming=method.endswith("/ModelStreamInfer"))
