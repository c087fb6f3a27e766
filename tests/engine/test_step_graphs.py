"""Bucketed static-shape steps (``engine/step_graphs.py``) compute what the eager forward does:
logits to 1e-4 (fp32), greedy speculative output token for token, trees and chains, padded
batches, scratch writes that touch no request's blocks; on the CPU eager and compiled, on CUDA
as captured graphs (``-m cuda``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spin.engine.drafter import ModelDrafter, PromptLookupDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ForwardItem, ModelRunner
from spin.engine.step_graphs import Bucket, GraphConfig, StepGraphs, describe
from spin.engine.verifier import Verifier
from spin.zoo.corpus import heldout_prompts

KV = 16 << 20
TOL = 1e-4


def bucketed(path: Path, device: str = "cpu", compile: bool = False, capture: bool = False,
             **kw) -> ModelRunner:
    """A runner whose steps run through buckets (on the CPU: eager unless ``compile``)."""
    runner = ModelRunner(path, max_seqs=kw.pop("max_seqs", 8),
                         kv_cache_bytes=kw.pop("kv_cache_bytes", KV), device=device,
                         compile=True, **kw)
    runner.graphs = StepGraphs(runner, GraphConfig(capture=capture, compile=compile,
                                                   min_keys=64, max_keys=512))
    return runner


def _prefill(runner: ModelRunner, prompts: list[list[int]]) -> list[int]:
    seqs = [runner.cache.blocks.admit(f"r{i}") for i in range(len(prompts))]
    runner.forward([ForwardItem(s, tuple(p)) for s, p in zip(seqs, prompts)], last_only=True)
    for s, p in zip(seqs, prompts):
        runner.cache.commit(s, len(p))
    return seqs


def test_buckets_cover_the_steps_they_should(family_dir: Path) -> None:
    runner = bucketed(family_dir / "draft-general", block_size=16)
    g = runner.graphs
    assert g.key_sizes[0] == 64 and g.key_sizes[-1] == 512
    assert g.bucket([1], 10) == Bucket(1, 1, 64)
    assert g.bucket([3, 1, 5], 100) == Bucket(4, 8, 128)
    assert g.bucket([17], 10) is None                 # a prefill: eager
    assert g.bucket([1] * 9, 10) is None              # past the largest batch (max_seqs 8)
    assert g.bucket([1], 513) is None                 # past max_keys
    assert runner.cache.scratch == runner.cache.blocks.num_blocks
    assert "bucketed steps" in describe(g)
    assert runner.capture_graphs() == 0          # nothing to capture on the CPU
    assert g.prepare([Bucket(1, 1, 64), Bucket(2, 4, 128)]) == 2
    assert g.prepare([Bucket(1, 1, 64)]) == 0    # built once
    assert set(g.steps) == {Bucket(1, 1, 64), Bucket(2, 4, 128)}


@torch.inference_mode()
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_bucketed_logits_equal_eager_chains_trees_and_padding(family_dir: Path,
                                                              attention: str) -> None:
    """Against the eager SDPA forward; flex (eager, torch's reference implementation, on a
    small pool) replaces the gather and the dense mask inside the bucketed step too."""
    path = family_dir / "target"
    eager = ModelRunner(path, max_seqs=8, kv_cache_bytes=KV, block_size=4)
    static = bucketed(path, block_size=4, attention=attention,
                      kv_cache_bytes=KV if attention == "sdpa" else 4 << 20)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    seqs_e, seqs_s = _prefill(eager, prompts), _prefill(static, prompts)
    assert seqs_e == seqs_s
    steps = [  # (tokens, parents) per request: decode, chains, a tree beside a chain, a lone tree
        [((7,), None), ((8,), None), ((9,), None)],
        [((7, 8, 9), None), ((1,), None), ((4, 5), None)],
        [((7, 8, 9, 10), (-1, -1, 0, 1)), ((5, 6), None), ((3,), None)],
        [((11, 12, 13, 14, 15), (-1, 0, 0, 1, 2))],
    ]
    for step in steps:
        items = [(ForwardItem(s, t, p)) for s, (t, p) in zip(seqs_e, step)]
        want = eager.forward(items, logits_from=[0] * len(items))
        got = static.forward(items, logits_from=[0] * len(items))
        for i, it in enumerate(items):
            n = len(it.tokens)
            assert (got[i, :n] - want[i, :n]).abs().max() <= TOL
        last = static.forward(items, last_only=True)
        assert last.shape[1] == 1
        for i, it in enumerate(items):
            assert (last[i, 0] - want[i, len(it.tokens) - 1]).abs().max() <= TOL
        for r in (eager, static):  # accept the first token of each item
            for it in items:
                r.cache.commit(it.seq, r.cache.lengths[it.seq] + 1)
    assert static.graphs.replays == 2 * len(steps)
    # nothing but padding went to the scratch block; the requests' caches are the same
    for s in seqs_e:
        n = eager.cache.lengths[s]
        ke, _ = eager.cache.read(0, eager.cache.locate([s], [0], 0))
        ks, _ = static.cache.read(0, static.cache.locate([s], [0], 0))
        assert (ke[..., :n, :] - ks[..., :n, :]).abs().max() <= TOL


@torch.inference_mode()
def test_bucketed_steps_keep_the_layer_inputs_a_head_reads(family_dir: Path) -> None:
    """A runner serving a draft head keeps three layers' inputs on every step: through the
    buckets (a CUDA graph on a GPU) they equal the eager forward's, and the steps built
    before the layers were named are built again."""
    path = family_dir / "target"
    eager = ModelRunner(path, max_seqs=8, kv_cache_bytes=KV, block_size=4)
    static = bucketed(path, block_size=4)
    static.graphs.prepare([Bucket(2, 4, 64)])
    layers = (0, 1, len(static.layers) - 1)
    static.keep_features(layers)
    assert static.graphs.steps == {}  # built without the layers: dropped
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (11, 6)]
    seqs = _prefill(eager, prompts)
    assert _prefill(static, prompts) == seqs
    items = [ForwardItem(seqs[0], (7, 8, 9), None), ForwardItem(seqs[1], (4, 5, 6), (-1, 0, 0))]
    want = eager.forward(items, features=layers)
    want_features = eager.features                                        # [2, 3, 3D]
    got = static.forward(items, features=layers)
    assert static.graphs.replays == 1
    assert (got - want).abs().max() <= TOL
    assert static.features.shape == want_features.shape
    assert (static.features - want_features).abs().max() <= TOL
    static.forward([ForwardItem(seqs[0], (3,), None)])  # other layers or none: eager
    assert static.graphs.replays == 1 and static.features is None


def _engine(family_dir: Path, runner_kw: dict) -> SpecEngine:
    make = bucketed if runner_kw else (lambda p, **kw: ModelRunner(p, max_seqs=8,
                                                                   kv_cache_bytes=KV))
    drafters = {"draft-code": ModelDrafter("draft-code", make(family_dir / "draft-code",
                                                               **runner_kw)),
                "prompt-lookup": PromptLookupDrafter()}
    return SpecEngine(Verifier(make(family_dir / "target", **runner_kw)), drafters, eos_id=None)


def _requests(family_dir: Path, tokenizer, n: int) -> list[GenerationRequest]:
    rows = heldout_prompts(family_dir)[:n]
    out = []
    for i, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][:48]
        out.append(GenerationRequest(f"g{i}", tuple(ids), 24,
                                     drafter=("draft-code", "prompt-lookup", None)[i % 3],
                                     k=(2, 4, 6)[i % 3], branching=(2,) if i % 4 == 1 else ()))
    return out


def test_greedy_speculation_through_buckets_equals_eager(family_dir: Path, tokenizer) -> None:
    reqs = _requests(family_dir, tokenizer, 6)
    want = [r.tokens for r in _engine(family_dir, {}).generate(reqs)]
    engine = _engine(family_dir, {"device": "cpu"})
    got = [r.tokens for r in engine.generate(reqs)]
    assert got == want
    assert engine.verifier.runner.graphs.replays > 0
    assert engine.drafters["draft-code"].runner.graphs.replays > 0


def test_compiled_buckets_equal_eager_on_the_cpu(family_dir: Path, tokenizer) -> None:
    """inductor on the CPU: a bucket's compile takes many seconds here, so one bucket (two
    requests decoding with the target alone)."""
    reqs = [GenerationRequest(r.request_id, r.prompt[:24], 8)
            for r in _requests(family_dir, tokenizer, 2)]
    want = [r.tokens for r in _engine(family_dir, {}).generate(reqs)]
    engine = _engine(family_dir, {"device": "cpu", "compile": True})
    assert [r.tokens for r in engine.generate(reqs)] == want
    assert list(engine.verifier.runner.graphs.steps) == [Bucket(2, 1, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_cuda_graphs_equal_eager_on_cuda(family_dir: Path, tokenizer, attention: str) -> None:
    """Captured graphs (every bucket, at start) give eager SDPA's greedy output on CUDA, in
    float32 (in half precision a padded bucket's matmuls may round a near tie the other way;
    ``test_cuda.py`` bounds those)."""
    dtype = torch.float32
    reqs = _requests(family_dir, tokenizer, 8)  # the runners hold 8 sequences
    eager = _engine(family_dir, {"device": "cuda", "dtype": dtype, "capture": False})
    for d in (eager.verifier.runner, eager.drafters["draft-code"].runner):
        d.graphs = None  # plain eager forwards on CUDA
    want = [r.tokens for r in eager.generate(reqs)]
    graphs = _engine(family_dir, {"device": "cuda", "dtype": dtype, "capture": True,
                                  "attention": attention})
    built = graphs.verifier.runner.capture_graphs()
    assert built == len(graphs.verifier.runner.graphs.buckets())
    assert [r.tokens for r in graphs.generate(reqs)] == want
    assert graphs.verifier.runner.graphs.replays > 0
