"""The fronts' connections to Triton's HTTP server on its unix socket: requests written by the HTTP front
(:mod:`convnets.serve.http_front`) and for gRPC's ``ModelInfer`` (:mod:`convnets.serve.kserve`), answers read by
httptools."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import cast

import httptools

__all__ = ["UPSTREAM_TIMEOUT_S", "Outcome", "Upstream", "request_head"]

#: Seconds Triton may take to answer a request.
UPSTREAM_TIMEOUT_S = 600.0


def request_head(method: bytes, target: bytes, length: int, content_type: bytes | None = None,
                 json_length: int | None = None) -> bytes:
    """The head of a request the front writes for Triton: its request line, and only the front's own headers (``Host``,
    ``Content-Length``, and ``Content-Type`` and ``Inference-Header-Content-Length`` where given)."""
    lines = [b"%s %s HTTP/1.1" % (method, target), b"host: triton", b"content-length: %d" % length]
    if content_type is not None:
        lines.append(b"content-type: " + content_type)
    if json_length is not None:
        lines.append(b"inference-header-content-length: %d" % json_length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


#: What a request's ``done`` callback gets: Triton's status, headers and body, or the error that kept it from answering
#: (:class:`OSError`; :class:`TimeoutError` after :data:`UPSTREAM_TIMEOUT_S`).
Outcome = tuple[int, list[tuple[bytes, bytes]], bytes] | OSError
_Read = tuple[int, list[tuple[bytes, bytes]], bytes, bool] | OSError  # with whether Triton keeps the connection open


class _Answer(asyncio.Protocol):
    """One kept connection to Triton's unix socket; httptools reads its answers (status, headers, body), each handed to
    the callback of the request it answers."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: Callable[[_Read], None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def ask(self, data: Sequence[bytes | bytearray], done: Callable[[_Read], None]) -> None:
        """Write the request ``data``; ``done`` gets the answer (and whether the connection stays open) or an error."""
        assert self.transport is not None
        self.headers, self.body, self.done = [], [], done  # llhttp starts the next answer by itself
        self.transport.writelines(data)  # first: the timer is not on the request's way
        self.timer = self.loop.call_later(UPSTREAM_TIMEOUT_S, self._late)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._finish(ConnectionResetError("Triton closed the connection"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:  # the front's own code failed answering: the event loop logs it
            raise
        except httptools.HttpParserError as error:
            self._finish(OSError(f"Triton's answer did not parse: {error}"))
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self._finish((self.parser.get_status_code(), self.headers, b"".join(self.body), self.parser.should_keep_alive()))

    def _late(self) -> None:
        self.timer = None
        self._finish(TimeoutError(f"Triton did not answer within {UPSTREAM_TIMEOUT_S:.0f} s"))

    def _finish(self, outcome: _Read) -> None:
        """Hand ``outcome`` to the request waiting for it, if one is."""
        if (done := self._forget()) is not None:
            done(outcome)

    def _forget(self) -> Callable[[_Read], None] | None:
        """The waiting request's callback, no longer waited for (its timer cancelled)."""
        done, self.done = self.done, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return done

    def close(self) -> None:
        """Close the connection; the request waiting for an answer, if any, gets none."""
        self._forget()
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Upstream:
    """A connection of the front's to Triton, made when first needed and again after Triton closed it: one request at a
    time, answered through callbacks (:meth:`send`, for the HTTP front: no task or future per request) or awaited
    (:meth:`exchange`, for the gRPC front)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._answer: _Answer | None = None
        self._connecting: asyncio.Task[None] | None = None

    def close(self) -> None:
        """Close the connection; a request waiting for its answer gets none (it must not be read as the next one's)."""
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._answer is not None:
            self._answer.close()
            self._answer = None

    def send(self, data: Sequence[bytes | bytearray], done: Callable[[Outcome], None], *, retry: bool = True) -> None:
        """Send the request ``data``; ``done`` gets the outcome. Once more on a new connection if the kept one was
        closed meanwhile (Triton restarted); not after a timeout (Triton took the request)."""
        answer = self._answer
        if answer is None or answer.transport is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect_and_send(data, done))
        else:
            answer.ask(data, lambda outcome: self._answered(outcome, data, done, retry))

    async def _connect_and_send(self, data: Sequence[bytes | bytearray], done: Callable[[Outcome], None]) -> None:
        try:
            _, answer = await asyncio.get_running_loop().create_unix_connection(_Answer, self.path)
        except OSError as error:
            done(error)
            return
        finally:
            if self._connecting is asyncio.current_task():
                self._connecting = None
        self._answer = answer
        answer.ask(data, lambda outcome: self._answered(outcome, data, done, False))

    def _answered(self, outcome: _Read, data: Sequence[bytes | bytearray], done: Callable[[Outcome], None],
                  retry: bool) -> None:
        if isinstance(outcome, OSError):
            self.close()
            if retry and not isinstance(outcome, TimeoutError):
                self.send(data, done, retry=False)
            else:
                done(outcome)
            return
        status, headers, body, keep_alive = outcome
        if not keep_alive:
            self.close()
        done((status, headers, body))

    async def exchange(self, data: Sequence[bytes | bytearray]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """:meth:`send`, awaited: Triton's status, headers and body.

        Raises:
            OSError: Triton did not answer (:class:`TimeoutError` within :data:`UPSTREAM_TIMEOUT_S`).
        """
        waiter: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] = asyncio.get_running_loop().create_future()

        def done(outcome: Outcome) -> None:
            if waiter.done():  # cancelled
                return
            if isinstance(outcome, OSError):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)
        self.send(data, done)
        try:
            return await waiter
        except asyncio.CancelledError:  # the answer still to come must not be read as the next request's
            self.close()
            raise
