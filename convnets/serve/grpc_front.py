"""The gRPC front: each KServe message parsed and sent to Triton as a new one (see :mod:`convnets.serve.front`).

Every method of ``inference.GRPCInferenceService`` is served on ``grpc.aio``: a held
``ModelStreamInfer`` stream costs no thread, so it cannot starve other calls. Each message the
client sends is parsed as the protobuf its method takes (tritonclient's ``service_pb2``: the KServe
v2 protos), its unknown fields dropped, and serialized anew for Triton; the client's metadata is not
passed on; its deadline is. Triton's answers come back as they are. ``ModelInfer`` is asked of Triton's HTTP server
where :mod:`convnets.serve.kserve` can write it as an HTTP request (its docstring says why and when), on kept unix
connections, one per call in flight. Refused, without Triton seeing
them: a message over ``max_request_bytes`` (gRPC itself, ``RESOURCE_EXHAUSTED``, from its length
prefix), one that does not parse (``INVALID_ARGUMENT``), calls over
:attr:`~convnets.serve.front.Limits.max_rpcs` and messages over the bytes all requests may hold
(``RESOURCE_EXHAUSTED``). Methods outside the service are ``UNIMPLEMENTED``. A connection without calls for
:data:`~convnets.serve.front.IDLE_TIMEOUT_S` is closed (gRPC's ``max_connection_idle_ms``), and one that has not
sent HTTP/2's preface and settings within :data:`~convnets.serve.front.HEAD_TIMEOUT_S` of opening (gRPC's
``server_handshake_timeout_ms``; its default held a silent connection's room 120 s); connections over
:attr:`~convnets.serve.front.Limits.max_grpc_connections` are closed as gRPC accepts them, before a byte is read
(gRPC's ``max_allowed_incoming_connections``, grpcio 1.64 and later; these refusals are not counted: gRPC does not
tell Python of them).

Memory: gRPC reads a message whole before its handler runs, and Python cannot reach gRPC's resource quota (a
pointer argument; grpcio exports no C API to make one), so a message is counted in the bytes in flight only once
held. What bounds the front's memory is the calls: each holds at most one message (a stream reads its next one
after the last was passed on), so ``max_rpcs * max_request_bytes`` at most, and the copies made to parse and
pass them on; calls over ``max_rpcs`` are refused before their message is read.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any, cast

from convnets.serve import kserve
from convnets.serve.front import (BUSY_MESSAGE, HEAD_TIMEOUT_S, IDLE_TIMEOUT_S, UNAVAILABLE_MESSAGE, Limits,
                                  return_freed_memory)
from convnets.serve.upstream import Upstream

__all__ = ["GrpcFront"]

log = logging.getLogger(__name__)

_SERVICE = "inference.GRPCInferenceService"
# After a message at least this large is dropped, the freed memory is returned to the system (once for a burst).
_TRIM_BYTES = 8 << 20
_TRIM_AFTER_S = 0.5
# A remaining time longer than this (a year) means the client set no deadline.
_NO_DEADLINE_S = 365 * 86400.0


def _deadline(context: Any) -> float | None:
    remaining: float | None = context.time_remaining()
    return remaining if remaining is not None and remaining < _NO_DEADLINE_S else None


class GrpcFront:
    """The gRPC front on ``host:port``, passing rebuilt messages to Triton's gRPC server on the unix socket ``target``."""

    def __init__(self, host: str, port: int, target: str, http_target: str, limits: Limits) -> None:
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.target, self.http_target, self.limits = target, http_target, limits
        #: The port listened on (the one asked for, or the one picked for 0), once started.
        self.port = port
        self._server: Any = None
        self._channel: Any = None
        self._upstreams: list[Upstream] = []  # kept connections to Triton's HTTP socket, none in use
        self._trim: Any = None  # the timer that returns freed memory, while one is set

    async def start(self) -> None:
        """Listen and serve (on the running event loop).

        Raises:
            OSError: the address cannot be bound.
        """
        # Triton is started by fork and exec: gRPC's fork handlers are not needed (and would log each time).
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        import grpc
        from tritonclient.grpc import service_pb2

        self._channel = grpc.aio.insecure_channel(f"unix:{self.target}", options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        handlers = {method.name: self._handler(method, getattr(service_pb2, method.input_type.name),
                                               getattr(service_pb2, method.output_type.name))
                    for method in service.methods}
        self._server = grpc.aio.server(
            handlers=[grpc.method_handlers_generic_handler(_SERVICE, handlers)],
            maximum_concurrent_rpcs=self.limits.max_rpcs,
            options=[("grpc.max_receive_message_length", self.limits.max_request_bytes),
                     ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0),
                     ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000)),
                     ("grpc.server_handshake_timeout_ms", int(HEAD_TIMEOUT_S * 1000)),
                     ("grpc.max_allowed_incoming_connections", self.limits.max_grpc_connections)])
        try:
            bound = self._server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self.address}: {e}") from e
        if not bound:
            raise OSError(f"cannot listen on {self.address}")
        self.port = bound
        await self._server.start()

    async def stop(self) -> None:
        """Stop serving (calls in flight get a second) and close the channel to Triton."""
        if self._server is not None:
            await self._server.stop(grace=1)
            await self._channel.close()
            self._server = None
            for upstream in self._upstreams:
                upstream.close()

    def _handler(self, method: Any, message: Any, response_type: Any) -> Any:
        """The handler of ``method``: its client's messages parsed as ``message`` and rebuilt for Triton (``ModelInfer``
        over HTTP where it can be, answered as ``response_type``)."""
        import grpc

        path = f"/{_SERVICE}/{method.name}"
        limits = self.limits

        malformed = f"not a {message.__name__} message"

        def parse(data: bytes) -> Any:
            """``data`` as ``message``, its unknown fields dropped; ``None`` (a refusal counted) if it does not parse."""
            try:
                request = message.FromString(data)
            except Exception:  # noqa: BLE001 (protobuf's DecodeError, whatever the implementation)
                limits.refuse("grpc", "malformed")
                return None
            request.DiscardUnknownFields()
            return request

        def take(size: int) -> bool:
            """Hold a message of ``size`` bytes in the bytes in flight, or count a refusal."""
            if size >= _TRIM_BYTES:
                self._return_memory_soon()
            if limits.take(size):
                return True
            limits.refuse("grpc", "busy")
            return False

        if method.client_streaming:
            call_stream = self._channel.stream_stream(path, request_serializer=message.SerializeToString)

            async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                async def rebuilt() -> AsyncIterator[Any]:
                    async for data in requests:
                        if not take(len(data)):
                            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_MESSAGE)
                        try:
                            if (request := parse(data)) is None:
                                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed)
                            yield request
                        finally:
                            limits.give_back(len(data))
                try:
                    async for answer in call_stream(rebuilt(), timeout=_deadline(context)):
                        yield answer
                except grpc.aio.AioRpcError as e:
                    await context.abort(e.code(), e.details() or "")
            return grpc.stream_stream_rpc_method_handler(stream)

        call_unary = self._channel.unary_unary(path, request_serializer=message.SerializeToString)

        async def answer(data: bytes, deadline: float | None) -> tuple[Any, Any]:
            """The call's outcome: ``(OK, the answer's bytes)``, or an error's code and message."""
            if (request := parse(data)) is None:
                return grpc.StatusCode.INVALID_ARGUMENT, malformed
            if method.name == "ModelInfer" and (http := kserve.http_request(request)) is not None:
                code, value = await self._infer_over_http(http, deadline, response_type)
                return grpc.StatusCode[code], value
            try:
                return grpc.StatusCode.OK, await call_unary(request, timeout=deadline)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""

        async def unary(data: bytes, context: Any) -> bytes:
            # An error is raised here only once the message is dropped: its traceback holds this frame, in a cycle
            # that only the garbage collector frees, and gRPC kept some such errors after their calls: 20 calls
            # of 79 MiB each ending in an error left 2.5 GiB held.
            size = len(data)
            code, value = grpc.StatusCode.RESOURCE_EXHAUSTED, cast(Any, BUSY_MESSAGE)
            if take(size):
                try:
                    code, value = await answer(data, _deadline(context))
                finally:
                    limits.give_back(size)
            del data
            if code != grpc.StatusCode.OK:
                await context.abort(code, value)
            return value
        return grpc.unary_unary_rpc_method_handler(unary)

    def _return_memory_soon(self) -> None:
        """Return the memory freed once the large messages of a burst are dropped (see
        :func:`~convnets.serve.front.return_freed_memory`)."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(_TRIM_AFTER_S, self._trim_when_dropped)

    def _trim_when_dropped(self) -> None:
        self._trim = None
        if self.limits.bytes_in_flight >= _TRIM_BYTES:  # large messages still held: again once they are dropped
            self._return_memory_soon()
        else:
            return_freed_memory()

    async def _infer_over_http(self, request: list[bytes], deadline: float | None, response_type: Any) -> tuple[str, Any]:
        """Ask Triton's HTTP server (:mod:`convnets.serve.kserve`) on a kept connection: the gRPC status name, and the
        response's bytes or the error message."""
        upstream = self._upstreams.pop() if self._upstreams else Upstream(self.http_target)
        try:
            status, headers, body = await asyncio.wait_for(upstream.exchange(request), deadline)
        except asyncio.TimeoutError:
            return "DEADLINE_EXCEEDED", "Deadline Exceeded"
        except OSError:
            self.limits.refuse("grpc", "triton unavailable")
            return "UNAVAILABLE", UNAVAILABLE_MESSAGE
        self._upstreams.append(upstream)
        try:
            code, answer = kserve.grpc_answer(status, headers, body, response_type)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("Triton's answer to an inference could not be read: %s", e)
            return "INTERNAL", "the model server's answer could not be read"
        return code, answer.SerializeToString() if code == "OK" else answer
