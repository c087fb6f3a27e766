"""Paged + tree FlexAttention equals the SDPA path (blocks gathered through the tables, a dense
context + ancestors mask) on the rows that are new tokens; padding rows are finite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spin.engine.flex_attention import build_plan, paged_tree_attention
from spin.engine.model_runner import ForwardItem, ModelRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex's "use compile"


def ancestors(parents: list[list[int]]) -> torch.Tensor:
    """Tree parents per item ([B][Lq], -1 = root) -> ancestor-or-self mask [B, Lq, Lq]."""
    lq = len(parents[0])
    anc = torch.zeros(len(parents), lq, lq, dtype=torch.bool)
    for b, par in enumerate(parents):
        for i in range(lq):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = par[j]
    return anc


def random_batch(gen: torch.Generator, ctxs: list[int], sizes: list[int], trees: bool,
                 heads: int, kv_heads: int, hd: int = 16, bs: int = 16, nb: int = 48,
                 dtype: torch.dtype = torch.float32) -> dict:
    """A pool with shuffled blocks, items with contexts ``ctxs`` and ``sizes`` new tokens."""
    b, lq = len(ctxs), max(sizes)
    width = max(-(-(c + s) // bs) for c, s in zip(ctxs, sizes))
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(b, width, dtype=torch.long)
    taken = 0
    for i, (c, s) in enumerate(zip(ctxs, sizes)):
        need = -(-(c + s) // bs)
        table[i, :need] = perm[taken:taken + need]
        taken += need
    k_pool = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(dtype)
    v_pool = torch.randn(nb, bs, kv_heads, hd, generator=gen).to(dtype)
    q = torch.randn(b, heads, lq, hd, generator=gen).to(dtype)
    parents = []
    for s in sizes:
        if trees:
            par = [-1][:s] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, s)]
        else:
            par = list(range(-1, s - 1))
        parents.append(par + [-1] * (lq - s))
    anc = ancestors(parents)
    return {"q": q, "k": k_pool, "v": v_pool, "table": table, "ctx": torch.tensor(ctxs),
            "n": torch.tensor(sizes), "anc": anc, "lq": lq}


def reference(d: dict) -> torch.Tensor:
    """As ``model_runner`` computes it: gather, dense mask, SDPA -> [B, H, Lq, hd]."""
    lk = int((d["ctx"] + d["n"]).max())
    b, lq = d["table"].shape[0], d["lq"]
    keys = d["k"][d["table"]].flatten(1, 2)[:, :lk].transpose(1, 2)                # [B, KVH, Lk, hd]
    values = d["v"][d["table"]].flatten(1, 2)[:, :lk].transpose(1, 2)
    rel = torch.arange(lk)[None, None] - d["ctx"][:, None, None]                   # [B, 1, Lk]
    in_tree = (rel >= 0) & (rel < d["n"][:, None, None])
    tree = d["anc"].gather(2, rel.clamp(0, lq - 1).expand(b, lq, lk)) & in_tree
    valid = torch.arange(lq)[None] < d["n"][:, None]
    mask = (rel < 0) | tree | (~valid[:, :, None] & (torch.arange(lk) == 0))
    return F.scaled_dot_product_attention(d["q"], keys, values, attn_mask=mask[:, None],
                                          enable_gqa=keys.shape[1] != d["q"].shape[1])


def flex(d: dict, chains_as_none: bool = False, **kw) -> torch.Tensor:
    nb, bs = d["k"].shape[:2]
    plan = build_plan(d["table"], d["ctx"], d["n"], d["lq"], nb, bs,
                      None if chains_as_none else d["anc"], **kw)
    return paged_tree_attention(d["q"], d["k"], d["v"], plan)


def check(out: torch.Tensor, ref: torch.Tensor, n: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    for i, s in enumerate(n.tolist()):
        if s:
            assert (out[i, :, :s].float() - ref[i, :, :s].float()).abs().max() <= tol, i


CASES = [  # (contexts, new tokens per item)
    ([0, 5, 16, 37], [7, 3, 16, 1]),      # prefill from nothing, block edges, decode
    ([100, 3, 64], [5, 20, 2]),           # two query blocks (Lq 20), context on a block edge
    ([31], [1]),                           # one decode token
    ([0, 12], [0, 3]),                     # an item without tokens (a static batch's padding)
]


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("ctxs,sizes", CASES)
def test_flex_equals_sdpa(ctxs, sizes, trees, heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(len(ctxs) * 7 + trees + heads)
    d = random_batch(gen, ctxs, sizes, trees, heads, kv_heads)
    check(flex(d), reference(d), d["n"], 1e-5)


def test_chains_without_an_ancestor_mask() -> None:
    d = random_batch(torch.Generator().manual_seed(1), [9, 40], [6, 12], False, 6, 2)
    check(flex(d, chains_as_none=True), reference(d), d["n"], 1e-5)


def test_small_cache_blocks_and_wide_query_blocks() -> None:
    """Cache blocks of 4 (flex KV block 4) and query blocks of 32."""
    d = random_batch(torch.Generator().manual_seed(2), [0, 13, 22], [9, 4, 1], True, 4, 2,
                     bs=4, nb=64)
    check(flex(d, q_block=32), reference(d), d["n"], 1e-5)


def test_plan_lists_only_the_items_blocks() -> None:
    """The kernel visits full blocks (inside the context) and partial ones (the rest) of the
    item's own table only, and a query block no further than its rows can see."""
    d = random_batch(torch.Generator().manual_seed(3), [40, 0], [3, 20], False, 2, 2)
    plan = build_plan(d["table"], d["ctx"], d["n"], d["lq"], 48, 16, d["anc"], cover_pool=False)
    m = plan.block_mask
    assert m.full_kv_num_blocks[:, 0].tolist() == [[2, 2], [0, 0]]   # 40 // 16, 0
    assert m.kv_num_blocks[:, 0].tolist() == [[1, 1], [1, 2]]         # 40..42; 0..15, 0..19
    assert m.full_kv_indices[0, 0, 0, :2].tolist() == d["table"][0, :2].tolist()
    assert m.kv_indices[0, 0, 0, 0] == d["table"][0, 2]
    assert m.kv_indices[1, 0, 1, :2].tolist() == d["table"][1, :2].tolist()
    assert plan.lq_padded == 32


def kernel_view(plan, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the kernel computes: full blocks whole, partial blocks through the mask, nothing
    else; what eager flex computes: the mask everywhere), both [B, Lqp, NB * BS] bool."""
    m = plan.block_mask
    kb, qb = m.BLOCK_SIZE[1], m.BLOCK_SIZE[0]
    b, _, qbn, _ = m.kv_indices.shape
    nkv = m.seq_lengths[1]
    bi = torch.arange(b)[:, None, None]
    dense = m.mask_mod(bi, 0, torch.arange(qbn * qb)[None, :, None], torch.arange(nkv)[None, None])

    def listed(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(b, qbn, nkv // kb, dtype=torch.bool)
        live = torch.arange(idx.shape[-1]) < num[:, 0, :, None]                    # [B, QBn, W]
        out.scatter_(2, torch.where(live, idx[:, 0].long(), 0), live)
        out[:, :, 0] |= (live & (idx[:, 0] == 0)).any(-1)   # scatter of False may clear block 0
        return out.repeat_interleave(qb, 1).repeat_interleave(kb, 2)

    full = listed(m.full_kv_num_blocks, m.full_kv_indices)
    partial = listed(m.kv_num_blocks, m.kv_indices)
    return full | (partial & dense), dense


@pytest.mark.parametrize("trees", [False, True])
def test_block_lists_agree_with_the_mask(trees) -> None:
    """Full blocks are wholly visible, unlisted blocks wholly masked: the kernel (block lists)
    and eager flex (the mask alone, checked against SDPA above) attend to the same keys."""
    gen = torch.Generator().manual_seed(6 + trees)
    d = random_batch(gen, [0, 5, 16, 47, 100, 0], [7, 3, 16, 2, 20, 0], trees, 2, 2, bs=16, nb=32)
    plan = build_plan(d["table"], d["ctx"], d["n"], d["lq"], 32, 16, d["anc"], cover_pool=False)
    kernel, dense = kernel_view(plan, 32)
    assert torch.equal(kernel, dense)
    assert dense.any(-1).all()  # every row, padding included, sees some key


def test_bf16() -> None:
    d = random_batch(torch.Generator().manual_seed(4), [20, 50], [5, 9], True, 6, 2,
                     dtype=torch.bfloat16)
    check(flex(d), reference(d), d["n"], 2e-2)


def _interleaved(runner: ModelRunner) -> list[int]:
    """Three requests prefilled one at a time, then two decode steps: their blocks interleave."""
    seqs = [runner.cache.blocks.admit(f"r{i}") for i in range(3)]
    prompts = [[5, 9, 14, 3, 7, 11, 2], [8, 1, 4], [6, 6, 12, 10, 3, 9, 4, 2, 13, 5, 7]]
    for s, p in zip(seqs, prompts):
        runner.forward([ForwardItem(s, tuple(p))])
        runner.cache.commit(s, len(p))
    for step in range(2):
        runner.forward([ForwardItem(s, (20 + step,)) for s in seqs])
        for s in seqs:
            runner.cache.commit(s, runner.cache.lengths[s] + 1)
    return seqs


def test_demo_target_forward_through_flex(family_dir) -> None:
    """The runner with ``attention="flex"`` (every layer's attention by flex over its pool;
    blocks of 4, three requests whose blocks interleave; prefills, decode steps, trees beside
    chains) gives the SDPA runner's logits."""
    kw = dict(max_seqs=4, max_model_len=128, kv_cache_bytes=4 << 20, block_size=4)
    sdpa = ModelRunner(family_dir / "target", **kw)
    flex = ModelRunner(family_dir / "target", attention="flex", **kw)
    seqs = _interleaved(sdpa)
    assert _interleaved(flex) == seqs
    items = [ForwardItem(seqs[0], (30, 31, 32, 33), (-1, -1, 0, 1)),
             ForwardItem(seqs[1], (40,)), ForwardItem(seqs[2], (50, 51, 52), (-1, 0, 0))]
    ref, out = sdpa.forward(items), flex.forward(items)
    for i, it in enumerate(items):
        k = len(it.tokens)
        assert (out[i, :k] - ref[i, :k]).abs().max() <= 1e-4
    lone = [ForwardItem(seqs[1], (41, 42))]  # a lone request: flex reads through its table
    assert (flex.forward(lone)[0] - sdpa.forward(lone)[0]).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="attention must be"):
        ModelRunner(family_dir / "target", attention="dense", **kw)
