"""Allowed-token masks: packing, and the acceptance rule on restricted rows keeps the constrained
distribution (chi-square) with drafts cut where the constraint rejects them."""

import pytest
import torch
from chi_square import chi_square_p
from engine.test_rejection import DRAWS, PARAMS, SHAPES, V, draft_tree, target_logits

from spin.engine.rejection import verify_greedy, verify_stochastic
from spin.engine.sampling import probs_from_logits
from spin.engine.token_mask import (allows, apply_allowed, from_bytes, restrict_draft,
                                    to_bytes, unpack, words_per_row)
from spin.engine.tree import TokenTree


def pack(rows: list[set[int]], vocab: int) -> torch.Tensor:
    """[R, W] int32 words with the bits of ``rows`` set."""
    words = torch.zeros(len(rows), words_per_row(vocab), dtype=torch.int64)
    for r, allowed in enumerate(rows):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement


def test_words_round_trip_through_bytes_and_bits() -> None:
    rows = [{0, 31, 32, 63, 99}, set(), {5}]
    words = pack(rows, 100)
    assert words.shape == (3, 4)
    assert torch.equal(from_bytes(to_bytes(words), 4), words)
    bits = unpack(words, 100)
    assert [set(bits[r].nonzero().flatten().tolist()) for r in range(3)] == rows
    assert allows(words, 0, 31) and allows(words, 0, 99) and not allows(words, 0, 30)
    assert not allows(words, 2, 1000)  # past the words: not allowed
    assert unpack(words, 200)[:, 128:].sum() == 0
    with pytest.raises(ValueError, match="not whole rows"):
        from_bytes(to_bytes(words)[:-1], 4)


def test_disallowed_tokens_get_minus_infinity_and_empty_rows_stay() -> None:
    logits = torch.randn(3, 40)
    before = logits.clone()
    apply_allowed(logits, pack([{1, 33}, {39}, set(), {0}], 40))  # a fourth row is not used
    assert torch.isinf(logits[0]).sum() == 38 and logits[0, 33] == before[0, 33]
    assert logits[1].argmax() == 39
    assert torch.equal(logits[2], before[2])


def allowed_after(prefix: tuple[int, ...]) -> set[int]:
    """A grammar on the 5-token vocabulary of ``test_rejection``: never the token just emitted,
    and never 3 first."""
    if not prefix:
        return {0, 1, 2, 4}
    return set(range(V)) - {prefix[-1]}


def constrained(ctx: tuple[int, ...], tree: TokenTree) -> tuple[TokenTree, torch.Tensor]:
    """The tree cut where the grammar rejects a node (as the router cuts it) and its target
    rows restricted (as the verifier restricts them): [N' + 1, V] logits."""
    paths: dict[int, tuple[int, ...]] = {-1: ()}
    kept: list[int] = []
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        if p in paths and tok in allowed_after(ctx + paths[p]):
            paths[i] = paths[p] + (tok,)
            kept.append(i)
    prefixes = [ctx] + [ctx + paths[i] for i in kept]
    words = pack([allowed_after(p) for p in prefixes], V)
    logits = torch.stack([target_logits(p) for p in prefixes])
    apply_allowed(logits, words)
    return restrict_draft(tree.subtree(kept), words), logits


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_verification_on_restricted_rows_keeps_the_constrained_distribution(
        shape: str, sampled: bool) -> None:
    """Sampled drafts: each kept node's draft row restricted to what its parent's row allows
    (``restrict_draft``); deterministic ones verified as one-hot drafts."""
    torch.set_num_threads(1)
    params = PARAMS["t1"]
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(V, V)
    for _ in range(DRAWS // 4):
        out: tuple[int, ...] = ()
        while len(out) < 2:
            cut, logits = constrained(out, draft_tree(out, SHAPES[shape], params, sampled, gen))
            out += verify_stochastic(cut, probs_from_logits(logits, params), gen).tokens
        counts[out[0], out[1]] += 1

    def p(prefix: tuple[int, ...]) -> torch.Tensor:
        logits = target_logits(prefix).clone()[None]
        apply_allowed(logits, pack([allowed_after(prefix)], V))
        return probs_from_logits(logits[0], params)

    p1 = p(())
    joint = torch.stack([p1[a] * p((a,)) for a in range(V)])                          # [V, V]
    assert counts[3].sum() == 0 and counts.diagonal().sum() == 0  # never a disallowed token
    assert chi_square_p(counts.flatten(), joint.flatten()) > 0.01


def test_greedy_on_restricted_rows_takes_the_best_allowed_token() -> None:
    ctx = (1,)
    best = int(target_logits(ctx).argmax())
    tree = TokenTree.chain([best])
    logits = torch.stack([target_logits(ctx), target_logits(ctx + (best,))])
    apply_allowed(logits, pack([set(range(V)) - {best}, set(range(V))], V))
    verdict = verify_greedy(tree, logits)
    assert verdict.accepted == () and verdict.tokens[0] != best
    order = target_logits(ctx).argsort(descending=True).tolist()
    assert verdict.tokens == (order[1],)

