"""The thread that runs every front (:mod:`convnets.serve.front`): the HTTP, metrics and gRPC fronts on one asyncio
event loop, started and stopped together."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from typing import Any

from convnets.serve.front import Limits
from convnets.serve.grpc_front import GrpcFront
from convnets.serve.http_front import HttpFront

__all__ = ["Fronts", "listening_socket"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (SO_REUSEADDR, as Triton binds: a port in TIME_WAIT is usable)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024, reuse_port=False)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv, as uvicorn runs on), or asyncio's where uvloop is not installed: the fronts'
    per-request cost is mostly the loop's, and uvloop's is about a third lower."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Fronts:
    """The HTTP, gRPC and metrics fronts on ``host``'s ports, passing requests to Triton's unix sockets ``inner``
    (``http``, ``grpc``, ``metrics``), on an event loop in a thread of their own.

    Raises:
        OSError: an address cannot be bound.
    """

    def __init__(self, host: str, ports: dict[str, int], inner: dict[str, str], limits: Limits) -> None:
        self.limits = limits
        self._host, self._grpc_port, self._inner = host, ports["grpc"], inner
        self._sockets = {name: listening_socket(host, ports[name]) for name in ("http", "metrics")}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[Any] = []

    def start(self) -> None:
        """Serve on a daemon thread; returns once every front listens.

        Raises:
            OSError: the gRPC address cannot be bound.
        """
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = _new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(started,), name="convnets-fronts", daemon=True)
        self._thread.start()
        started.result()

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(self._start())
            except BaseException as error:  # noqa: BLE001 (handed to the thread that waits)
                started.set_exception(error)
                return
            started.set_result(None)
            loop.run_forever()
        finally:
            loop.close()

    async def _start(self) -> None:
        grpc = GrpcFront(self._host, self._grpc_port, self._inner["grpc"], self._inner["http"], self.limits)
        self._servers = [HttpFront(self._sockets["http"], self._inner["http"], self.limits),
                         HttpFront(self._sockets["metrics"], self._inner["metrics"], self.limits, metrics=True), grpc]
        for server in self._servers:
            await server.start()

    def stop(self) -> None:
        """Stop serving (gRPC calls in flight get a second) and close the listening sockets. Safe to call twice."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None and thread.is_alive():
            async def stop_all() -> None:
                for server in self._servers:
                    await server.stop()
            try:
                asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout=30)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout=30)
        for sock in self._sockets.values():
            sock.close()
