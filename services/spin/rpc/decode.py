"""Tolerant request decoding: a message that does not parse ends its call INVALID_ARGUMENT.

grpc's default request deserializer (``Message.FromString``) raises on bytes that are no valid
message (a corrupt wire format, a string field that is not UTF-8), and grpc then answers the call
UNKNOWN or INTERNAL with no word of what was wrong. ``add_servicer`` registers a servicer as the
generated ``add_XServicer_to_server`` does, from the service's descriptor, but with
``tolerant_deserializer``: a request that does not parse becomes an ``Undecodable`` marker, and
the handler is wrapped so that the call ends INVALID_ARGUMENT ("undecodable spin.v1.X: why")
instead of running on it:

- a unary request: the marker never reaches the servicer's method;
- a request stream (``Verify``, ``Speculate``): the messages before it are handled as usual, the
  iterator raises ``UndecodableRequest`` when it reaches the marker, and the call ends
  INVALID_ARGUMENT once the method returns or raises (whatever the method made of the error).

A method that reads its stream with ``context.read()`` instead of the iterator sees the marker
itself; ``is_undecodable`` tells it apart.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""(client streaming, server streaming) -> grpc's handler factory for that kind of method."""


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse: what the deserializer returns instead of it."""

    type_name: str
    """Full name of the message type expected (e.g. ``spin.v1.GenerateRequest``)."""
    error: str
    """What the parser said."""

    @property
    def details(self) -> str:
        """The status message of the call it ends."""
        return f"undecodable {self.type_name}: {self.error}"


class UndecodableRequest(Exception):
    """Raised by a request stream's iterator at a message that did not parse."""

    def __init__(self, marker: Undecodable) -> None:
        super().__init__(marker.details)
        self.marker = marker


def is_undecodable(request: object) -> bool:
    """Whether ``request`` is the marker of a message that did not parse."""
    return isinstance(request, Undecodable)


def tolerant_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer for ``message_class`` that never raises: bytes that do not parse
    (``DecodeError``, or anything else the parser raises) give an ``Undecodable``."""
    type_name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser raises, the client's fault
            return Undecodable(type_name, _why(e, type_name))

    return deserialize


def _why(error: Exception, type_name: str) -> str:
    """The parser's message without its "Error parsing message with type 'X': " preamble."""
    text = str(error) or type(error).__name__
    prefix = f"Error parsing message with type '{type_name}': "
    return text[len(prefix):] if text.startswith(prefix) and len(text) > len(prefix) else text


def method_handlers(servicer: object, service: ServiceDescriptor,
                    ) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler for each method of ``service``: the servicer's method of that name
    behind ``tolerant_deserializer`` (and the marker check), responses serialized as usual."""
    return {m.name: _handler(getattr(servicer, m.name), m) for m in service.methods}


def add_servicer(servicer: object, service: ServiceDescriptor,
                 server: grpc.Server | grpc.aio.Server) -> None:
    """Register ``servicer`` for ``service`` on ``server`` as the generated
    ``add_XServicer_to_server`` does, with requests decoded tolerantly (module docstring)."""
    handlers = method_handlers(servicer, service)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpc >= 1.63
        server.add_registered_method_handlers(service.full_name, handlers)


def _handler(behavior: Callable, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    request_class = GetMessageClass(method.input_type)
    response_class = GetMessageClass(method.output_type)
    factory = HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
    return factory(_guarded(behavior, method.client_streaming),
                   request_deserializer=tolerant_deserializer(request_class),
                   response_serializer=response_class.SerializeToString)


class _Seen:
    """The first marker a request stream's iterator met (None: none yet)."""

    marker: Undecodable | None = None

    def check(self, request: object) -> object:
        if isinstance(request, Undecodable):
            self.marker = self.marker or request
            raise UndecodableRequest(request)
        return request


async def _checked_async(requests: AsyncIterator, seen: _Seen) -> AsyncIterator:
    async for request in requests:
        yield seen.check(request)


def _checked(requests: Iterator, seen: _Seen) -> Iterator:
    for request in requests:
        yield seen.check(request)


def _guarded(behavior: Callable, streaming_requests: bool) -> Callable:
    """``behavior`` (a servicer method of any of the four shapes grpc serves: coroutine, async
    generator, function, generator) behind the marker check, in the same shape."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            seen = _Seen()
            if streaming_requests:
                request = _checked_async(request, seen)
            elif isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            try:
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except UndecodableRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.marker.details)
            if seen.marker is not None:  # the method caught the error: the call still ends so
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, seen.marker.details)
        return guarded_stream
    if inspect.iscoroutinefunction(behavior):
        async def guarded_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            seen = _Seen()
            if streaming_requests:
                request = _checked_async(request, seen)
            elif isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            try:
                response = await behavior(request, context)
            except UndecodableRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.marker.details)
            if seen.marker is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, seen.marker.details)
            return response
        return guarded_call
    if inspect.isgeneratorfunction(behavior):
        def guarded_sync_stream(request: Any, context: grpc.ServicerContext) -> Iterator:
            seen = _Seen()
            if streaming_requests:
                request = _checked(request, seen)
            elif isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            try:
                yield from behavior(request, context)
            except UndecodableRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.marker.details)
            if seen.marker is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, seen.marker.details)
        return guarded_sync_stream

    def guarded_sync_call(request: Any, context: grpc.ServicerContext) -> Any:
        seen = _Seen()
        if streaming_requests:
            request = _checked(request, seen)
        elif isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        try:
            response = behavior(request, context)
        except UndecodableRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.marker.details)
        if seen.marker is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, seen.marker.details)
        return response
    return guarded_sync_call
