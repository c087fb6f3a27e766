"""Bad input to the router's ``spin.v1.Generation`` API, over the embedded deployment: random
bytes, mutated requests and out-of-range fields are each answered INVALID_ARGUMENT with a message
(never UNKNOWN or INTERNAL), and the router goes on serving, with the same outputs as before. The
same holds for undecodable messages to health, reflection, and the verifier's and drafters'
streams."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from service_helpers import collect, request

from spin.router.validation import (
    MAX_DRAFTER_NAME_CHARS,
    MAX_K,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    PROMPT_CHARS_PER_TOKEN,
)
from spin.v1 import (
    drafter_pb2,
    generation_pb2,
    generation_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

PROMPT = "def parse(path):\n    with open(path) as f:\n"
METHOD = "/spin.v1.Generation/Generate"
ACCEPTABLE = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
              "DEADLINE_EXCEEDED", "CANCELLED"}  # the last two: the client's own deadline
"""What a fuzzed call may end with: UNKNOWN and INTERNAL (a server bug) may not appear."""


async def _call(generate, data: bytes, timeout: float) -> tuple[str, str]:
    """(status name, details) of one call sent as raw bytes; an OK call must stream to its end
    (the last message carries the finish reason), or it counts as 'OK_UNFINISHED'."""
    last = None
    try:
        async for msg in generate(data, timeout=timeout):
            last = msg
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or ""
    if last is None or last.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
        return "OK_UNFINISHED", ""
    return "OK", ""


def send_raw(endpoint: str, messages: list[bytes], timeout: float = 2.0,
             concurrency: int = 32) -> list[tuple[str, str]]:
    """Send each message as it is (no serialization) to Generate, ``concurrency`` at a time;
    (status name, details) per message, in order."""
    async def run() -> list[tuple[str, str]]:
        async with grpc.aio.insecure_channel(endpoint) as ch:
            generate = ch.unary_stream(
                METHOD, request_serializer=None,
                response_deserializer=generation_pb2.GenerateResponse.FromString)
            room = asyncio.Semaphore(concurrency)

            async def one(data: bytes) -> tuple[str, str]:
                async with room:
                    return await _call(generate, data, timeout)

            return await asyncio.gather(*(one(m) for m in messages))

    return asyncio.run(run())


def mutate(data: bytes, rng: random.Random) -> bytes:
    """``data`` with 1 to 3 random edits: a bit flipped, a random byte set, inserted or
    deleted."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(("flip", "set", "insert", "delete"))
        i = rng.randrange(len(out) + (op == "insert")) if out or op == "insert" else 0
        if op == "flip" and out:
            out[i] ^= 1 << rng.randrange(8)
        elif op == "set" and out:
            out[i] = rng.randrange(256)
        elif op == "insert":
            out[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif out:
            del out[i:i + rng.randint(1, 4)]
    return bytes(out)


@pytest.fixture
def still_serving(serving):
    """Checks after the test that the router process is the one from before (not crashed and
    restarted), reports SERVING, logged no unexpected handler error, and decodes ``PROMPT``
    greedily as it did before."""
    router = serving.router
    pid, log_lines = router.proc.pid, _unexpected(router.log_path)
    before = collect(serving.endpoint, request(PROMPT, max_tokens=12, mode="off",
                                               ignore_eos=True))[0]
    yield
    assert serving.router is router and router.proc.poll() is None and router.proc.pid == pid
    with grpc.insecure_channel(serving.endpoint) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ids, _, last = collect(serving.endpoint, request(PROMPT, max_tokens=12, mode="off",
                                                     ignore_eos=True))
    assert ids == before and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert _unexpected(router.log_path) == log_lines, "the router logged unexpected errors"


def _unexpected(path) -> int:
    """Lines of the router's log where grpc reports a handler that raised (not aborted)."""
    return sum("Unexpected" in line or "Traceback" in line
               for line in path.read_text(errors="replace").splitlines())


def _report(name: str, results: list[tuple[str, str]]) -> Counter:
    codes = Counter(code for code, _ in results)
    print(f"\n{name}: {len(results)} calls: {dict(sorted(codes.items()))}")
    assert codes["UNKNOWN"] == 0 and codes["INTERNAL"] == 0, codes
    assert set(codes) <= ACCEPTABLE, codes
    assert all(details for code, details in results if code == "INVALID_ARGUMENT")
    return codes


def test_random_bytes_are_invalid_argument_never_unknown(serving, still_serving) -> None:
    rng = random.Random(20240611)
    messages = [rng.randbytes(rng.randint(0, 200)) for _ in range(1000)]
    results = send_raw(serving.endpoint, messages)
    codes = _report("fuzz (random bytes)", results)
    assert codes["INVALID_ARGUMENT"] >= 900  # most random bytes parse to nothing usable
    undecodable = [d for c, d in results if d.startswith("undecodable spin.v1.GenerateRequest: ")]
    assert len(undecodable) >= 100, "the corrupt ones are named as such"


def test_mutated_requests_are_answered_and_never_unknown(serving, still_serving) -> None:
    rng = random.Random(7)
    valid = request(PROMPT, max_tokens=4, mode="drafter", drafter="draft-code", k=3,
                    temperature=0.7, seed=11, stop=["\n\n"]).SerializeToString()
    messages = [mutate(valid, rng) for _ in range(1000)]
    results = send_raw(serving.endpoint, messages)
    codes = _report("mutation (1-3 byte edits of a valid request)", results)
    assert codes["OK"] >= 50 and codes["INVALID_ARGUMENT"] >= 50, codes


def _rejected(serving, req: generation_pb2.GenerateRequest) -> str:
    """The details of the INVALID_ARGUMENT ``req`` gets."""
    with pytest.raises(grpc.RpcError) as err:
        collect(serving.endpoint, req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def _max_context(serving) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{serving.child('verifier', 'verifier').port}") as ch:
        info = verifier_pb2_grpc.VerifierStub(ch).GetVerifierInfo(
            verifier_pb2.GetVerifierInfoRequest(), timeout=30).info
    return info.max_context


def _edited(req: generation_pb2.GenerateRequest, **sampling) -> generation_pb2.GenerateRequest:
    """``req`` with these fields of ``sampling`` set (``mode``: of ``speculation``)."""
    if "mode" in sampling:
        req.speculation.mode = sampling.pop("mode")
    for name, value in sampling.items():
        setattr(req.sampling, name, value)
    return req


BAD_FIELDS = {  # id: (request, fragments its INVALID_ARGUMENT message must hold)
    "mode-99": (_edited(request(PROMPT), mode=99),
                ["speculation.mode 99 is not a SpeculationMode", "3 (SPECULATION_MODE_DRAFTER)"]),
    "mode-negative": (_edited(request(PROMPT), mode=-1), ["speculation.mode -1"]),
    "temperature-inf": (request(PROMPT, temperature=float("inf")),
                        ["sampling.temperature", "finite", "inf"]),
    "temperature-nan": (request(PROMPT, temperature=float("nan")),
                        ["sampling.temperature", "nan"]),
    "temperature-negative": (request(PROMPT, temperature=-0.5), ["sampling.temperature", ">= 0"]),
    "top_p-nan": (_edited(request(PROMPT, temperature=1.0), top_p=float("nan")),
                  ["sampling.top_p", "(0, 1]"]),
    "top_p-inf": (_edited(request(PROMPT, temperature=1.0), top_p=float("inf")),
                  ["sampling.top_p"]),
    "top_p-0": (_edited(request(PROMPT, temperature=1.0), top_p=0.0), ["sampling.top_p"]),
    "top_k-negative": (_edited(request(PROMPT, temperature=1.0), top_k=-3), ["sampling.top_k"]),
    "17-stop-strings": (request(PROMPT, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
                        [f"stop has {MAX_STOP_STRINGS + 1} strings",
                         f"at most {MAX_STOP_STRINGS}"]),
    "257-char-stop": (request(PROMPT, stop=["ok", "x" * (MAX_STOP_CHARS + 1)]),
                      [f"stop[1] has {MAX_STOP_CHARS + 1} characters",
                       f"at most {MAX_STOP_CHARS}"]),
    "empty-stop": (request(PROMPT, stop=["ok", ""]), ["stop[1] is empty"]),
    "k-above-max": (request(PROMPT, mode="drafter", drafter="draft-code", k=MAX_K + 1),
                    ["speculation.k", f"[0, {MAX_K}]", f"got {MAX_K + 1}"]),
    "k-negative": (request(PROMPT, mode="drafter", drafter="draft-code", k=-1),
                   ["speculation.k", "got -1"]),
    "k-huge-in-auto": (request(PROMPT, k=10 ** 9), ["speculation.k"]),
    "long-drafter-name": (request(PROMPT, mode="drafter",
                                  drafter="d" * (MAX_DRAFTER_NAME_CHARS + 1)),
                          ["speculation.drafter", f"at most {MAX_DRAFTER_NAME_CHARS}"]),
    "long-request_id": (request(PROMPT, request_id="r" * (MAX_REQUEST_ID_CHARS + 1)),
                        ["request_id", f"at most {MAX_REQUEST_ID_CHARS}"]),
    "request_id-newline": (request(PROMPT, request_id="a\nb"), ["request_id", "printable"]),
    "max_tokens-negative": (request(PROMPT, max_tokens=-5), ["max_tokens must be > 0"]),
    "prompt-and-ids": (request(PROMPT, ids=[1, 2]), ["either prompt or prompt_token_ids"]),
    "negative-token-id": (request(ids=[-1], max_tokens=5), ["prompt_token_ids", "[0, "]),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_out_of_range_fields_are_invalid_argument_naming_the_field(serving, case: str) -> None:
    bad, fragments = BAD_FIELDS[case]
    details = _rejected(serving, bad)
    for fragment in fragments:
        assert fragment in details, (fragment, details)


def test_huge_prompts_are_refused_before_tokenizing(serving, still_serving) -> None:
    max_context = _max_context(serving)
    chars = PROMPT_CHARS_PER_TOKEN * max_context + 1
    details = _rejected(serving, request("a" * chars, max_tokens=4))
    assert f"prompt has {chars} characters" in details
    details = _rejected(serving, request(ids=[1] * (10 * max_context), max_tokens=4))
    assert "prompt_token_ids" in details and f"holds {max_context}" in details
    odd = "\U0010ffff\u200d\ufeff\u0301" * 50 + "\x00\x7f"  # valid UTF-8, odd code points
    ids, _, last = collect(serving.endpoint, request(odd, max_tokens=3, mode="off"))
    assert last.usage.prompt_tokens > 0 and len(ids) <= 3


def test_undecodable_request_is_invalid_argument(serving) -> None:
    for data in (b"\x0a\x05ab", b"\x12\x02\xff\xfe", b"\xff\xff\xff"):
        [(code, details)] = send_raw(serving.endpoint, [data], timeout=30)
        assert code == "INVALID_ARGUMENT", (code, details)
        assert details.startswith("undecodable spin.v1.GenerateRequest: ")


def test_request_id_of_a_running_request_is_refused(serving) -> None:
    with grpc.insecure_channel(serving.endpoint) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        first = stub.Generate(request(PROMPT, max_tokens=400, mode="off", ignore_eos=True,
                                      request_id="same-id"), timeout=120)
        next(first)  # it is streaming
        try:
            details = _rejected(serving, request(PROMPT, max_tokens=4, request_id="same-id"))
            assert "request_id 'same-id' is in use" in details
        finally:
            first.cancel()
    for _ in range(100):  # free again once the router has seen that stream end
        try:
            ids, _, _ = collect(serving.endpoint, request(PROMPT, max_tokens=4, mode="off",
                                                          request_id="same-id"))
            break
        except grpc.RpcError as e:
            assert "is in use" in e.details()
            time.sleep(0.1)
    assert len(ids) > 0


def test_extreme_but_valid_values_are_served(serving, still_serving) -> None:
    """The edges of the allowed ranges are served, and sensibly: a temperature too small to
    divide the logits by (they would overflow) decodes as greedy, top_p tiny keeps the top
    token only, k = MAX_K is allowed."""
    greedy = collect(serving.endpoint, request(PROMPT, max_tokens=8, mode="off",
                                               ignore_eos=True))[0]
    for mode, drafter in (("off", ""), ("drafter", "draft-code")):
        tiny = request(PROMPT, max_tokens=8, temperature=1e-40, seed=1, mode=mode,
                       drafter=drafter, k=MAX_K, ignore_eos=True)
        assert collect(serving.endpoint, tiny)[0] == greedy, mode
        nucleus = request(PROMPT, max_tokens=8, temperature=1.0, seed=1, mode=mode,
                          drafter=drafter, k=4, ignore_eos=True)
        nucleus.sampling.top_p, nucleus.sampling.top_k = 1e-30, 2 ** 31 - 1
        assert collect(serving.endpoint, nucleus)[0] == greedy, mode
        hot = request(PROMPT, max_tokens=8, temperature=3.4e38, seed=-(2 ** 63), mode=mode,
                      drafter=drafter, k=4, ignore_eos=True)
        assert len(collect(serving.endpoint, hot)[0]) == 8


@pytest.mark.parametrize("role, name, method, message, reply", [
    ("verifier", "verifier", "/spin.v1.Verifier/Verify", verifier_pb2.VerifyRequest,
     verifier_pb2.VerifyResponse),
    ("drafter", "draft-code", "/spin.v1.Drafter/Speculate", drafter_pb2.SpeculateRequest,
     drafter_pb2.SpeculateResponse),
])
def test_internal_services_end_a_stream_at_an_undecodable_message(serving, role, name, method,
                                                                   message, reply) -> None:
    """The verifier's and drafters' bidi streams (the router's side of the deployment): the
    batches before an undecodable message are answered, then the stream ends INVALID_ARGUMENT,
    and the service serves the next stream."""
    with grpc.insecure_channel(f"127.0.0.1:{serving.child(role, name).port}") as ch:
        stream = ch.stream_stream(method, request_serializer=None,
                                  response_deserializer=reply.FromString)
        answered: list[int] = []
        with pytest.raises(grpc.RpcError) as err:
            for resp in stream(iter([message(batch_id=1).SerializeToString(), b"\x0a\x05ab",
                                     message(batch_id=3).SerializeToString()]), timeout=30):
                answered.append(resp.batch_id)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"undecodable {message.DESCRIPTOR.full_name}: ")
        assert answered == [1]
        again = [r.batch_id for r in stream(iter([message(batch_id=4).SerializeToString()]),
                                            timeout=30)]
        assert again == [4]


def test_health_and_reflection_refuse_undecodable_requests_too(serving) -> None:
    with grpc.insecure_channel(serving.endpoint) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                               response_deserializer=health_pb2.HealthCheckResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            check(b"\x0a\x05ab", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable grpc.health.v1.HealthCheckRequest" in err.value.details()
        assert check(b"", timeout=30).status == health_pb2.HealthCheckResponse.SERVING
        info = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(info(iter([b"\x0a\x05ab"]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable grpc.reflection.v1alpha.ServerReflectionRequest" in err.value.details()
        assert "spin.v1.Generation" in ProtoReflectionDescriptorDatabase(ch).get_services()
