"""Tolerant request decoding (``rpc/decode.py``): bytes that do not parse end the call
INVALID_ARGUMENT with a message, for unary and streamed requests, on grpc.aio and sync servers;
the servicer's methods never see the marker, and the server goes on serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from spin.rpc.batches import in_order
from spin.rpc.decode import (
    Undecodable,
    UndecodableRequest,
    add_servicer,
    is_undecodable,
    method_handlers,
    tolerant_deserializer,
)
from spin.v1 import (
    drafter_pb2,
    generation_pb2,
    generation_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
VERIFIER = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
DRAFTER = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
CORRUPT = b"\x0a\x05ab"  # field 1, length 5, two bytes: the wire format is cut short
BAD_UTF8 = b"\x12\x02\xff\xfe"  # prompt (a string) that is not UTF-8


def test_tolerant_deserializer_returns_messages_and_markers() -> None:
    decode = tolerant_deserializer(generation_pb2.GenerateRequest)
    req = generation_pb2.GenerateRequest(prompt="hi", max_tokens=3)
    assert decode(req.SerializeToString()) == req
    assert decode(b"") == generation_pb2.GenerateRequest()
    corrupt = decode(CORRUPT)
    assert is_undecodable(corrupt) and not is_undecodable(req)
    assert corrupt.type_name == "spin.v1.GenerateRequest"
    assert corrupt.details.startswith("undecodable spin.v1.GenerateRequest: ")
    assert "Error parsing message" not in corrupt.details and corrupt.error  # the cause only
    assert "UTF-8" in decode(BAD_UTF8).details


def test_tolerant_deserializer_catches_any_parser_error() -> None:
    class Exploding:  # a message class whose parser fails with something else than DecodeError
        DESCRIPTOR = generation_pb2.GenerateRequest.DESCRIPTOR

        @classmethod
        def FromString(cls, data: bytes):
            raise RecursionError("nested too deep")

    marker = tolerant_deserializer(Exploding)(b"\x00")
    assert marker == Undecodable("spin.v1.GenerateRequest", "nested too deep")


@pytest.mark.parametrize("service", [GENERATION, VERIFIER, DRAFTER])
def test_method_handlers_cover_every_method_with_its_shape(service) -> None:
    class Servicer:
        def __getattr__(self, name: str):
            async def method(request, context):
                return None
            return method

    handlers = method_handlers(Servicer(), service)
    assert set(handlers) == {m.name for m in service.methods}
    for m in service.methods:
        h = handlers[m.name]
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming,
                                                               m.server_streaming)
        assert is_undecodable(h.request_deserializer(CORRUPT))


class _Generation(generation_pb2_grpc.GenerationServicer):
    """Streams the prompt back, one character per message; records what it was called with."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    async def Generate(self, request, context) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.seen.append(request)
        for ch in request.prompt:
            yield generation_pb2.GenerateResponse(text=ch)


class _Verifier(verifier_pb2_grpc.VerifierServicer):
    """Answers every batch with its id, through ``in_order`` as the real verifier does;
    ``swallow`` makes ``Verify`` hide the stream's error (the call must still fail)."""

    def __init__(self, swallow: bool = False) -> None:
        self.swallow = swallow
        self.pool = ThreadPoolExecutor(1)
        self.batches: list[object] = []

    def run_batch(self, batch: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        self.batches.append(batch)
        return verifier_pb2.VerifyResponse(batch_id=batch.batch_id)

    async def Verify(self, request_iterator, context) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        try:
            async for resp in in_order(request_iterator, self.run_batch, self.pool):
                yield resp
        except UndecodableRequest:
            if not self.swallow:
                raise

    async def GetVerifierInfo(self, request, context) -> verifier_pb2.GetVerifierInfoResponse:
        return verifier_pb2.GetVerifierInfoResponse()


def _batch(i: int) -> bytes:
    return verifier_pb2.VerifyRequest(batch_id=i).SerializeToString()


async def _serve(*servicers: tuple[object, object]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for servicer, service in servicers:
        add_servicer(servicer, service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _generate(ch: grpc.aio.Channel, data: bytes) -> tuple[grpc.StatusCode, str, str]:
    """(status, details, streamed text) of one Generate call sent as raw bytes."""
    call = ch.unary_stream("/spin.v1.Generation/Generate", request_serializer=None,
                           response_deserializer=generation_pb2.GenerateResponse.FromString)(
        data, timeout=10)
    text = ""
    try:
        async for msg in call:
            text += msg.text
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", text
    return grpc.StatusCode.OK, "", text


async def _verify(ch: grpc.aio.Channel, messages: list[bytes]) -> tuple[grpc.StatusCode, str,
                                                                         list[int]]:
    """(status, details, batch ids answered) of one Verify stream of raw messages."""
    call = ch.stream_stream("/spin.v1.Verifier/Verify", request_serializer=None,
                            response_deserializer=verifier_pb2.VerifyResponse.FromString)(
        iter(messages), timeout=10)
    ids: list[int] = []
    try:
        async for resp in call:
            ids.append(resp.batch_id)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", ids
    return grpc.StatusCode.OK, "", ids


def test_undecodable_unary_request_is_invalid_argument_and_never_reaches_the_servicer() -> None:
    gen = _Generation()

    async def scenario() -> None:
        server, endpoint = await _serve((gen, GENERATION))
        try:
            async with grpc.aio.insecure_channel(endpoint) as ch:
                for bad in (CORRUPT, BAD_UTF8):
                    code, details, text = await _generate(ch, bad)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT and not text
                    assert details.startswith("undecodable spin.v1.GenerateRequest: ")
                ok = generation_pb2.GenerateRequest(prompt="abc").SerializeToString()
                assert await _generate(ch, ok) == (grpc.StatusCode.OK, "", "abc")
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert [r.prompt for r in gen.seen] == ["abc"]  # the markers never got there


@pytest.mark.parametrize("swallow", [False, True])
def test_undecodable_message_in_a_stream_ends_it_invalid_argument(swallow: bool) -> None:
    ver = _Verifier(swallow)

    async def scenario() -> None:
        server, endpoint = await _serve((ver, VERIFIER))
        try:
            async with grpc.aio.insecure_channel(endpoint) as ch:
                code, details, ids = await _verify(ch, [_batch(1), _batch(2), CORRUPT, _batch(4)])
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert details.startswith("undecodable spin.v1.VerifyRequest: ")
                assert ids == [1, 2]  # the batches before it were answered
                assert await _verify(ch, [_batch(5), _batch(6)]) == (grpc.StatusCode.OK, "",
                                                                     [5, 6])
                info = ch.unary_unary("/spin.v1.Verifier/GetVerifierInfo",
                                      request_serializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await info(b"\xff", timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "undecodable spin.v1.GetVerifierInfoRequest" in err.value.details()
                assert await info(b"", timeout=10) == b""  # still serving
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert [b.batch_id for b in ver.batches] == [1, 2, 5, 6]


def test_sync_server_and_servicer() -> None:
    class SyncGeneration(generation_pb2_grpc.GenerationServicer):
        def Generate(self, request, context) -> Iterator[generation_pb2.GenerateResponse]:
            yield generation_pb2.GenerateResponse(text=request.prompt)

    class SyncVerifier(verifier_pb2_grpc.VerifierServicer):
        def Verify(self, request_iterator, context) -> Iterator[verifier_pb2.VerifyResponse]:
            for batch in request_iterator:
                yield verifier_pb2.VerifyResponse(batch_id=batch.batch_id)

        def GetVerifierInfo(self, request, context) -> verifier_pb2.GetVerifierInfoResponse:
            return verifier_pb2.GetVerifierInfoResponse()

    server = grpc.server(ThreadPoolExecutor(2))
    add_servicer(SyncGeneration(), GENERATION, server)
    add_servicer(SyncVerifier(), VERIFIER, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            generate = ch.unary_stream(
                "/spin.v1.Generation/Generate", request_serializer=None,
                response_deserializer=generation_pb2.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                list(generate(CORRUPT, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "undecodable spin.v1.GenerateRequest" in err.value.details()
            ok = generation_pb2.GenerateRequest(prompt="x").SerializeToString()
            assert [m.text for m in generate(ok, timeout=10)] == ["x"]
            verify = ch.stream_stream("/spin.v1.Verifier/Verify", request_serializer=None,
                                      response_deserializer=verifier_pb2.VerifyResponse.FromString)
            got: list[int] = []
            with pytest.raises(grpc.RpcError) as err:
                for resp in verify(iter([_batch(1), CORRUPT]), timeout=10):
                    got.append(resp.batch_id)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and got == [1]
            info = ch.unary_unary("/spin.v1.Verifier/GetVerifierInfo", request_serializer=None)
            with pytest.raises(grpc.RpcError) as err:
                info(b"\xff", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(None)
