"""The engine on CUDA: our forward equals the CPU in float32, greedy output through the engine
equals the target's own decoding on the device, and stochastic verification with CUDA
generators keeps the target distribution.

Every test is parameterised by device: the ``cpu`` variant runs everywhere (it proves the test
body), the ``cuda`` variants are marked ``cuda`` (skipped without a GPU; ``scripts/gpu-check``
runs them with ``pytest -m cuda``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from chi_square import chi_square_p
from transformers import AutoModelForCausalLM, PreTrainedModel

from spin.bench.gpu_shapes import TINY_TARGET, build_random
from spin.engine.drafter import ModelDrafter, PromptLookupDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ForwardItem, RunnerConfig
from spin.engine.rejection import verify_batch
from spin.engine.sampling import SamplingParams, probs_from_logits
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier
from spin.zoo.corpus import heldout_prompts
from spin.zoo.distill import greedy_continue

CUDA = pytest.mark.cuda
REL_TOL = 1e-4


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    """float32 means float32: no TF32 matmuls (a library may have turned them on)."""
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (got on any device, want on the CPU)."""
    return float((got.float().cpu() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("device,graphs", [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cuda", False, id="cuda-eager", marks=CUDA),
    pytest.param("cuda", True, id="cuda-graphs", marks=CUDA)])
@pytest.mark.parametrize("model_name", ["demo-target", "tiny-gqa"])
@torch.inference_mode()
def test_forward_matches_the_cpu_in_float32(family_dir: Path, device: str, graphs: bool,
                                            model_name: str) -> None:
    """Ragged prefill (eager), decode steps and a tree beside a chain (the step graphs' buckets
    on CUDA), over scattered 4-token blocks: every row within 1e-4 relative of transformers'
    float32 forward on the CPU."""
    ref = (AutoModelForCausalLM.from_pretrained(family_dir / "target", dtype=torch.float32)
           .eval() if model_name == "demo-target"
           else build_random(TINY_TARGET, torch.device("cpu"), torch.float32))
    runner = RunnerConfig(device=device, dtype="float32", kv_cache_memory=16 << 20,
                          max_model_len=256, max_seqs=4, block_size=4,
                          cuda_graphs=graphs).load(copy.deepcopy(ref).to(device))
    vocab, worst = ref.config.vocab_size, 0.0
    seqs = [_ids(vocab, n, seed) for seed, n in enumerate((20, 13, 27))]
    ids = [runner.cache.blocks.admit(f"r{i}") for i in range(len(seqs))]
    prompts = [s[:-3] for s in seqs]
    logits = runner.forward([ForwardItem(q, tuple(p)) for q, p in zip(ids, prompts)])
    for i, p in enumerate(prompts):
        worst = max(worst, _relative(logits[i, :len(p)], ref(input_ids=torch.tensor([p])).logits[0]))
        runner.cache.commit(ids[i], len(p))
    for step in range(3):  # decode steps: contexts of different lengths
        out = runner.forward([ForwardItem(q, (s[len(p) + step],))
                              for q, s, p in zip(ids, seqs, prompts)])
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            want = ref(input_ids=torch.tensor([s[:len(p) + step + 1]])).logits[0, -1]
            worst = max(worst, _relative(out[i, 0], want))
            runner.cache.commit(ids[i], len(p) + step + 1)
    tree, parents = (7, 8, 9, 10), (-1, -1, 0, 1)
    out = runner.forward([ForwardItem(ids[0], tree, parents), ForwardItem(ids[1], (5, 6))])
    paths: list[list[int]] = []
    for node, (tok, par) in enumerate(zip(tree, parents)):
        paths.append(([] if par < 0 else paths[par]) + [tok])
        want = ref(input_ids=torch.tensor([seqs[0] + paths[-1]])).logits[0, -1]
        worst = max(worst, _relative(out[0, node], want))
    worst = max(worst, _relative(out[1, 1], ref(input_ids=torch.tensor([seqs[1] + [5, 6]]))
                                 .logits[0, -1]))
    assert worst <= REL_TOL, f"largest relative difference {worst:.2e}"
    if graphs:  # the steps ran through the captured graphs, not the eager fallback
        assert runner.graphs is not None and runner.graphs.replays >= 4


# ---- greedy: the engine against the target's own decoding on the device --------------------------

NEW = 24
PROMPT = 32
TIE = 0.25
"""bfloat16: where the engine and transformers part ways, transformers' logit of its own token
may exceed that of the engine's by at most this much (a near tie that rounding decides; logits
of this model are ~10-30, where one bfloat16 ulp is 0.06-0.125)."""


def _prompts(family_dir: Path, tokenizer, n: int) -> list[list[int]]:
    out = []
    for row in heldout_prompts(family_dir):
        ids = tokenizer(row["prompt"] + row["reference"], add_special_tokens=False)["input_ids"]
        if len(ids) >= PROMPT:
            out.append(ids[:PROMPT])
        if len(out) == n:
            return out
    raise AssertionError("too few held-out prompts")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.inference_mode()
def _margin(model: PreTrainedModel, context: list[int], want: int, got: int) -> float:
    """transformers' logit of ``want`` minus that of ``got`` after ``context``."""
    dev = next(model.parameters()).device
    row = model(input_ids=torch.tensor([context], device=dev)).logits[0, -1].float()
    return float(row[want] - row[got])


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", "float32", id="cpu-float32"),
    pytest.param("cuda", "float32", id="cuda-float32", marks=CUDA),
    pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=CUDA)])
def test_greedy_engine_equals_the_targets_own_decoding(family_dir: Path, tokenizer, device: str,
                                                       dtype: str) -> None:
    """The demo target through the engine, alone and speculating (model drafters, prompt
    lookup, chains and trees in one batch), against ``greedy_continue`` of transformers on the
    same device and dtype: identical in float32; in bfloat16 any divergence is a near tie."""
    n = 6 if device == "cpu" else 16
    prompts = _prompts(family_dir, tokenizer, n)
    target = AutoModelForCausalLM.from_pretrained(family_dir / "target",
                                                  dtype=getattr(torch, dtype)).to(device).eval()
    with torch.inference_mode():
        ref = greedy_continue(target, torch.tensor(prompts, device=device), NEW).tolist()
    cfg = RunnerConfig(device=device, dtype=dtype, kv_cache_memory=64 << 20, max_seqs=n,
                       max_model_len=256)
    drafters = {name: ModelDrafter(name, cfg.load(family_dir / name))
                for name in ("draft-code", "draft-prose")}
    drafters["prompt-lookup"] = PromptLookupDrafter()
    engine = SpecEngine(Verifier(cfg.load(family_dir / "target")), drafters, eos_id=None)
    names = sorted(drafters)
    off = engine.generate([GenerationRequest(f"off{i}", tuple(p), NEW)
                           for i, p in enumerate(prompts)])
    on = engine.generate([GenerationRequest(f"on{i}", tuple(p), NEW, drafter=names[i % 3],
                                            k=(2, 4, 8)[i % 3], branching=(2,) if i % 2 else ())
                          for i, p in enumerate(prompts)])
    assert sum(r.accepted for r in on) > 0 and sum(r.drafted - r.accepted for r in on) > 0
    assert all(len(r.tokens) == NEW for r in off + on)
    differ = []  # (speculation, request, first differing token, transformers' logit margin)
    for label, results in (("off", off), ("on", on)):
        for i, res in enumerate(results):
            j = _first_difference(res.tokens, ref[i])
            if j is not None:
                margin = _margin(target, prompts[i] + ref[i][:j], ref[i][j], res.tokens[j])
                differ.append((label, i, j, round(margin, 4)))
    if dtype == "float32":
        assert differ == []
    else:
        assert all(m <= TIE for *_, m in differ), differ


# ---- stochastic verification with the device's generators ---------------------------------------

V = 5
DRAWS = 2000
SHAPES = {"chain": (-1, 0, 1), "tree": (-1, -1, 0, 1, 2)}
T1 = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)


@lru_cache(maxsize=None)
def _raw(ctx: tuple[int, ...], salt: int) -> torch.Tensor:
    seed = salt + 10 * (1 + sum((t + 1) * 7 ** i for i, t in enumerate(ctx)))
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5         # [V]


def _target(ctx: tuple[int, ...]) -> torch.Tensor:
    return _raw(ctx, 0)


def _draft_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    return 0.6 * _raw(ctx, 0) + 0.8 * _raw(ctx, 1)


def _draft(ctx: tuple[int, ...], parents: tuple[int, ...], params: SamplingParams,
           sampled: bool, gen: torch.Generator) -> tuple[TokenTree, torch.Tensor]:
    """A drafted tree after ``ctx`` (sampled from q, or top-b of q) and the target's logits
    [N + 1, V] of its rows."""
    tokens, rows, paths = [], [], []
    for i, p in enumerate(parents):
        prefix = ctx + (paths[p] if p >= 0 else ())
        q = probs_from_logits(_draft_logits(prefix), params)                           # [V]
        rank = sum(1 for j in range(i) if parents[j] == p)
        tok = int(torch.multinomial(q, 1, generator=gen)) if sampled else int(
            q.argsort(descending=True)[rank])
        tokens.append(tok)
        rows.append(q)
        paths.append((paths[p] if p >= 0 else ()) + (tok,))
    tree = TokenTree(tuple(tokens), parents, torch.stack(rows) if sampled else None)
    logits = torch.stack([_target(ctx)] + [_target(ctx + path) for path in paths])    # [N + 1, V]
    return tree, logits


def _verify(ctxs: list[tuple[int, ...]], parents: tuple[int, ...], params: SamplingParams,
            sampled: bool, host: torch.Generator, gen: torch.Generator) -> list[tuple[int, ...]]:
    """One batch: a request per context, all decided by ``verify_batch`` on ``gen``'s device."""
    drafted = [_draft(c, parents, params, sampled, host) for c in ctxs]
    logits = torch.stack([lg for _, lg in drafted]).to(gen.device)                     # [B, N + 1, V]
    verdicts = verify_batch(logits, [0] * len(ctxs), [t for t, _ in drafted],
                            [params] * len(ctxs), [gen] * len(ctxs))
    return [v.tokens for v in verdicts]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("shape,params,sampled", [
    ("chain", T1, True), ("tree", NUCLEUS, True), ("tree", T1, False)],
    ids=["chain-sampled", "tree-sampled-nucleus", "tree-deterministic"])
def test_verification_keeps_the_target_distribution(device: str, shape: str,
                                                     params: SamplingParams,
                                                     sampled: bool) -> None:
    """The first two tokens emitted (a second step where the first emitted one) follow the
    target's distribution, decided on ``device`` with its generator; the same counts reject
    the draft's distribution (the check has the power to fail)."""
    host = torch.Generator().manual_seed(11)
    gen = torch.Generator(device=device).manual_seed(12)
    parents = SHAPES[shape]
    first = _verify([()] * DRAWS, parents, params, sampled, host, gen)
    again = [i for i, t in enumerate(first) if len(t) < 2]
    second = iter(_verify([(first[i][0],) for i in again], parents, params, sampled, host, gen))
    counts = torch.zeros(V, V)
    for i, toks in enumerate(first):
        counts[toks[0], toks[1] if len(toks) >= 2 else next(second)[0]] += 1
    p1 = probs_from_logits(_target(()), params)                                        # [V]
    p2 = torch.stack([probs_from_logits(_target((a,)), params) for a in range(V)])     # [V, V]
    assert chi_square_p(counts.sum(1), p1) > 1e-3
    assert chi_square_p(counts.flatten(), (p1[:, None] * p2).flatten()) > 1e-3
    q1 = probs_from_logits(_draft_logits(()), params)
    if (q1 > 0).all():  # (nucleus: q1 may lack tokens p1 has)
        assert chi_square_p(counts.sum(1), q1) < 1e-3
