"""The HTTP and metrics fronts: each request parsed by httptools, checked, and rebuilt for Triton (see
:mod:`convnets.serve.front`).

httptools is the parser under uvicorn: llhttp, Node.js's strict HTTP/1.1 parser, in C. A request is
refused, and never reaches Triton, when:

* llhttp cannot parse it as HTTP/1.1 or 1.0 (``400``: a bare LF, a space before a colon, a folded
  header, a ``Content-Length`` twice or beside ``Transfer-Encoding``, ...), its head is over 64 KiB
  (``431``), it asks for another version (``505``) or an upgrade (``400``), or a header comes twice
  (``400``: Triton read the last of two values where a proxy checked the first);
* it uses a method other than ``GET``, ``HEAD``, ``POST`` (``405``), or a target not starting with ``/``;
* a body comes without a ``Content-Length`` (``411``), with a content coding (``415``), above
  ``max_request_bytes`` (``413``), or with a content type other than JSON, ``application/octet-stream``
  or none (``415``);
* its ``Inference-Header-Content-Length`` is not a length within the body, or its JSON part nests
  deeper than :data:`~convnets.serve.front.MAX_JSON_DEPTH` levels (``400``);
* the bytes held for all requests would exceed :attr:`~convnets.serve.front.Limits.max_bytes_in_flight`
  (``503``), or :attr:`~convnets.serve.front.Limits.max_connections` are open (closed unanswered).

Triton gets a request written here from the checked values: the method (``GET`` for a ``HEAD``), the
target, the body, and the front's own ``Host``, ``Content-Length``, ``Content-Type`` and
``Inference-Header-Content-Length``; of its answer the client gets the status, those two headers and
the body. A client that takes longer than :data:`HEAD_TIMEOUT_S` to send a request's head once it
started it, longer than :data:`BODY_TIMEOUT_S` plus a second per MiB for its body, or stays silent for
:data:`~convnets.serve.front.IDLE_TIMEOUT_S` between requests, is disconnected. While Triton does not
answer (it is restarting), clients get ``503``, readiness included.

Each connection is an :class:`asyncio.Protocol` whose parser callbacks do the checks; its requests are
answered in turn through callbacks, with no task or future per request (the front's cost at one client is the
Python it runs per request: the task took 0.17 ms of the 0.56 ms it added, in random order against Triton's socket,
2026-11-29). The front answers readiness at three times the rate that h11 on asyncio streams did
(``benchmarks/bench_serve.py``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

import httptools

from convnets.serve.front import (BUSY_MESSAGE, HEAD_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_JSON_DEPTH, UNAVAILABLE_MESSAGE,
                                  Limits, json_too_deep)
from convnets.serve.upstream import Outcome, Upstream, request_head

__all__ = ["BODY_TIMEOUT_S", "HEAD_TIMEOUT_S", "HttpFront"]

log = logging.getLogger(__name__)

#: Seconds a client may take to send a body, plus one per MiB of it.
BODY_TIMEOUT_S = 30.0
_MAX_HEAD_BYTES = 64 << 10
# How much of a refused body is read and dropped before closing, so that the client reads the answer.
_DRAIN_BYTES = 1 << 20
# A JSON part at least this long is checked on another thread.
_CHECK_INLINE_BYTES = 1 << 20
_METHODS = (b"GET", b"HEAD", b"POST")
_CONTENT_TYPES = {b"": None, b"application/json": b"application/json",
                  b"application/octet-stream": b"application/octet-stream"}
# Of Triton's answer, the headers passed back (Content-Length is set anew).
_ANSWER_HEADERS = (b"content-type", b"inference-header-content-length")


class _Refused(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass
class _Request:
    """A request as checked: what Triton gets (``head``, ``body``), and what the front must remember of it."""

    method: bytes
    target: bytes
    head: bytes  # the request line and headers written for Triton
    length: int
    json_length: int
    keep_alive: bool
    body: bytearray = field(default_factory=bytearray)  # Content-Length bytes, made at once (one mmap for a large one)
    received: int = 0
    held: bool = False  # its length is counted in Limits.bytes_in_flight
    refused: _Refused | None = None  # answered with this, after the requests before it
    expects_continue: bool = False  # Expect: 100-continue (curl, for a body over a MiB)


_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}


def _response(status: int, headers: list[tuple[bytes, bytes]], body: bytes, *, close: bool,
              head_only: bool = False) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _PHRASES.get(status, b"")), *(b"%s: %s" % header for header in headers),
             b"content-length: %d" % len(body)] + ([b"connection: close"] if close else [])
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head_only else body)


class _Client(asyncio.Protocol):
    """One client connection: llhttp's callbacks check each request as it arrives; each is sent to Triton once the
    one before it is answered and written.

    States: ``idle`` (between requests), ``head`` and ``body`` (receiving one), ``drain`` (a refused body is read
    and dropped before closing). One timer at a time bounds the state: idle, head, body or drain."""

    def __init__(self, front: HttpFront) -> None:
        self.front, self.limits = front, front.limits
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.upstream = Upstream(front.target)
        self.transport: asyncio.Transport | None = None
        self.state = "idle"
        self.head_bytes = self.head_parsed = 0
        self.head_began = False  # a request's head began in the data being parsed
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.receiving: _Request | None = None
        self.pending: collections.deque[_Request] = collections.deque()
        self.answering = False  # requests are being answered (the first of pending, in turn)
        self.in_flight = False  # the first is with Triton, or its JSON being checked on a thread
        self.paused = False  # the client reads slower than it gets answers: the next waits
        self.timer: asyncio.TimerHandle | None = None
        self.drain_left = 0

    # --- the connection ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        if self.limits.connections >= self.limits.max_connections:
            self.limits.refuse("http", "connections")
            self.state = "refused"
            self.transport.abort()
            return
        self.limits.connections += 1
        self.front.clients.add(self)
        self._arm_for_state()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state == "refused":
            return
        self.state, self.transport = "closed", None
        self.limits.connections -= 1
        self.front.clients.discard(self)
        self._disarm()
        for request in (*self.pending, *([self.receiving] if self.receiving else [])):
            self._release(request)
        self.upstream.close()  # an answer still to come is dropped

    def eof_received(self) -> bool:
        """The client closed its side: answer what it sent, then close (or close now, with nothing to answer)."""
        self.state = "closing"
        self._disarm()
        return self.answering

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.answering and not self.in_flight:
            self._guarded(self._answer_pending)

    def data_received(self, data: bytes) -> None:
        if self.state == "drain":
            self.drain_left -= len(data)
            if self.drain_left <= 0:
                self._drained()
            return
        if self.state in ("closing", "closed"):
            return
        self.head_began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            if not isinstance(error.__context__, _Refused):
                raise
            self._refuse(error.__context__)
        except httptools.HttpParserError as error:
            self._refuse(_Refused(400, "malformed", f"not a valid HTTP/1.1 request: {error}"))
        else:
            # A head begun in earlier data: all of this data is its (httptools holds an unfinished header line, which
            # no callback counts). One begun in this data is counted from the next on, and by its parts as they
            # complete: the requests sent ahead of it in this data are not its.
            if self.state == "head" and not self.head_began:
                self.head_bytes += len(data)
                if self.head_bytes > _MAX_HEAD_BYTES:
                    self._refuse(_Refused(431, "malformed", f"the request head is over {_MAX_HEAD_BYTES >> 10} KiB"))
        if self.pending and not self.answering:  # once llhttp is done with the data: answering may close
            self._answer_pending()

    def close(self) -> None:
        self.state = "closing"
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    # --- timers ---

    def _arm(self, seconds: float, refusal: str | None) -> None:
        """One timer for the state: after ``seconds`` the connection is closed (a refusal counted if ``refusal``)."""
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._expired, refusal)

    def _arm_for_state(self) -> None:
        """The timer of the state the connection is in: idle, a request's head or its body."""
        if self.state == "idle":
            self._arm(IDLE_TIMEOUT_S, None)
        elif self.state == "head":
            self._arm(HEAD_TIMEOUT_S, "slow head")
        elif self.state == "body":
            assert self.receiving is not None
            self._arm(BODY_TIMEOUT_S + self.receiving.length / (1 << 20), "slow body")

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self, refusal: str | None) -> None:
        self.timer = None
        if refusal is not None:
            self.limits.refuse("http", refusal)
        self._drained() if self.state == "drain" else self.close()

    # --- llhttp's callbacks: the request as it arrives ---

    def on_message_begin(self) -> None:
        self.state, self.head_bytes, self.head_parsed, self.target, self.headers = "head", 0, 0, b"", []
        self.head_began = True
        if not self.pending:  # else the timer is armed when the requests before it are answered
            self._arm_for_state()

    def on_url(self, url: bytes) -> None:
        self.target += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        """Count the head's bytes as llhttp parses them (data_received counts those of a head not yet complete)."""
        self.head_parsed += size
        if self.head_parsed > _MAX_HEAD_BYTES:
            raise _Refused(431, "malformed", f"the request head is over {_MAX_HEAD_BYTES >> 10} KiB")

    def on_headers_complete(self) -> None:
        request = self._checked(self.parser.get_method(), self.headers)
        if not self.limits.take(request.length):
            raise _Refused(503, "busy", BUSY_MESSAGE)
        request.held, request.body = True, bytearray(request.length)
        self.receiving, self.state = request, "body"
        if not self.pending:
            self._arm_for_state()
        if request.expects_continue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self.receiving
        assert request is not None
        request.body[request.received:request.received + len(body)] = body  # llhttp keeps to the Content-Length
        request.received += len(body)

    def on_message_complete(self) -> None:
        request, self.receiving, self.state = self.receiving, None, "idle"
        assert request is not None
        self.pending.append(request)
        self._disarm()
        if len(self.pending) > 1 and self.transport is not None:
            self.transport.pause_reading()  # a client sending ahead: the rest is read once these are answered

    def _checked(self, method: bytes, received: list[tuple[bytes, bytes]]) -> _Request:
        """The request Triton gets; :class:`_Refused` says why not."""
        seen: dict[bytes, bytes] = {}
        for name, value in received:
            if name in seen:
                raise _Refused(400, "repeated header", f"the header {name.decode()!r} is sent more than once; send "
                                                       "each header once")
            seen[name] = value
        if self.parser.get_http_version() not in ("1.1", "1.0"):
            raise _Refused(505, "malformed", "only HTTP/1.1 and HTTP/1.0 are served")
        if self.parser.should_upgrade():
            raise _Refused(400, "upgrade", "protocol upgrades are not served")
        if method not in _METHODS:
            raise _Refused(405, "method", f"the method {method.decode()} is not served: use GET or POST")
        if not self.target.startswith(b"/"):
            raise _Refused(400, "target", "the request target must be a path starting with /")
        if b"transfer-encoding" in seen:
            raise _Refused(411, "chunked", "send the body with a Content-Length (chunked transfer is not accepted)")
        if seen.get(b"content-encoding", b"identity").strip().lower() != b"identity":
            raise _Refused(415, "encoding", "compressed request bodies are not accepted; send the body uncompressed")
        length = int(seen.get(b"content-length", b"0"))  # llhttp checked that it is a number
        if length > self.limits.max_request_bytes:
            raise _Refused(413, "too large", f"the request body ({length} bytes) is larger than the server's limit "
                                             f"of {self.limits.max_request_bytes} bytes")
        content_type = seen.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type not in _CONTENT_TYPES:
            raise _Refused(415, "content type", f"Content-Type {content_type.decode(errors='replace')!r} is not "
                                                "accepted: send application/json (with binary tensor data after the "
                                                "JSON header, as tritonclient does), or no type")
        json_length = None
        if (header := seen.get(b"inference-header-content-length")) is not None:
            if not header.strip().isdigit() or int(header) > length:
                raise _Refused(400, "header length", f"Inference-Header-Content-Length {header.decode()!r} is not a "
                                                     "length within the body")
            json_length = int(header)
        head = request_head(b"GET" if method == b"HEAD" else method, self.target, length, _CONTENT_TYPES[content_type],
                            json_length)
        return _Request(method, self.target, head, length, length if json_length is None else json_length,
                        self.parser.should_keep_alive(),
                        expects_continue=seen.get(b"expect", b"").lower() == b"100-continue")

    # --- answers ---

    def _answer_pending(self) -> None:
        """Answer the requests received, in turn (Triton's answers come to :meth:`_answered`); then read on, or close
        (a request asked to, the client closed its side, or a request was refused unread)."""
        self.answering = True
        while self.pending and not self.in_flight and not self.paused:
            request = self.pending[0]
            keep_open = self._answer(request)
            if keep_open is None or not self._done(request, keep_open):
                return
        if self.pending or self.in_flight or self.paused:  # resume_writing goes on
            return
        self.answering = False
        if self.state == "closing":
            self.close()
        elif self.state in ("idle", "head", "body"):
            self._arm_for_state()
            assert self.transport is not None
            self.transport.resume_reading()

    def _done(self, request: _Request, keep_open: bool) -> bool:
        """``request`` is answered: whether the next may be (else the connection is closed)."""
        self._release(request)
        self.pending.popleft()
        if keep_open and self.transport is not None:
            return True
        self.answering = False
        self.close()
        return False

    def _answer(self, request: _Request) -> bool | None:
        """Answer ``request`` now (whether the connection stays open), or check its JSON on another thread and pass it
        to Triton (``None``: :meth:`_answered` goes on)."""
        if request.refused is not None:
            self._write_refusal(request.refused, close=True)
            return False
        json_part = memoryview(request.body)[:request.json_length]  # not copied: nothing writes the body meanwhile
        if len(json_part) < _CHECK_INLINE_BYTES:
            return self._pass_on(request, bool(json_part) and json_too_deep(json_part))
        # Bodies over a MiB are checked on another thread: the numpy sums release the GIL, the loop goes on.
        self.in_flight = True
        checked = self.loop.run_in_executor(None, json_too_deep, json_part, MAX_JSON_DEPTH)
        checked.add_done_callback(lambda deep: self._guarded(self._json_checked, request, deep))
        return None

    def _json_checked(self, request: _Request, checked: asyncio.Future[bool]) -> None:
        """``request``'s JSON part is checked on its thread: pass it on (or refuse it), then answer the next."""
        self.in_flight = False
        if self.transport is not None and (keep_open := self._pass_on(request, checked.result())) is not None:
            if self._done(request, keep_open):
                self._answer_pending()

    def _pass_on(self, request: _Request, deep: bool) -> bool | None:
        """Refuse ``request`` for a JSON part too deep (whether the connection stays open), or send it to Triton."""
        if deep:
            self._write_refusal(_Refused(400, "json depth", f"the JSON is nested more than {MAX_JSON_DEPTH} levels "
                                                            "deep, or not closed"), close=not request.keep_alive)
            return request.keep_alive
        self.in_flight = True
        self.upstream.send([request.head, request.body],
                           lambda outcome: self._guarded(self._answered, request, outcome))
        return None

    def _answered(self, request: _Request, outcome: Outcome) -> None:
        """Write Triton's answer to ``request`` (a 503 if it gave none); then answer the next."""
        self.in_flight = False
        if self.transport is None:  # the client left: its requests are released
            return
        request.body = bytearray()
        if isinstance(outcome, OSError):
            self._write_refusal(_Refused(503, "triton unavailable", UNAVAILABLE_MESSAGE), close=not request.keep_alive)
        else:
            status, headers, answer = outcome
            if self.front.metrics and status == 200 and request.target.split(b"?")[0] == b"/metrics":
                answer += self.limits.metrics()
            kept = [(name, value) for name, value in headers if name in _ANSWER_HEADERS]
            self.transport.write(_response(status, kept, answer, close=not request.keep_alive,
                                           head_only=request.method == b"HEAD"))
        if self._done(request, request.keep_alive):
            self._answer_pending()

    def _guarded(self, step: Callable[..., None], *args: object) -> None:
        """``step(*args)``, a step of answering that a callback of the event loop's starts (Triton's answer, the JSON
        checked on a thread, writing resumed): an error of the front's own in it (a bug) closes the connection, which
        would otherwise wait for an answer for as long as the client does, and goes on to the event loop's log. (An
        error in ``data_received`` closes it already: the event loop does.)"""
        try:
            step(*args)
        except BaseException:
            self.close()
            raise

    def _write_refusal(self, refused: _Refused, *, close: bool) -> None:
        self.limits.refuse("http", refused.reason)
        if self.transport is not None:
            self.transport.write(_response(refused.status, [(b"content-type", b"application/json")],
                                           json.dumps({"error": str(refused)}).encode(), close=close))

    def _refuse(self, refused: _Refused) -> None:
        """Answer ``refused`` while a request is being received (after the answers to the requests before it), read
        and drop a little of its body (so that the client reads the answer), and close."""
        if self.receiving is not None:
            left = self.receiving.length - self.receiving.received
            self._release(self.receiving)
            self.receiving = None
        else:  # refused from its head, or not parsed: what it announced, if llhttp read that (at most a MiB is read)
            announced = dict(self.headers).get(b"content-length", b"")
            left = int(announced) if announced.isdigit() else 0
        if self.pending:
            self.pending.append(_Request(b"", b"", b"", 0, 0, False, refused=refused))
        else:
            self._write_refusal(refused, close=True)
        self.state, self.drain_left = "drain", min(left, _DRAIN_BYTES)
        if self.drain_left <= 0:
            self._drained()
        else:
            self._arm(1.0, None)

    def _drained(self) -> None:
        """A refused request's body is read as far as it is going to be: close, once the answers are written."""
        self._disarm()
        if self.pending:  # closed once they are answered
            if self.transport is not None:
                self.transport.pause_reading()
            self.state = "closing"
        else:
            self.close()

    def _release(self, request: _Request) -> None:
        if request.held:
            request.held = False
            self.limits.give_back(request.length)


class HttpFront:
    """The HTTP front on the listening socket ``sock``, passing checked requests to Triton's HTTP server on the unix
    socket ``target``. With ``metrics``, Triton's ``/metrics`` gets the fronts' refusals appended."""

    def __init__(self, sock: socket.socket, target: str, limits: Limits, *, metrics: bool = False) -> None:
        self.sock, self.target, self.limits, self.metrics = sock, target, limits, metrics
        self._server: asyncio.AbstractServer | None = None
        self.clients: set[_Client] = set()

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_server(lambda: _Client(self), sock=self.sock)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for client in list(self.clients):
                if client.transport is not None:
                    client.transport.abort()
            await asyncio.sleep(0)  # their connection_lost runs
            self._server = None
