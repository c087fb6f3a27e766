from pathlib import Path

import pytest
import torch

from spin.engine.drafter import DraftRequest, ModelDrafter, PromptLookupDrafter, Score
from spin.engine.model_runner import ModelRunner
from spin.engine.prompt_lookup import prompt_lookup
from spin.engine.sampling import SamplingParams, probs_from_logits
from spin.engine.sequences import step_seed

SMALL = 16 << 20
BLOCK = 2 * 1 * 2 * 64 * 4 * 16  # one KV block of draft-structured in fp32 (16 tokens)


def test_prompt_lookup_drafter_proposes_a_chain() -> None:
    tree = PromptLookupDrafter().propose([DraftRequest("a", (1, 2, 3, 1, 2), 2)])[0]
    assert tree.tokens == (3, 1) and tree.is_chain


def test_prompt_lookup_drafter_keeps_contexts_by_keep_and_delta() -> None:
    d = PromptLookupDrafter()
    d.propose([DraftRequest("a", (1, 2, 3, 1, 2), 2)])
    assert d.held("a") == 5 and d.held("b") == 0
    tree = d.propose([DraftRequest("a", (3, 4), 3, keep=5)])[0]
    assert tree.tokens == tuple(prompt_lookup([1, 2, 3, 1, 2, 3, 4], 3)) and d.held("a") == 7
    tree = d.propose([DraftRequest("a", (7, 1), 2, keep=2)])[0]  # 1 2 7 1 -> 2 7
    assert tree.tokens == (2, 7) and d.held("a") == 4
    d.release("a")
    d.release("a")
    assert d.held("a") == 0


@pytest.fixture(scope="module")
def drafter(family_dir: Path) -> ModelDrafter:
    return ModelDrafter("draft-structured",
                        ModelRunner(family_dir / "draft-structured", max_seqs=4,
                                    kv_cache_bytes=SMALL))


def _empty(d: ModelDrafter) -> bool:
    blocks = d.runner.cache.blocks
    return len(d.seqs) == 0 and blocks.free_seqs == blocks.max_seqs \
        and blocks.free_blocks == blocks.num_blocks


@torch.inference_mode()
def test_greedy_chain_is_the_drafts_own_greedy_rollout(drafter: ModelDrafter, draft_model) -> None:
    ctx = (5, 17, 300, 42, 9)
    tree = drafter.propose([DraftRequest("a", ctx, 4)])[0]
    ids = list(ctx)
    for _ in range(4):
        ids.append(int(draft_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert tree.tokens == tuple(ids[len(ctx):]) and tree.is_chain and tree.draft_probs is None
    assert drafter.held("a") == len(ctx)
    drafter.release("a")
    assert _empty(drafter)


@torch.inference_mode()
def test_tree_levels_follow_each_branch(drafter: ModelDrafter, draft_model) -> None:
    ctx = (11, 12, 13)
    tree = drafter.propose([DraftRequest("b", ctx, 3, branching=(2,))])[0]
    assert tree.parents == (-1, -1, 0, 1, 2, 3)  # two branches, each a chain of 3
    first = draft_model(input_ids=torch.tensor([list(ctx)])).logits[0, -1].topk(2).indices.tolist()
    assert list(tree.tokens[:2]) == first
    for leaf in (4, 5):  # each leaf is the draft's argmax after its own branch
        path, node = [], leaf
        while node >= 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        branch = list(ctx) + path[::-1][:-1]
        assert tree.tokens[leaf] == int(draft_model(input_ids=torch.tensor([branch])).logits[0, -1].argmax())
    drafter.release("b")


def test_catch_up_after_the_context_moved(drafter: ModelDrafter, draft_model) -> None:
    """Rejected drafts and a context that grew elsewhere: the next proposal is still exact,
    whether the caller sends the whole context (keep=0) or only what changed."""
    drafter.propose([DraftRequest("c", (1, 2, 3, 4), 4)])
    moved = (1, 2, 3, 9, 9, 8)  # diverges after 3 tokens and grows
    tree = drafter.propose([DraftRequest("c", moved, 1)])[0]
    with torch.inference_mode():
        want = int(draft_model(input_ids=torch.tensor([list(moved)])).logits[0, -1].argmax())
    assert tree.tokens == (want,)
    drafter.propose([DraftRequest("d", (1, 2, 3, 4), 4)])
    assert drafter.propose([DraftRequest("d", (9, 9, 8), 1, keep=3)])[0].tokens == (want,)
    drafter.release("c")
    drafter.release("d")
    assert _empty(drafter)


@torch.inference_mode()
def test_chain_stops_once_its_probability_falls_below_stop_below(drafter: ModelDrafter,
                                                                 draft_model) -> None:
    """The chain keeps the token whose probability takes it below the line, then stops; a
    request beside it in the batch without the setting drafts all k; the next proposal after
    an early stop is still the draft's own rollout."""
    ctx = (5, 17, 300, 42, 9)
    ids, sure = list(ctx), [1.0]
    for _ in range(6):
        probs = draft_model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
        ids.append(int(probs.argmax()))
        sure.append(sure[-1] * float(probs.max()))  # sure[i]: the first i tokens' probability
    assert sure[2] > sure[3]
    stop = (sure[2] + sure[3]) / 2  # crossed by the third token
    short, full = drafter.propose([DraftRequest("s", ctx, 6, stop_below=stop),
                                   DraftRequest("f", ctx, 6)])
    assert short.tokens == tuple(ids[len(ctx):len(ctx) + 3]) and short.is_chain
    assert full.tokens == tuple(ids[len(ctx):])
    again = drafter.propose([DraftRequest("s", short.tokens[:2], 4, keep=len(ctx))])[0]
    assert again.tokens == tuple(ids[len(ctx) + 2:len(ctx) + 6])
    drafter.release("s")
    drafter.release("f")


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    p = probs.float()
    return p / p.sum(-1, keepdim=True)


@torch.inference_mode()
def test_sampled_chain_stops_by_its_draft_probabilities(drafter: ModelDrafter) -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    lengths = []
    for stop in (0.5, 0.05, 1e-4):
        tree = drafter.propose([DraftRequest("p", (3, 4, 5), 8, sampling=params,
                                             stop_below=stop)])[0]
        assert tree.draft_probs is not None
        q = _normalised(tree.draft_probs)  # the distribution each token was drawn from
        sure = torch.cumprod(q[torch.arange(len(tree.tokens)), torch.tensor(tree.tokens)], 0)
        assert bool((sure[:-1] >= stop).all())  # every token but the last kept it above
        assert len(tree.tokens) == 8 or float(sure[-1]) < stop
        lengths.append(len(tree.tokens))
        drafter.release("p")
    assert min(lengths) < 8  # some chain did stop early


@torch.inference_mode()
def test_sampled_drafts_ship_the_fp16_rows_they_were_drawn_from(drafter: ModelDrafter,
                                                                  draft_model) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, seed=5)
    ctx = (3, 4, 5)
    tree = drafter.propose([DraftRequest("d", ctx, 3, sampling=params)])[0]
    assert tree.draft_probs is not None and tree.draft_probs.shape == (3, 4096)
    assert tree.draft_probs.dtype == torch.float16
    assert torch.allclose(tree.draft_probs.float().sum(-1), torch.ones(3), atol=1e-3)
    assert all(float(tree.draft_probs[i, t]) > 0 for i, t in enumerate(tree.tokens))
    want = probs_from_logits(draft_model(input_ids=torch.tensor([ctx])).logits[0, -1], params)
    assert torch.allclose(tree.draft_probs[0].float(), want, atol=1e-3)
    # the draws replay from the shipped rows with the request's stream for this step (seeded
    # from the seed + 1 on a drafter and the context length: Sequences.generator)
    gen = torch.Generator().manual_seed(step_seed(params.seed + 1, len(ctx)))
    replay = [int(torch.multinomial(row.float(), 1, replacement=True, generator=gen))
              for row in tree.draft_probs]
    assert tuple(replay) == tree.tokens
    drafter.release("d")


@torch.inference_mode()
def test_score_is_greedy_agreement_and_its_prefill_is_reused(drafter: ModelDrafter,
                                                             draft_model) -> None:
    ctx = (5, 17, 300, 42, 9, 17, 300, 42, 8, 77, 5, 17)
    pred = draft_model(input_ids=torch.tensor([ctx])).logits[0].argmax(-1).tolist()
    want = sum(pred[j - 1] == ctx[j] for j in range(6, len(ctx)))  # positions 6.. only
    assert drafter.score([DraftRequest("s", ctx, 0)], [6]) == [Score(want, len(ctx) - 6)]
    longer = ctx + (300, 42)
    # a later round scores only tokens after ones the cache had not seen: the last new one (the
    # first new one was predicted from the previous round's last token)
    later = drafter.score([DraftRequest("s", (300, 42), 0, keep=len(ctx))], [6])
    assert later == [Score(int(int(draft_model(input_ids=torch.tensor([longer[:13]])).logits[0, -1]
                                   .argmax()) == longer[13]), 1)]
    tree = drafter.propose([DraftRequest("s", (), 3, keep=len(longer))])[0]  # the kept prefill
    drafter.release("s")
    fresh = drafter.propose([DraftRequest("t", longer, 3)])[0]
    drafter.release("t")
    assert tree.tokens == fresh.tokens


@torch.inference_mode()
def test_a_sampled_score_estimates_acceptance_from_the_target_probabilities(
        drafter: ModelDrafter, draft_model) -> None:
    """With the target's probability p(x) of each output token, a sampling request's score adds
    min(1, q(x) / p(x)) over the scored positions whose p is known (q: the drafter's processed
    distribution); a greedy request's score has no such estimate."""
    ctx = (5, 17, 300, 42, 9, 17, 300, 42, 8, 77, 5, 17)
    p = [0.0] * 6 + [0.5, 0.2, 0.0, 0.05, 0.9, 0.3]  # the prompt's and position 8 unknown
    params = SamplingParams(temperature=1.5, top_k=2000, seed=1)  # q(x) > 0 for these tokens
    q = probs_from_logits(draft_model(input_ids=torch.tensor([ctx])).logits[0], params)
    want = sum(min(1.0, float(q[j - 1, ctx[j]]) / p[j]) for j in range(6, len(ctx)) if p[j])
    greedy = draft_model(input_ids=torch.tensor([ctx])).logits[0].argmax(-1).tolist()
    matches = sum(greedy[j - 1] == ctx[j] for j in range(6, len(ctx)))
    got = drafter.score([DraftRequest("s", ctx, 0, sampling=params, context_probs=p)], [6])[0]
    drafter.release("s")
    assert (got.matches, got.positions, got.accepted_positions) == (matches, 6, 5)
    assert got.accepted == pytest.approx(want, rel=1e-4) and want > 0
    # a later round: the probabilities line up with the delta (positions keep, keep + 1, ...);
    # it scores position 11 only (10 follows a token the cache had seen)
    drafter.score([DraftRequest("s", ctx[:10], 0, sampling=params)], [6])
    later = drafter.score([DraftRequest("s", ctx[10:], 0, sampling=params, keep=10,
                                        context_probs=p[10:])], [6])[0]
    drafter.release("s")
    assert (later.positions, later.accepted_positions) == (1, 1)
    assert later.accepted == pytest.approx(min(1.0, float(q[10, ctx[11]]) / p[11]), rel=1e-4)
    plain = drafter.score([DraftRequest("g", ctx, 0, context_probs=p)], [6])[0]
    drafter.release("g")
    assert plain == Score(matches, 6)


def _ctx(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def test_idle_caches_are_evicted_and_catch_up(family_dir: Path, drafter: ModelDrafter) -> None:
    """Six blocks of 16 tokens: drafting a second request evicts the idle first one (least
    recently used); drafted again, the first catches up and drafts what a drafter that never
    evicted drafts."""
    tiny = ModelDrafter("tiny", ModelRunner(family_dir / "draft-structured", max_seqs=4,
                                            kv_cache_bytes=6 * BLOCK))
    blocks = tiny.runner.cache.blocks
    assert blocks.num_blocks == 6
    a, b = _ctx(1, 40), _ctx(2, 50)
    trees = {rid: tiny.propose([DraftRequest(rid, ctx, 4)])[0] for rid, ctx in (("a", a), ("b", b))}
    assert tiny.evictions == 1  # a (3 blocks) made room for b (4 blocks)
    assert tiny.seqs["a"].context == list(a) and blocks.lengths[tiny.seqs["a"].seq] == 0
    assert tiny.held("a") == 40  # the context stays: the router's keep still holds
    grown = (trees["a"].tokens[0], 77)
    again = tiny.propose([DraftRequest("a", grown, 4, keep=len(a))])[0]
    assert tiny.evictions == 2  # now b was idle
    ref = [drafter.propose([DraftRequest("ref", a, 4)])[0],
           drafter.propose([DraftRequest("ref", grown, 4, keep=len(a))])[0]]
    drafter.release("ref")
    ref_b = drafter.propose([DraftRequest("ref", b, 4)])[0]
    drafter.release("ref")
    assert trees["a"].tokens == ref[0].tokens and len(ref[0]) == 4
    assert again.tokens == ref[1].tokens and trees["b"].tokens == ref_b.tokens
    for rid in ("a", "b"):
        tiny.release(rid)
    assert _empty(tiny)


def test_the_batchs_youngest_get_no_draft_when_blocks_run_out(family_dir: Path,
                                                               drafter: ModelDrafter) -> None:
    tiny = ModelDrafter("tiny", ModelRunner(family_dir / "draft-structured", max_seqs=4,
                                            kv_cache_bytes=6 * BLOCK))
    a, b = _ctx(3, 40), _ctx(4, 50)  # 3 + 4 blocks > 6
    ta, tb = tiny.propose([DraftRequest("a", a, 4), DraftRequest("b", b, 4)])
    assert len(ta) == 4 and len(tb) == 0 and tiny.evictions == 0
    assert tiny.held("b") == 50  # admitted, its context kept: drafted later without a resync
    tiny.release("a")
    tb = tiny.propose([DraftRequest("b", (), 4, keep=50)])[0]
    assert tb.tokens == drafter.propose([DraftRequest("ref", b, 4)])[0].tokens
    drafter.release("ref")
    tiny.release("b")
    assert _empty(tiny)
