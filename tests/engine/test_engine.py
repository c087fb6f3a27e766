"""Lossless: greedy speculative output equals target-alone greedy, token for token."""

from pathlib import Path

import pytest
import torch

from spin.engine.drafter import ModelDrafter, PromptLookupDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ModelRunner
from spin.engine.sampling import SamplingParams
from spin.engine.verifier import Verifier
from spin.zoo.corpus import heldout_prompts
from spin.zoo.distill import greedy_continue

NEW = 32
LENGTHS = (8, 24, 64, 120)
SLOTS = 16
TARGET_KV, DRAFT_KV = 96 << 20, 16 << 20  # 250 and 2000 blocks of 16 tokens


@pytest.fixture(scope="module")
def engine(family_dir: Path, tokenizer) -> SpecEngine:
    drafters = {name: ModelDrafter(name, ModelRunner(family_dir / name, max_seqs=SLOTS,
                                                     kv_cache_bytes=DRAFT_KV))
                for name in ("draft-structured", "draft-code", "draft-prose", "draft-general")}
    drafters["prompt-lookup"] = PromptLookupDrafter()
    verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=SLOTS,
                                    kv_cache_bytes=TARGET_KV))
    return SpecEngine(verifier, drafters, eos_id=None)  # never stop early: compare NEW tokens


@pytest.fixture(scope="module")
def cases(family_dir: Path, tokenizer, target) -> list[tuple[tuple[int, ...], list[int]]]:
    """200 held-out prompts of mixed lengths with the target's greedy continuation (transformers)."""
    rows = heldout_prompts(family_dir)
    out = []
    for g, length in enumerate(LENGTHS):
        prompts = []
        for row in rows[g::len(LENGTHS)][:50]:
            ids = tokenizer(row["prompt"] + row["reference"], add_special_tokens=False)["input_ids"]
            prompts.append(ids[:length])
        ref = greedy_continue(target, torch.tensor(prompts), NEW).tolist()
        out += [(tuple(p), r) for p, r in zip(prompts, ref)]
    return out


def _free(engine: SpecEngine) -> None:
    """Every request released: no sequence id, block or context is left behind."""
    runners = {"target": engine.verifier.runner}
    runners.update((d.name, d.runner) for d in engine.drafters.values()
                   if isinstance(d, ModelDrafter))
    for name, runner in runners.items():
        blocks = runner.cache.blocks
        assert blocks.free_seqs == SLOTS and blocks.free_blocks == blocks.num_blocks, name
    assert len(engine.verifier.seqs) == 0
    assert all(len(d.seqs) == 0 for d in engine.drafters.values() if isinstance(d, ModelDrafter))
    assert all(d.held("x") == 0 for d in engine.drafters.values())


def test_target_alone_through_the_engine_equals_transformers(engine: SpecEngine, cases) -> None:
    reqs = [GenerationRequest(f"t{i}", p, NEW) for i, (p, _) in enumerate(cases[::13])]
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == [ref for _, ref in cases[::13]]
    assert all(r.steps == NEW and r.accepted == 0 for r in results)
    _free(engine)


def test_mixed_batches_of_16_every_drafter_k_chain_and_tree(engine: SpecEngine, cases) -> None:
    names = sorted(engine.drafters)
    mismatches, accepted, rejected = [], 0, 0
    for start in range(0, len(cases), 16):
        reqs = []
        for i in range(start, min(start + 16, len(cases))):
            reqs.append(GenerationRequest(
                f"m{i}", cases[i][0], NEW, drafter=names[i % len(names)],
                k=(1, 2, 4, 8)[(i // len(names)) % 4], branching=(2,) if i % 3 == 0 else ()))
        for req, res in zip(reqs, engine.generate(reqs)):
            if res.tokens != cases[int(req.request_id[1:])][1]:
                mismatches.append(req)
            accepted += res.accepted
            rejected += res.drafted - res.accepted
    assert not mismatches, f"{len(mismatches)} speculative outputs differ, e.g. {mismatches[0]}"
    assert accepted > 0 and rejected > 0  # both acceptance and rollback were exercised
    _free(engine)


@pytest.mark.parametrize("batch", [1, 4])
def test_small_batches(engine: SpecEngine, cases, batch: int) -> None:
    subset = cases[5:5 + 2 * batch]
    for start in range(0, len(subset), batch):
        chunk = subset[start:start + batch]
        reqs = [GenerationRequest(f"s{start + j}", p, NEW, drafter="draft-code", k=4)
                for j, (p, _) in enumerate(chunk)]
        assert [r.tokens for r in engine.generate(reqs)] == [ref for _, ref in chunk]
    _free(engine)


def test_drafter_switches_every_step(engine: SpecEngine, cases) -> None:
    names = sorted(engine.drafters)

    def rotate(req, res):
        return names[res.steps % len(names)], 1 + res.steps % 5, (2,) if res.steps % 2 else ()

    chunk = cases[100:116]
    results = engine.generate([GenerationRequest(f"w{i}", p, NEW) for i, (p, _) in enumerate(chunk)],
                              choose=rotate)
    assert [r.tokens for r in results] == [ref for _, ref in chunk]
    assert all(len(set(r.drafters)) >= 3 for r in results)
    _free(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(engine: SpecEngine, cases) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=21)
    alone = engine.generate([GenerationRequest("x", cases[0][0], 24, params, "draft-structured", 3)])
    crowd = engine.generate([GenerationRequest("x", cases[0][0], 24, params, "draft-structured", 3)] + [
        GenerationRequest(f"o{i}", p, 24, SamplingParams(temperature=1.0, seed=i), "draft-code", 2)
        for i, (p, _) in enumerate(cases[1:6])])
    assert alone[0].tokens == crowd[0].tokens
    _free(engine)


def test_bad_requests_are_refused(engine: SpecEngine) -> None:
    with pytest.raises(ValueError, match="unknown drafter"):
        engine.generate([GenerationRequest("u", (1, 2), 4, drafter="nope")])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([GenerationRequest("e", (), 4)])
    with pytest.raises(ValueError, match="context"):
        engine.generate([GenerationRequest("c", (1,) * 1000, 100)])
    _free(engine)
