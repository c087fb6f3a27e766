"""Verification keeps the target distribution (chi-square) and greedy equals target-alone."""

from dataclasses import replace
from functools import lru_cache

import pytest
import torch
from chi_square import chi_square_p

from spin.engine import rejection
from spin.engine.rejection import (emitted_probs, walk_host, num_uniforms, stochastic_path,
                                   verify_batch, verify_greedy, verify_stochastic)
from spin.engine.sampling import SamplingParams, probs_from_logits
from spin.engine.tree import TokenTree

V = 5
DRAWS = 20_000


@lru_cache(maxsize=None)
def _raw(ctx: tuple[int, ...], salt: int) -> torch.Tensor:
    seed = salt + 10 * (1 + sum((t + 1) * 7 ** i for i, t in enumerate(ctx)))
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def target_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    """A small-vocabulary 'model': fixed logits for every context."""
    return _raw(ctx, 0)


def draft_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    """A draft correlated with the target but different from it."""
    return 0.6 * _raw(ctx, 0) + 0.8 * _raw(ctx, 1)


def draft_tree(ctx: tuple[int, ...], parents: tuple[int, ...], params: SamplingParams,
               sampled: bool, gen: torch.Generator) -> TokenTree:
    """Sampled: each node drawn from q at its position (siblings i.i.d.). Else top-b of q."""
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    paths: list[tuple[int, ...]] = []
    for i, p in enumerate(parents):
        prefix = ctx if p < 0 else ctx + paths[p]
        q = probs_from_logits(draft_logits(prefix), params)
        if sampled:
            tok = int(torch.multinomial(q, 1, generator=gen))
        else:
            rank = sum(1 for j in range(i) if parents[j] == p)
            tok = int(q.argsort(descending=True)[rank])
        tokens.append(tok)
        rows.append(q)
        paths.append((() if p < 0 else paths[p]) + (tok,))
    return TokenTree(tuple(tokens), parents, torch.stack(rows) if sampled else None)


def target_rows(ctx: tuple[int, ...], tree: TokenTree, params: SamplingParams) -> torch.Tensor:
    paths: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        paths.append((() if p < 0 else paths[p]) + (tok,))
    rows = [target_logits(ctx)] + [target_logits(ctx + path) for path in paths]
    return probs_from_logits(torch.stack(rows), params)  # [N + 1, V]


def first_two_tokens(parents: tuple[int, ...], params: SamplingParams, sampled: bool,
                     gen: torch.Generator) -> tuple[int, int]:
    out: tuple[int, ...] = ()
    while len(out) < 2:
        tree = draft_tree(out, parents, params, sampled, gen)
        out += verify_stochastic(tree, target_rows(out, tree, params), gen).tokens
    return out[0], out[1]


SHAPES = {"chain": (-1, 0, 1), "tree": (-1, -1, 0, 1, 2)}
PARAMS = {"t1": SamplingParams(temperature=1.0),
          "t07-topk3-topp09": SamplingParams(temperature=0.7, top_k=3, top_p=0.9)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("params_name", PARAMS)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_emitted_tokens_follow_the_target(shape: str, params_name: str, sampled: bool) -> None:
    torch.set_num_threads(1)
    params = PARAMS[params_name]
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V)
    for _ in range(DRAWS):
        a, b = first_two_tokens(SHAPES[shape], params, sampled, gen)
        counts[a, b] += 1
    p1 = probs_from_logits(target_logits(()), params)                               # [V]
    p2 = torch.stack([probs_from_logits(target_logits((a,)), params) for a in range(V)])  # [V, V]
    assert chi_square_p(counts.sum(1), p1) > 0.01           # first token
    assert chi_square_p(counts.flatten(), (p1[:, None] * p2).flatten()) > 0.01  # first two jointly


def test_the_check_detects_a_biased_sampler() -> None:
    """Accepting drafts without the rejection rule must fail the same test (it can fail)."""
    params = PARAMS["t1"]
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(V)
    for _ in range(DRAWS):
        q = probs_from_logits(draft_logits(()), params)
        counts[int(torch.multinomial(q, 1, generator=gen))] += 1  # draft's token, always kept
    assert chi_square_p(counts, probs_from_logits(target_logits(()), params)) < 1e-6


def test_greedy_walks_the_argmax_path() -> None:
    tree = TokenTree((3, 1, 4, 2, 0), (-1, -1, 1, 1, 2))
    logits = torch.full((6, V), -5.0)
    for row, best in enumerate([1, 0, 2, 0, 0, 4]):   # row 0: after context; row i+1: after node i
        logits[row, best] = 5.0
    v = verify_greedy(tree, logits)  # root -> node 1 (tok 1) -> node 3 (tok 2) -> leaf: bonus
    assert v.accepted == (1, 3) and v.tokens == (1, 2, 0)
    logits[0] = 0.0
    logits[0, 2] = 5.0               # the target wants 2 first: no child has it
    assert verify_greedy(tree, logits).tokens == (2,)


def test_one_hot_draft_equal_to_greedy_target_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams()
    ctx: tuple[int, ...] = (1, 2)
    tree = draft_tree(ctx, (-1, 0, 1), SamplingParams(), sampled=False, gen=gen)
    rows = target_rows(ctx, tree, params)
    greedy = verify_greedy(tree, torch.log(rows + 1e-9))
    assert verify_stochastic(tree, rows, gen).tokens == greedy.tokens


def test_seeded_verification_repeats() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        gen = params.generator()
        runs.append([first_two_tokens(SHAPES["tree"], params, True, gen) for _ in range(50)])
    assert runs[0] == runs[1]


def test_num_uniforms_is_fixed_by_the_tree_shape() -> None:
    assert num_uniforms(TokenTree((), ())) == 1
    assert num_uniforms(TokenTree.chain([1, 2, 3])) == 3 * 1 + 1
    assert num_uniforms(TokenTree((1, 2, 3, 4, 0), SHAPES["tree"])) == 3 * 2 + 1


def _sampled_case(seed: int, parents: tuple[int, ...]) -> tuple[TokenTree, torch.Tensor]:
    params = PARAMS["t1"]
    gen = torch.Generator().manual_seed(seed)
    ctx = (seed % V,)
    tree = draft_tree(ctx, parents, params, True, gen)
    return tree, target_rows(ctx, tree, params)


def _with_probs(tree: TokenTree, probs: torch.Tensor) -> TokenTree:
    return TokenTree(tree.tokens, tree.parents, probs)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_unnormalised_and_narrow_rows_are_the_same_draft(shape: str) -> None:
    """Draft rows are normalised inside (any positive scale, fp16 or fp32) and a draft
    vocabulary narrower than the target's is zero-padded: the same draws decide the same."""
    for seed in range(100):
        tree, rows = _sampled_case(seed, SHAPES[shape])
        q16 = tree.draft_probs.half()                        # [N, V], sums off 1 by rounding
        narrow = q16.clone()
        narrow[:, -1] = 0  # the draft cannot draw the last id...
        keep = narrow.shape[1] - 1
        variants = [q16, q16 * 4, q16.float() / 8, narrow, narrow[:, :keep]]  # ...nor has its row
        outs = []
        for probs in variants:
            gen = torch.Generator().manual_seed(1000 + seed)
            outs.append(verify_stochastic(_with_probs(tree, probs), rows, gen))
        assert outs[0] == outs[1] == outs[2], seed
        assert outs[3] == outs[4], seed


def test_verify_batch_decides_each_request_as_alone() -> None:
    """One batch of greedy and sampled requests (different trees, rows at different offsets):
    each verdict equals the single-request rule with the same generator state."""
    cases = []
    for i, (shape, params) in enumerate([("chain", PARAMS["t1"]), ("tree", SamplingParams()),
                                         ("tree", PARAMS["t07-topk3-topp09"]),
                                         ("chain", SamplingParams()), ("tree", PARAMS["t1"])]):
        gen = torch.Generator().manual_seed(50 + i)
        tree = draft_tree((i,), SHAPES[shape], params, not params.greedy, gen)
        logits = torch.stack([target_logits((i,))] + [target_logits((i, n)) for n in tree.tokens])
        cases.append((tree, params, logits, i % 3))                    # [N + 1, V], start offset
    lq = max(start + len(logits) for _, _, logits, start in cases)
    batch = torch.full((len(cases), lq, V), -1e4)
    for b, (_, _, logits, start) in enumerate(cases):
        batch[b, start:start + len(logits)] = logits
    for trial in range(20):
        gens = [torch.Generator().manual_seed(trial * 10 + b) for b in range(len(cases))]
        got = verify_batch(batch, [c[3] for c in cases], [c[0] for c in cases],
                           [c[1] for c in cases], gens)
        for b, (tree, params, logits, _) in enumerate(cases):
            gen = torch.Generator().manual_seed(trial * 10 + b)
            want = (verify_greedy(tree, logits) if params.greedy
                    else verify_stochastic(tree, probs_from_logits(logits, params), gen))
            assert replace(got[b], token_probs=None) == want, (trial, b)
            # sampled: each emitted token's probability under the processed row it came from
            rows = [0] + [1 + n for n in want.accepted]
            assert got[b].token_probs == (None if params.greedy else pytest.approx(
                [float(probs_from_logits(logits, params)[r, x])
                 for r, x in zip(rows, want.tokens)], abs=1e-6)), (trial, b)
        # decided on an accelerator (the device walk, read back with the batch's one copy):
        # the same verdicts and probabilities
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rejection, "_decide", lambda tree, probs, gen: stochastic_path(
                tree, probs, torch.rand(num_uniforms(tree), generator=gen)))
            gens = [torch.Generator().manual_seed(trial * 10 + b) for b in range(len(cases))]
            device = verify_batch(batch, [c[3] for c in cases], [c[0] for c in cases],
                                  [c[1] for c in cases], gens)
        assert [replace(d, token_probs=None) for d in device] == [
            replace(g, token_probs=None) for g in got]
        for d, g in zip(device, got):
            assert d.token_probs == (None if g.token_probs is None
                                     else pytest.approx(g.token_probs, abs=1e-6))
        # a request decides the same whatever shares its batch
        alone = verify_batch(batch[2:3], [cases[2][3]], [cases[2][0]], [cases[2][1]],
                             [torch.Generator().manual_seed(trial * 10 + 2)])
        assert alone[0] == got[2]


@pytest.mark.parametrize("one_hot", [False, True])
def test_the_device_walk_decides_as_the_host_walk(one_hot: bool) -> None:
    """``stochastic_path`` (the walk an accelerator runs with masks, no value read back) takes the
    decisions of ``walk_host`` (the CPU's) from the same uniforms, for chains and trees, with
    draft rows (fp16, unnormalised, narrower than the target's vocabulary) or one-hot drafts."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(-1,), (-1, 0, 1), (-1, -1, 0, 1, 2), (-1, -1, -1, 0, 0, 3), ()]
    for trial in range(200):
        parents = shapes[trial % len(shapes)]
        tokens = torch.randint(0, V, (len(parents),), generator=gen).tolist()
        rows = None
        if not one_hot and parents:
            rows = torch.softmax(torch.randn(len(parents), V - 1, generator=gen) * 2, -1).half()
        tree = TokenTree(tuple(tokens), parents, rows)
        probs = torch.softmax(torch.randn(len(parents) + 1, V, generator=gen) * 2, -1)
        u = torch.rand(num_uniforms(tree), generator=gen)
        host = walk_host(tree, probs, u.tolist())
        path = stochastic_path(tree, probs, u)
        device = path.tolist()
        assert [n for n in device[:-1] if n >= 0] == host[:-1] and device[-1] == host[-1], trial
        # the emitted tokens' probabilities from the padded path equal those of the host walk's
        emitted = [tokens[n] for n in host[:-1]] + [host[-1]]
        rows_of = [0] + [1 + n for n in host[:-1]]
        want = [float(probs[r, x]) for r, x in zip(rows_of, emitted)]
        assert emitted_probs(probs, tree, path)[:len(want)].tolist() == pytest.approx(want)
        assert emitted_probs(probs, tree, torch.tensor(host)).tolist() == pytest.approx(want)
