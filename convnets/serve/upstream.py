"""The HTTP fronts' connection to Triton's HTTP server on its unix socket: requests written by the front
(:mod:`convnets.serve.http_front`), answers read by httptools."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import httptools

__all__ = ["UPSTREAM_TIMEOUT_S", "Upstream", "request_head"]

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


class _Answer(asyncio.Protocol):
    """One kept connection to Triton's unix socket; httptools reads its answers (status, headers, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes, bool]] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(EOFError("Triton closed the connection"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(OSError(f"Triton's answer did not parse: {error}"))
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), self.headers, b"".join(self.body),
                                    self.parser.should_keep_alive()))

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Upstream:
    """The client connection's connection to Triton, made when first needed and again after Triton closed it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._answer: _Answer | None = None

    def close(self) -> None:
        if self._answer is not None:
            self._answer.close()
            self._answer = None

    async def exchange(self, data: Sequence[bytes | bytearray]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send the request ``data``; Triton's status, headers and body. Once more on a new connection if the kept one
        was closed meanwhile (Triton restarted).

        Raises:
            OSError: Triton did not answer.
        """
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            fresh = self._answer is None or self._answer.transport is None
            try:
                if fresh:
                    _, self._answer = await loop.create_unix_connection(_Answer, self.path)
                answer = self._answer
                assert answer is not None and answer.transport is not None
                answer.headers, answer.body = [], []  # llhttp starts the next answer by itself
                answer.waiter = waiter = loop.create_future()
                answer.transport.writelines(data)
                timeout = loop.call_later(UPSTREAM_TIMEOUT_S, self._late, waiter)
                try:
                    status, headers, body, keep_alive = await waiter
                finally:
                    timeout.cancel()
                if not keep_alive:
                    self.close()
                return status, headers, body
            except TimeoutError:  # Triton took the request: not sent again
                self.close()
                raise
            except (OSError, EOFError) as error:
                self.close()
                if attempt or fresh:
                    raise OSError(str(error)) from error
            except BaseException:  # cancelled: the answer still to come must not be read as the next request's
                self.close()
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def _late(waiter: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"Triton did not answer within {UPSTREAM_TIMEOUT_S:.0f} s"))
