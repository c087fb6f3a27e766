from pathlib import Path

import pytest
import torch

from spin.engine.drafter import DraftRequest, ModelDrafter, PromptLookupDrafter
from spin.engine.model_runner import ModelRunner
from spin.engine.sampling import SamplingParams


def test_prompt_lookup_drafter_proposes_a_chain() -> None:
    tree = PromptLookupDrafter().propose([DraftRequest("a", (1, 2, 3, 1, 2), 2)])[0]
    assert tree.tokens == (3, 1) and tree.is_chain


@pytest.fixture(scope="module")
def drafter(family_dir: Path) -> ModelDrafter:
    return ModelDrafter("draft-structured", ModelRunner(family_dir / "draft-structured", num_slots=4))


@torch.inference_mode()
def test_greedy_chain_is_the_drafts_own_greedy_rollout(drafter: ModelDrafter, draft_model) -> None:
    ctx = (5, 17, 300, 42, 9)
    tree = drafter.propose([DraftRequest("a", ctx, 4)])[0]
    ids = list(ctx)
    for _ in range(4):
        ids.append(int(draft_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert tree.tokens == tuple(ids[len(ctx):]) and tree.is_chain and tree.draft_probs is None
    drafter.release("a")


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
    """Rejected drafts and a context that grew elsewhere: the next proposal is still exact."""
    drafter.propose([DraftRequest("c", (1, 2, 3, 4), 4)])
    moved = (1, 2, 3, 9, 9, 8)  # diverges after 3 tokens and grows
    tree = drafter.propose([DraftRequest("c", moved, 1)])[0]
    with torch.inference_mode():
        want = int(draft_model(input_ids=torch.tensor([list(moved)])).logits[0, -1].argmax())
    assert tree.tokens == (want,)
    drafter.release("c")
    assert drafter.runner.cache.free_slots == 4


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
    again = drafter.propose([DraftRequest("s", ctx + short.tokens[:2], 4)])[0]
    assert again.tokens == tuple(ids[len(ctx) + 2:len(ctx) + 6])
    drafter.release("s")
    drafter.release("f")


@torch.inference_mode()
def test_sampled_chain_stops_by_its_draft_probabilities(drafter: ModelDrafter) -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    lengths = []
    for stop in (0.5, 0.05, 1e-4):
        tree = drafter.propose([DraftRequest("p", (3, 4, 5), 8, sampling=params,
                                             stop_below=stop)])[0]
        assert tree.draft_probs is not None
        sure = torch.cumprod(tree.draft_probs[torch.arange(len(tree.tokens)),
                                              torch.tensor(tree.tokens)], 0)       # [L]
        assert bool((sure[:-1] >= stop).all())  # every token but the last kept it above
        assert len(tree.tokens) == 8 or float(sure[-1]) < stop
        lengths.append(len(tree.tokens))
        drafter.release("p")
    assert min(lengths) < 8  # some chain did stop early


def test_sampled_drafts_ship_their_distributions(drafter: ModelDrafter) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, seed=5)
    tree = drafter.propose([DraftRequest("d", (3, 4, 5), 3, sampling=params)])[0]
    assert tree.draft_probs is not None and tree.draft_probs.shape[0] == 3
    assert torch.allclose(tree.draft_probs.sum(-1), torch.ones(3))
    assert all(float(tree.draft_probs[i, t]) > 0 for i, t in enumerate(tree.tokens))
    drafter.release("d")


@torch.inference_mode()
def test_score_is_greedy_agreement_and_its_prefill_is_reused(drafter: ModelDrafter,
                                                             draft_model) -> None:
    ctx = (5, 17, 300, 42, 9, 17, 300, 42, 8, 77, 5, 17)
    pred = draft_model(input_ids=torch.tensor([ctx])).logits[0].argmax(-1).tolist()
    want = sum(pred[j - 1] == ctx[j] for j in range(6, len(ctx)))  # positions 6.. only
    assert drafter.score([DraftRequest("s", ctx, 0)], [6]) == [(want, len(ctx) - 6)]
    longer = ctx + (300, 42)
    # a later round scores only tokens after ones the slot had not seen: the last new one (the
    # first new one was predicted from the previous round's last token)
    later = drafter.score([DraftRequest("s", longer, 0)], [6])
    assert later == [(int(int(draft_model(input_ids=torch.tensor([longer[:13]])).logits[0, -1]
                              .argmax()) == longer[13]), 1)]
    tree = drafter.propose([DraftRequest("s", longer, 3)])[0]  # drafts from the kept prefill
    drafter.release("s")
    fresh = drafter.propose([DraftRequest("t", longer, 3)])[0]
    drafter.release("t")
    assert tree.tokens == fresh.tokens
