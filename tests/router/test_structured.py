"""Structured output through the services: every drafter kind gives the constrained greedy
output of the target alone, every output parses and follows its schema, the grammar drafts what
it forces, and a grammar that cannot compile is refused with the reason."""

from __future__ import annotations

import concurrent.futures
import json
import math

import grpc
import jsonschema
import pytest
from service_helpers import collect, request

from spin.v1 import generation_pb2, generation_pb2_grpc

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}
PROMPTS = ("Describe the user as JSON:\n", "def parse(path):\n    ", "The weather today is")


def grammar(schema: dict | None = None) -> generation_pb2.Grammar:
    return generation_pb2.Grammar(kind="json_schema", source=json.dumps(schema or SCHEMA))


def structured(endpoint: str, prompt: str, **kw) -> tuple[list[int], dict, object]:
    """(tokens, parsed output, last message) of a schema request; the output must validate."""
    kw.setdefault("max_tokens", 96)
    ids, text, last = collect(endpoint, request(prompt, grammar=grammar(), **kw))
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP, text
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return ids, value, last


@pytest.mark.parametrize("mode, drafter, k", [
    ("auto", "", 0), ("drafter", "grammar", 8), ("drafter", "draft-code", 4),
    ("drafter", "draft-prose", 0), ("drafter", "prompt-lookup", 4), ("drafter", "suffix", 6),
    ("drafter", "eagle", 4)])
def test_every_drafter_gives_the_constrained_greedy_output(serving, mode, drafter, k) -> None:
    for prompt in PROMPTS:
        off, _, _ = structured(serving.endpoint, prompt, mode="off")
        ids, _, last = structured(serving.endpoint, prompt, mode=mode, drafter=drafter, k=k)
        assert ids == off, (prompt, drafter)
        if drafter == "grammar":  # where several tokenizations of forced text are allowed
            used = {d.drafter: d for d in last.speculation.drafters}  # (one: jumped forward)
            assert used["grammar"].accepted_tokens >= 1


def test_sampled_outputs_follow_the_schema(serving) -> None:
    for seed in range(6):
        for mode in ("auto", "off"):
            structured(serving.endpoint, PROMPTS[seed % 3], mode=mode, temperature=1.0,
                       seed=seed)


def test_concurrent_schema_requests_match_their_outputs_alone(serving) -> None:
    """32 at once (batched, trees and chains as the policy picks): identical to speculation
    off, request by request."""
    prompts = [f"{PROMPTS[i % 3]}{i}" for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        auto = list(pool.map(lambda p: structured(serving.endpoint, p)[0], prompts))
        off = list(pool.map(lambda p: structured(serving.endpoint, p, mode="off")[0], prompts))
    assert auto == off


@pytest.mark.parametrize("kind, source, reason", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", '{"type": "bogus"}', "bogus"),
    ("regex", "((", "regex"),
    ("yaml", "a: 1", "kind must be one of"),
])
def test_a_grammar_that_cannot_compile_is_refused(serving, kind, source, reason) -> None:
    bad = request("x", grammar=generation_pb2.Grammar(kind=kind, source=source))
    with pytest.raises(grpc.RpcError) as e:
        collect(serving.endpoint, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in e.value.details()
    structured(serving.endpoint, PROMPTS[0])  # and the server goes on serving


def test_the_grammar_drafter_needs_a_grammar(serving) -> None:
    with pytest.raises(grpc.RpcError) as e:
        collect(serving.endpoint, request("x", mode="drafter", drafter="grammar"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in e.value.details()


def test_a_regex_grammar_bounds_the_output(serving) -> None:
    g = generation_pb2.Grammar(kind="regex", source="[0-9]{3}-[0-9]{4}")
    for mode in ("auto", "off"):
        ids, text, last = collect(serving.endpoint, request(PROMPTS[0], max_tokens=32,
                                                            grammar=g, mode=mode))
        assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit(), text


def test_log_probabilities_are_the_models_own_under_a_grammar(serving) -> None:
    """The grammar restricts what is emitted, not what is reported: every alternative has a
    finite log-probability of the unconstrained distribution."""
    with grpc.insecure_channel(serving.endpoint) as ch:
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(
            request(PROMPTS[0], max_tokens=32, grammar=grammar(), logprobs=3), timeout=120))
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == sum(len(m.token_ids) for m in msgs) > 0
    for lp in lps:
        assert len(lp.top_logprobs) == 3 and all(math.isfinite(v) for v in lp.top_logprobs)
        assert math.isfinite(lp.logprob) and lp.logprob <= lp.top_logprobs[0] + 1e-4


def constrained_greedy(target, tokenizer, prompt: str, schema: dict, max_tokens: int
                       ) -> list[int]:
    """Constrained greedy decoding of the target alone (transformers, one token a forward):
    the reference the services' output must equal, whatever drafted or jumped forward."""
    import torch

    from spin.engine.grammar import GrammarCompiler, GrammarSpec
    from spin.engine.token_mask import apply_allowed

    c = GrammarCompiler(tokenizer, target.config.vocab_size).constraint(
        GrammarSpec("json_schema", json.dumps(schema)))
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens and not c.done:
            logits = target(torch.tensor([ids + out])).logits[0, -1:].float()     # [1, V]
            apply_allowed(logits, c.allowed())
            tok = int(logits.argmax())
            if tok == tokenizer.eos_token_id:
                break
            c.advance([tok])
            out.append(tok)
    return out


def test_the_output_is_constrained_greedy_decoding_of_the_target_alone(
        serving, target, tokenizer) -> None:
    """Drafts, the grammar's drafts and its forced tokens appended unverified (jump-forward)
    change nothing: each output equals the target decoding alone under the grammar."""
    for prompt in PROMPTS:
        ref = constrained_greedy(target, tokenizer, prompt, SCHEMA, 96)
        for mode in ("auto", "off"):
            ids, _, _ = structured(serving.endpoint, prompt, mode=mode)
            assert ids == ref, (prompt, mode)
