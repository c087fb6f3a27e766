"""The router's request checks in process: ``router/validation.py`` on plain requests (each
limit), and the gRPC adapter's conversion (``router/server.py``) in front of it: nothing but
ValueError ever escapes, whatever a decodable message holds."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from spin.router.server import check_enums, client_request
from spin.router.validation import (
    MAX_K,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    PROMPT_CHARS_PER_TOKEN,
    ClientRequest,
    SpeculationRequest,
    validate,
)
from spin.v1 import generation_pb2, sampling_pb2

CONTEXT, VOCAB = 64, 100
DRAFTERS = {"draft-code", "prompt-lookup"}


def tokenize(text: str) -> list[int]:
    """One token per character (code point modulo the vocabulary)."""
    return [ord(c) % VOCAB for c in text]


def parse(req: generation_pb2.GenerateRequest | ClientRequest, tok=tokenize):
    """A gRPC message through the adapter's conversion, then the checks (or a plain request
    through the checks alone)."""
    plain = client_request(req) if isinstance(req, generation_pb2.GenerateRequest) else req
    return validate(plain, tok, CONTEXT, VOCAB, lambda: DRAFTERS)


def valid(**kw) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(prompt="hello", max_tokens=4, **kw)
    req.speculation.mode = generation_pb2.SPECULATION_MODE_DRAFTER
    req.speculation.drafter, req.speculation.k = "draft-code", 3
    return req


def test_a_valid_request_becomes_a_router_request() -> None:
    r = parse(valid(request_id="r1", stop=["x"] * MAX_STOP_STRINGS)).params
    assert (r.request_id, r.prompt, r.max_tokens, r.mode, r.drafter, r.k) == (
        "r1", tuple(tokenize("hello")), 4, "drafter", "draft-code", 3)
    assert parse(valid()).request_id  # one is assigned
    edge = valid(stop=["s" * MAX_STOP_CHARS])
    edge.speculation.k = MAX_K
    edge.sampling.CopyFrom(sampling_pb2.SamplingParams(temperature=1e-40, top_p=1e-30, top_k=1))
    assert parse(edge).params.k == MAX_K


def test_a_plain_request_is_checked_as_the_message_is() -> None:
    """What the HTTP adapter builds: the same checks and messages, no protobuf."""
    ok = ClientRequest(prompt_token_ids=(1, 2, 3), max_tokens=4, temperature=0.7, top_p=0.9,
                       seed=2**63 - 1, stop=("x",), logprobs=2, request_id="plain",
                       speculation=SpeculationRequest("drafter", "draft-code", 3, True))
    r = parse(ok).params
    assert (r.prompt, r.sampling.seed, r.drafter, r.k, r.early_stop, r.logprobs) == (
        (1, 2, 3), 2**63 - 1, "draft-code", 3, True, 2)
    bad = {"sampling.temperature must be finite": dict(temperature=float("nan")),
           "sampling.top_p must be in": dict(top_p=0.0),
           "sampling.top_k must be >= 0": dict(top_k=2**31),
           "sampling.seed must be a 64-bit integer": dict(seed=2**63),
           r"speculation.mode 'sometimes' is not one of": dict(
               speculation=SpeculationRequest("sometimes")),
           r"prompt_token_ids must lie in \[0, 100\)": dict(prompt_token_ids=(2**40,)),
           "exceeds the context": dict(max_tokens=2**40),
           r"logprobs must be in \[0, 20\]": dict(logprobs=21),
           "unknown drafter 'nope'": dict(speculation=SpeculationRequest("drafter", "nope"))}
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            parse(replace(ok, **change))


def test_enums_are_checked_in_nested_messages() -> None:
    req = valid()
    req.speculation.mode = 7
    with pytest.raises(ValueError, match=r"speculation\.mode 7 is not a SpeculationMode"):
        check_enums(req)
    resp = generation_pb2.GenerateResponse(finish_reason=9)
    with pytest.raises(ValueError, match="finish_reason 9 is not a FinishReason"):
        check_enums(resp)


def test_limits_are_checked_before_the_work() -> None:
    calls: list[str] = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return tokenize(text)

    with pytest.raises(ValueError, match="prompt has"):
        parse(generation_pb2.GenerateRequest(prompt="a" * (PROMPT_CHARS_PER_TOKEN * CONTEXT + 1),
                                             max_tokens=1), counting)
    with pytest.raises(ValueError, match="stop has"):
        parse(valid(stop=["x"] * (MAX_STOP_STRINGS + 1)), counting)
    assert not calls  # refused without tokenizing
    with pytest.raises(ValueError, match="prompt_token_ids has"):
        parse(generation_pb2.GenerateRequest(prompt_token_ids=[-1] * CONTEXT, max_tokens=1))


def test_a_tokenizer_error_is_a_value_error() -> None:
    def broken(text: str) -> list[int]:
        raise RuntimeError("no such piece")

    with pytest.raises(ValueError, match="prompt cannot be tokenized.*no such piece"):
        parse(valid(), broken)


def test_only_value_errors_escape_whatever_the_message_holds() -> None:
    rng = random.Random(3)
    base = valid(request_id="abc", stop=["\n"], sampling=sampling_pb2.SamplingParams(
        temperature=0.5, top_p=0.9, top_k=5, seed=1)).SerializeToString()
    outcomes = {"ok": 0, "ValueError": 0}
    decoded = 0
    while decoded < 3000:
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            req = generation_pb2.GenerateRequest.FromString(bytes(data))
        except Exception:  # noqa: BLE001 - undecodable: rpc/decode.py's business
            continue
        decoded += 1
        try:
            parse(req)
            outcomes["ok"] += 1
        except ValueError as e:
            assert str(e)
            outcomes["ValueError"] += 1
    assert outcomes["ok"] > 0 and outcomes["ValueError"] > 0, outcomes
