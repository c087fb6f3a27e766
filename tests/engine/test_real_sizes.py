"""Lossless at real sizes: random-initialised checkpoints of real architectures and vocabularies
(``tests/real_sizes.py``: Llama-3, Qwen2 with a differently padded draft, Mistral), greedy
speculative output equal to the target decoding alone in the same dtype, token for token, for
chains and trees at batches of 1, 4 and 16, in float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from real_sizes import ARCHS, make_pair, prompts
from spin.engine.drafter import ModelDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ModelRunner
from spin.engine.verifier import Verifier

NEW = 24
SHAPES = {"chain": (4, ()), "tree": (3, (2, 2))}
BUDGET = 96 << 20


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("real-sizes")
    return {arch: make_pair(arch, root) for arch in ARCHS}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine_and_reference(request, pairs, arch) -> tuple[SpecEngine, list[tuple[int, ...]],
                                                        list[list[int]]]:
    """The engine in one dtype, 16 prompts, and the target's greedy continuations decoded alone
    (each request in a batch of its own, no drafts)."""
    target, draft = pairs[arch]
    dtype = request.param
    verifier = Verifier(ModelRunner(target, dtype=dtype, kv_cache_bytes=BUDGET))
    drafter = ModelDrafter("draft", ModelRunner(draft, dtype=dtype, kv_cache_bytes=BUDGET,
                                                vocab_limit=ARCHS[arch].tokens))
    engine = SpecEngine(verifier, {"draft": drafter}, eos_id=None)
    ps = prompts(16, ARCHS[arch].tokens, seed=len(arch))
    alone = [engine.generate([GenerationRequest(f"alone-{i}", p, NEW)])[0].tokens
             for i, p in enumerate(ps)]
    return engine, ps, alone


def test_the_runner_holds_the_real_architecture(pairs, arch) -> None:
    spec = ARCHS[arch]
    target = ModelRunner(pairs[arch][0], kv_cache_bytes=BUDGET)
    draft = ModelRunner(pairs[arch][1], kv_cache_bytes=BUDGET, vocab_limit=spec.tokens)
    assert target.vocab_size == spec.vocab and draft.vocab_size == spec.draft_vocab
    assert draft.vocab_limit == min(spec.tokens, spec.draft_vocab)
    assert target.kv_heads < target.heads  # grouped-query attention
    assert (target.layers[0].qkv_bias is not None) == (arch == "qwen2")
    # the cache is sized by the budget, never by the model's context (131072 for llama3)
    assert target.max_len == min(target.config.max_position_embeddings,
                                 target.cache.blocks.capacity_tokens)
    assert target.cache.nbytes <= BUDGET


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_speculation_equals_the_target_alone(engine_and_reference, shape, batch) -> None:
    engine, ps, alone = engine_and_reference
    k, branching = SHAPES[shape]
    reqs = [GenerationRequest(f"{shape}-{batch}-{i}", p, NEW, drafter="draft", k=k,
                              branching=branching) for i, p in enumerate(ps[:batch])]
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == alone[:batch]
    accepted = sum(r.accepted for r in results)
    assert accepted > 0 and (batch == 1 or accepted < sum(r.drafted for r in results))
    blocks = engine.verifier.runner.cache.blocks
    assert blocks.free_blocks == blocks.num_blocks and len(engine.verifier.seqs) == 0


def test_the_padded_draft_never_proposes_an_id_past_the_tokenizer(pairs) -> None:
    """Qwen2: the draft scores only the tokenizer's 151665 ids, although its embedding has
    151936 rows and the target's 152064."""
    spec = ARCHS["qwen2"]
    drafter = ModelDrafter("draft", ModelRunner(pairs["qwen2"][1], kv_cache_bytes=BUDGET,
                                                vocab_limit=spec.tokens))
    from spin.engine.drafter import DraftRequest
    from spin.engine.sampling import SamplingParams

    ps = prompts(4, spec.tokens, seed=3)
    trees = drafter.propose([DraftRequest(f"s{i}", p, 6, (2,), SamplingParams(1.5, seed=i))
                             for i, p in enumerate(ps)])
    assert all(len(t) and max(t.tokens) < spec.tokens for t in trees)
    assert all(t.draft_probs.shape[-1] == spec.tokens for t in trees)
    assert all(t.draft_probs.dtype == torch.float16 for t in trees)
