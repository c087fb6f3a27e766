"""API keys on the gRPC API: ``authorization: Bearer KEY`` metadata, or UNAUTHENTICATED.

Only the services named (the router's ``spin.v1.Generation``) are guarded; health checking and
server reflection stay open, so probes and ``grpcurl list`` work without the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc


def bearer_ok(header: str | None, key: str) -> bool:
    """Whether an ``authorization`` value carries ``key`` (constant-time comparison)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``services`` (full names) without the key."""

    def __init__(self, key: str, services: list[str]) -> None:
        if not key:
            raise ValueError("the API key is empty")
        self.key = key
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if not details.method.startswith(self.prefixes):
            return await continuation(details)
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"),
                      None)
        if bearer_ok(header, self.key):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""
    message = "a valid API key is required (metadata authorization: Bearer KEY)"

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(unary)
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.response_streaming and handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
