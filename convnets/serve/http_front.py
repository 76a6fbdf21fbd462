"""The HTTP and metrics fronts: each request parsed by h11, checked, and rebuilt for Triton (see :mod:`convnets.serve.front`).

A request is refused, and never reaches Triton, when:

* h11 cannot parse it as HTTP/1.1 (``400``, or ``431`` for a head over 64 KiB), or a header comes
  twice (``400``: Triton read the last of two values where a proxy checked the first);
* it uses a method other than ``GET``, ``HEAD``, ``POST`` (``405``), or a target not starting with ``/``;
* a body comes without a ``Content-Length`` (``411``), with a content coding (``415``), above
  ``max_request_bytes`` (``413``), or with a content type other than JSON, ``application/octet-stream``
  or none (``415``);
* its ``Inference-Header-Content-Length`` is not a length within the body, or its JSON part nests
  deeper than :data:`~convnets.serve.front.MAX_JSON_DEPTH` levels (``400``);
* the bytes held for all requests would exceed :attr:`~convnets.serve.front.Limits.max_bytes_in_flight`
  (``503``), or :attr:`~convnets.serve.front.Limits.max_connections` are open (closed unanswered).

A client that takes longer than :data:`HEAD_TIMEOUT_S` to send a request's head once it started it,
longer than :data:`BODY_TIMEOUT_S` plus a second per MiB for its body, or stays silent for
:data:`~convnets.serve.front.IDLE_TIMEOUT_S` between requests, is disconnected. While Triton does not answer (it is
restarting), clients get ``503``, readiness included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any, TypeVar

import h11

from convnets.serve.front import IDLE_TIMEOUT_S, MAX_JSON_DEPTH, Limits, json_too_deep

__all__ = ["BODY_TIMEOUT_S", "HEAD_TIMEOUT_S", "HttpFront"]

log = logging.getLogger(__name__)

#: Seconds a client may take to send a request's head, from its first byte.
HEAD_TIMEOUT_S = 10.0
#: Seconds a client may take to send a body, plus one per MiB of it.
BODY_TIMEOUT_S = 30.0
#: Seconds Triton may take to answer a request.
UPSTREAM_TIMEOUT_S = 600.0
_MAX_HEAD_BYTES = 64 << 10
_READ_BYTES = 256 << 10
# How much of a refused body is read and dropped before closing, so that the client reads the answer.
_DRAIN_BYTES = 1 << 20
# A JSON part at least this long is checked on another thread.
_CHECK_INLINE_BYTES = 1 << 20
_CONTENT_TYPES = {b"": None, b"application/json": b"application/json",
                  b"application/octet-stream": b"application/octet-stream"}
# Of Triton's answer, the headers passed back (Content-Length is set anew).
_ANSWER_HEADERS = {b"content-type", b"inference-header-content-length"}
_T = TypeVar("_T")


class _Refused(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class _Gone(Exception):
    """The client closed the connection, or was too slow."""


if sys.version_info >= (3, 11):
    async def _within(deadline: float, awaitable: Awaitable[_T]) -> _T:
        async with asyncio.timeout_at(deadline):
            return await awaitable
else:  # pragma: no cover (Python 3.10)
    async def _within(deadline: float, awaitable: Awaitable[_T]) -> _T:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - asyncio.get_running_loop().time()))


class _Upstream:
    """One connection to Triton's unix socket, kept between requests; h11 reads Triton's answers."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def exchange(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                       body: bytes | bytearray) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
        """Send a request; Triton's status, reason, headers and body. Once more on a new connection if the kept one
        was closed meanwhile (Triton restarted)."""
        for attempt in (0, 1):
            fresh = self._streams is None
            try:
                return await _within(asyncio.get_running_loop().time() + UPSTREAM_TIMEOUT_S,
                                     self._exchange(method, target, headers, body))
            except (OSError, h11.ProtocolError, asyncio.IncompleteReadError, EOFError) as error:
                self.close()
                if attempt or fresh:
                    raise OSError(str(error)) from error
        raise AssertionError("unreachable")

    async def _exchange(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                        body: bytes | bytearray) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
        if self._streams is None:
            self._streams = await asyncio.open_unix_connection(self.path, limit=_READ_BYTES)
            self._h11 = h11.Connection(h11.CLIENT)
        reader, writer = self._streams
        out = self._h11.send(h11.Request(method=method, target=target, headers=headers)) or b""
        # h11 passes a bytearray body through as it is (its annotation says bytes).
        writer.writelines([out, *(self._h11.send_with_data_passthrough(h11.Data(data=body)) or []  # type: ignore[arg-type]
                                  if body else []),
                           self._h11.send(h11.EndOfMessage()) or b""])
        response: h11.Response | None = None
        chunks: list[bytes] = []
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(_READ_BYTES)
                if not data:
                    raise EOFError("Triton closed the connection")
                self._h11.receive_data(data)
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError("Triton closed the connection")
        assert response is not None
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
        else:
            self.close()
        return response.status_code, bytes(response.reason), list(response.headers), b"".join(chunks)


class _Client:
    """One client connection: its requests in turn, each checked, rebuilt and passed to Triton."""

    def __init__(self, front: HttpFront, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.front, self.limits = front, front.limits
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        self.upstream = _Upstream(front.target)
        self.loop = asyncio.get_running_loop()

    async def serve(self) -> None:
        try:
            while await self._one_request():
                self.h11.start_next_cycle()
        except _Gone:
            pass
        finally:
            self.upstream.close()
            self.writer.close()

    async def _event(self, deadline: float) -> Any:
        """h11's next event, reading until ``deadline`` (:class:`_Gone` after it, or when the client closes)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await _within(deadline, self.reader.read(_READ_BYTES))
            except (TimeoutError, asyncio.TimeoutError) as error:
                raise _Gone from error
            except OSError as error:
                raise _Gone from error
            self.h11.receive_data(data)
            if not data and self.h11.their_state is not h11.DONE:
                raise _Gone

    async def _one_request(self) -> bool:
        """Serve one request; whether the connection stays open for another."""
        # Silent up to IDLE_TIMEOUT_S; then the whole head within HEAD_TIMEOUT_S of its first byte.
        if not self.h11.trailing_data[0]:
            try:
                data = await _within(self.loop.time() + IDLE_TIMEOUT_S, self.reader.read(_READ_BYTES))
            except (TimeoutError, asyncio.TimeoutError, OSError):
                return False
            if not data:
                return False
            self.h11.receive_data(data)
        try:
            event = await self._event(self.loop.time() + HEAD_TIMEOUT_S)
        except _Gone:
            self.limits.refuse("http", "slow head")
            raise
        except h11.RemoteProtocolError as error:
            await self._refuse(_Refused(error.error_status_hint, "malformed", f"not a valid HTTP/1.1 request: {error}"),
                               0)
            return False
        if not isinstance(event, h11.Request):
            return False
        try:
            headers, length = self._checked_head(event)
        except _Refused as refused:
            declared = dict(event.headers).get(b"content-length", b"0")  # h11 checked that it is a number
            await self._refuse(refused, int(declared))
            return False
        if not self.limits.take(length):
            await self._refuse(_Refused(503, "busy", "the server holds as many request bytes as it may; try again "
                                        "shortly"), length)
            return False
        try:
            return await self._pass_on(event, headers, length)
        finally:
            self.limits.give_back(length)

    def _checked_head(self, request: h11.Request) -> tuple[list[tuple[bytes, bytes]], int]:
        """The headers Triton gets for this request, and the body's length; :class:`_Refused` says why not."""
        seen: dict[bytes, bytes] = {}
        for name, value in request.headers:
            if name in seen:
                raise _Refused(400, "repeated header", f"the header {name.decode()!r} is sent more than once; send "
                                                       "each header once")
            seen[name] = value
        if request.method not in (b"GET", b"HEAD", b"POST"):
            raise _Refused(405, "method", f"the method {request.method.decode()} is not served: use GET or POST")
        if not request.target.startswith(b"/"):
            raise _Refused(400, "target", "the request target must be a path starting with /")
        if b"transfer-encoding" in seen:
            raise _Refused(411, "chunked", "send the body with a Content-Length (chunked transfer is not accepted)")
        if seen.get(b"content-encoding", b"identity").strip().lower() != b"identity":
            raise _Refused(415, "encoding", "compressed request bodies are not accepted; send the body uncompressed")
        length = int(seen.get(b"content-length", b"0"))  # h11 checked that it is a number
        if length > self.limits.max_request_bytes:
            raise _Refused(413, "too large", f"the request body ({length} bytes) is larger than the server's limit "
                                             f"of {self.limits.max_request_bytes} bytes")
        content_type = seen.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type not in _CONTENT_TYPES:
            raise _Refused(415, "content type", f"Content-Type {content_type.decode(errors='replace')!r} is not "
                                                "accepted: send application/json (with binary tensor data after the "
                                                "JSON header, as tritonclient does), or no type")
        headers = [(b"host", b"triton"), (b"content-length", b"%d" % length)]
        if (canonical := _CONTENT_TYPES[content_type]) is not None:
            headers.append((b"content-type", canonical))
        header = seen.get(b"inference-header-content-length")
        if header is not None:
            if not header.strip().isdigit() or int(header) > length:
                raise _Refused(400, "header length", f"Inference-Header-Content-Length {header.decode()!r} is not a "
                                                     "length within the body")
            headers.append((b"inference-header-content-length", b"%d" % int(header)))
        return headers, length

    async def _pass_on(self, request: h11.Request, headers: list[tuple[bytes, bytes]], length: int) -> bool:
        if self.h11.they_are_waiting_for_100_continue:
            self.writer.write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        body = bytearray()
        deadline = self.loop.time() + BODY_TIMEOUT_S + length / (1 << 20)
        while True:
            try:
                event = await self._event(deadline)
            except _Gone:
                self.limits.refuse("http", "slow body")
                raise
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        json_part = memoryview(body)
        if (header := dict(headers).get(b"inference-header-content-length")) is not None:
            json_part = json_part[:int(header)]
        # Bodies over a MiB are checked on another thread: the numpy sums release the GIL, the loop goes on.
        deep = (json_too_deep(bytes(json_part)) if len(json_part) < _CHECK_INLINE_BYTES
                else await asyncio.to_thread(json_too_deep, bytes(json_part)))
        if json_part and deep:
            await self._refuse(_Refused(400, "json depth", f"the JSON is nested more than {MAX_JSON_DEPTH} levels "
                                                           "deep, or not closed"), 0)
            return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
        try:
            status, reason, answer_headers, answer = await self.upstream.exchange(request.method, request.target,
                                                                                  headers, body)
        except OSError:
            await self._refuse(_Refused(503, "triton unavailable", "the model server is not answering (it is "
                                        "restarting); try again in a few seconds"), 0)
            return self.h11.our_state is h11.DONE
        del body
        if self.front.metrics and status == 200 and request.target.split(b"?")[0] == b"/metrics":
            answer += self.limits.metrics()
        kept = [(k, v) for k, v in answer_headers if k.lower() in _ANSWER_HEADERS]
        await self._send(status, reason, kept, answer, head_only=request.method == b"HEAD")
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    async def _send(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: bytes, *,
                    head_only: bool = False, close: bool = False) -> None:
        headers = [*headers, (b"content-length", b"%d" % len(body))] + ([(b"connection", b"close")] if close else [])
        out = [self.h11.send(h11.Response(status_code=status, reason=reason, headers=headers)) or b""]
        if body and not head_only:
            out += self.h11.send_with_data_passthrough(h11.Data(data=body)) or []
        out.append(self.h11.send(h11.EndOfMessage()) or b"")
        self.writer.writelines(out)
        try:
            await self.writer.drain()
        except OSError as error:
            raise _Gone from error

    async def _refuse(self, refused: _Refused, length: int) -> None:
        """Answer ``refused``'s status; when its body is not read, read a little of it (so that the client reads the
        answer) and close."""
        self.limits.refuse("http", refused.reason)
        close = self.h11.their_state is not h11.DONE
        if self.h11.our_state is not h11.SEND_RESPONSE:  # h11 could not parse the request: no state to answer in
            self.writer.write(b"HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                              % (refused.status, HTTPStatus(refused.status).phrase.encode()))
            return
        await self._send(refused.status, b"", [(b"content-type", b"application/json")],
                         json.dumps({"error": str(refused)}).encode(), close=close)
        if close:
            left, deadline = min(length, _DRAIN_BYTES), self.loop.time() + 1
            try:
                while left > 0 and (data := await _within(deadline, self.reader.read(left))):
                    left -= len(data)
            except (TimeoutError, asyncio.TimeoutError, OSError):
                pass
            raise _Gone


class HttpFront:
    """The HTTP front on the listening socket ``sock``, passing checked requests to Triton's HTTP server on the unix
    socket ``target``. With ``metrics``, Triton's ``/metrics`` gets the fronts' refusals appended."""

    def __init__(self, sock: socket.socket, target: str, limits: Limits, *, metrics: bool = False) -> None:
        self.sock, self.target, self.limits, self.metrics = sock, target, limits, metrics
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connected, sock=self.sock, limit=_READ_BYTES)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.limits.connections >= self.limits.max_connections:
            self.limits.refuse("http", "connections")
            writer.transport.abort()
            return
        self.limits.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            await _Client(self, reader, writer).serve()
        except Exception:  # noqa: BLE001 (one connection's failure is logged; the front goes on)
            log.exception("the HTTP front failed on one connection")
            writer.transport.abort()
        finally:
            self.limits.connections -= 1
            self._clients.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)
            self._server = None
