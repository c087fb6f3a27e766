"""StreamClient over a real gRPC stream: batches in flight together, answered in order; a broken
stream fails every call in flight on it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from spin.router.clients import ServiceDown, StreamClient
from spin.rpc.batches import in_order
from spin.v1 import verifier_pb2, verifier_pb2_grpc


class Verifier(verifier_pb2_grpc.VerifierServicer):
    """Answers one token per task; batch 1 computes only once batch 2 has arrived, and a batch
    whose first task is ``"fail"`` aborts the stream."""

    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1)
        self.second_arrived = threading.Event()
        self.received: list[int] = []

    def run(self, batch: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        if batch.batch_id == 1 and not self.second_arrived.wait(5):
            raise RuntimeError("batch 2 was not sent while batch 1 was in flight")
        if batch.tasks and batch.tasks[0].request_id == "fail":
            raise ValueError("asked to fail")
        return verifier_pb2.VerifyResponse(batch_id=batch.batch_id, results=[
            verifier_pb2.VerifyResult(request_id=t.request_id, tokens=[len(t.request_id)])
            for t in batch.tasks])

    async def Verify(self, request_iterator, context):
        async def arrivals():
            async for batch in request_iterator:
                self.received.append(batch.batch_id)
                if batch.batch_id == 2:
                    self.second_arrived.set()
                yield batch
        try:
            async for resp in in_order(arrivals(), self.run, self.worker):
                yield resp
        except (RuntimeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))


def _batch(*ids: str) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(tasks=[verifier_pb2.VerifyTask(request_id=i) for i in ids])


async def _with_server(body) -> None:
    server = grpc.aio.server()
    service = Verifier()
    verifier_pb2_grpc.add_VerifierServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StreamClient("target", f"127.0.0.1:{port}", "verifier", timeout_s=10)
    try:
        await body(client, service)
    finally:
        await client.close()
        await server.stop(None)


def test_two_batches_in_flight_are_answered_in_order() -> None:
    async def body(client: StreamClient, service: Verifier) -> None:
        a, b = await asyncio.gather(client.call(_batch("a", "aa")), client.call(_batch("bbb")))
        assert (a.batch_id, b.batch_id) == (1, 2)
        assert [(r.request_id, list(r.tokens)) for r in a.results] == [("a", [1]), ("aa", [2])]
        assert [(r.request_id, list(r.tokens)) for r in b.results] == [("bbb", [3])]
        assert service.received == [1, 2] and client.up
        c = await client.call(_batch("c"))  # the same stream goes on
        assert c.batch_id == 3 and list(c.results[0].tokens) == [1]
    asyncio.run(_with_server(body))


def test_a_broken_stream_fails_every_call_in_flight() -> None:
    async def body(client: StreamClient, service: Verifier) -> None:
        outcomes = await asyncio.gather(client.call(_batch("fail")), client.call(_batch("b")),
                                        return_exceptions=True)
        assert all(isinstance(o, ServiceDown) for o in outcomes), outcomes
        assert "asked to fail" in str(outcomes[0])
        assert not client.up
        with pytest.raises(ServiceDown, match="is down"):  # backing off
            await client.call(_batch("c"))
    asyncio.run(_with_server(body))
