"""A task asking for several plain steps (``VerifyTask.steps``): the verifier's further forwards
emit what as many one-step calls would, token for token, and stop where they must."""

from __future__ import annotations

import grpc
import pytest
from transformers import AutoTokenizer

from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ModelRunner, RunnerConfig
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier
from spin.rpc.convert import sampling_to_proto, tree_to_proto
from spin.v1 import verifier_pb2
from spin.verifier.server import MAX_PLAIN_STEPS, BatchRejected, VerifierService
from spin.zoo.corpus import heldout_prompts
from spin.zoo.specs import FAMILY_DIR

PATH = FAMILY_DIR / "target"
KV = 32 << 20


@pytest.fixture(scope="module")
def service() -> VerifierService:
    return VerifierService(PATH, RunnerConfig(device="cpu", max_seqs=4, kv_cache_memory=KV))


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    tok = AutoTokenizer.from_pretrained(PATH)
    rows = heldout_prompts(FAMILY_DIR, ("code",))[:2]
    return [tuple(tok.encode(r["prompt"], add_special_tokens=False)[-n:])
            for r, n in zip(rows, (30, 21))]


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return SpecEngine(Verifier(ModelRunner(PATH, max_seqs=2, kv_cache_bytes=KV)), {})


def _task(rid: str, keep: int, delta=(), steps: int = 0, stop=(), sampling=SamplingParams(),
          tree: TokenTree | None = None, logprobs: int | None = None) -> verifier_pb2.VerifyTask:
    return verifier_pb2.VerifyTask(request_id=rid, keep=keep, context_delta=list(delta),
                                   tree=tree_to_proto(tree or TokenTree((), ())),
                                   sampling=sampling_to_proto(sampling), steps=steps,
                                   stop_token_ids=list(stop), logprobs=logprobs)


def _run(service: VerifierService, *tasks: verifier_pb2.VerifyTask, release=()):
    return service.run_batch(verifier_pb2.VerifyRequest(batch_id=1, tasks=list(tasks),
                                                        release=list(release))).results


@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=0.8, top_p=0.95, seed=77)],
                         ids=["greedy", "seeded"])
def test_multi_step_calls_emit_what_the_target_alone_does(service, engine, prompts,
                                                          sampling) -> None:
    """Two requests in one batch, one asking for 5 steps a call and one for 1: over three calls
    the first emits 15 tokens (each call's last one taken in as context by the next), the
    other 3, both equal to the engine's decoding alone (greedy, and seeded sampling)."""
    want = [engine.generate([GenerationRequest(f"w{i}", p, 15, sampling)])[0].tokens
            for i, p in enumerate(prompts)]
    a, b = prompts
    out: dict[str, list[int]] = {"a": [], "b": []}
    for call in range(3):
        first = call == 0
        ra, rb = _run(service, _task("a", 0 if first else len(a) + len(out["a"]),
                                     a if first else (), 5, sampling=sampling),
                      _task("b", 0 if first else len(b) + len(out["b"]), b if first else (),
                            sampling=sampling))
        assert len(ra.tokens) == 5 and len(rb.tokens) == 1 and ra.num_accepted == 0
        assert len(ra.token_probs) == (0 if sampling.greedy else 5)
        out["a"] += ra.tokens
        out["b"] += rb.tokens
    _run(service, release=["a", "b"])
    assert out["a"] == want[0] and out["b"] == want[1][:3]


def test_a_multi_step_task_stops_after_a_stop_token_and_at_the_context_limit(
        engine, prompts, service) -> None:
    want = engine.generate([GenerationRequest("w", prompts[0], 8)])[0].tokens
    stop = want[2]
    first = want.index(stop)  # the first time the stop token comes
    (res,) = _run(service, _task("a", 0, prompts[0], 8, stop=(stop,), logprobs=2))
    assert list(res.tokens) == want[:first + 1] and len(res.logprobs) == first + 1
    _run(service, release=["a"])
    small = VerifierService(PATH, RunnerConfig(device="cpu", max_seqs=1, max_model_len=16))
    (res,) = _run(small, _task("a", 0, tuple(range(100, 113)), 10))  # 13 tokens of 16
    assert len(res.tokens) == 3  # the context is then full; nothing raised


@pytest.mark.parametrize("bad", ["tree", "too-many"])
def test_more_than_one_step_for_a_drafting_task_is_rejected(service, prompts, bad) -> None:
    task = (_task("a", 0, prompts[0], 4, tree=TokenTree.chain([5, 6])) if bad == "tree"
            else _task("a", 0, prompts[0], MAX_PLAIN_STEPS + 1))
    blocks = service.verifier.runner.cache.blocks
    free = blocks.free_seqs, blocks.free_blocks
    with pytest.raises(BatchRejected) as e:
        _run(service, _task("ok", 0, prompts[1]), task)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(e.value).startswith("a: ")
    assert (blocks.free_seqs, blocks.free_blocks) == free  # no forward ran
