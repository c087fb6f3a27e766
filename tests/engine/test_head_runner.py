"""Draft heads inside the verifier: the paged drafts equal the head's dense forward over the
whole history; output with head drafts equals the target alone (greedy, token for token) and
follows the target's distribution (sampled, chi-square)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from chi_square import chi_square_p
from in_verifier import generate, joint, two_tokens
from real_sizes import make_pair
from transformers import AutoModelForCausalLM, LlamaConfig

from spin.engine.eagle import EagleHead, random_head
from spin.engine.head_runner import FeatureLog, HeadAsk, HeadDraft
from spin.engine.model_runner import ModelRunner, RunnerConfig
from spin.engine.step_graphs import GraphConfig, StepGraphs
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest

EMPTY = TokenTree((), ())


def _tiny(seed: int = 0) -> AutoModelForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _reference_draft(model, head: EagleHead, context: list[int], k: int) -> list[int]:
    """The head's greedy chain after ``context`` by dense forwards over the whole history."""
    ids = torch.tensor([context[:-1]])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in head.config.aux_layers], -1)             # [1, T, 3D]
        emb = model.model.embed_tokens
        hidden = head.fuse(feats)
        tokens = list(context[1:])
        out = []
        for _ in range(k):
            o = head.dense(hidden, emb(torch.tensor([tokens])))                    # [1, n, D]
            tok = int(head.target_ids[head.logits(o[0, -1]).argmax()])
            out.append(tok)
            hidden = torch.cat([hidden, o[:, -1:]], 1)
            tokens.append(tok)
    return out


def _verifier(model, head: EagleHead | None, window: int = 256) -> Verifier:
    runner = RunnerConfig(max_seqs=32, kv_cache_memory=64 << 20).load(model)
    return Verifier(runner, {"h": head} if head is not None else None, head_window=window)


def test_paged_drafts_equal_the_dense_forward_across_accepted_steps() -> None:
    model = _tiny()
    head = random_head(model.config, draft_vocab_size=200, seed=1)
    with torch.no_grad():  # the target's states, not the token embeddings, decide its drafts
        head.fc.weight.mul_(30)
        head.midlayer.input_layernorm.weight.mul_(0.05)
    v = _verifier(model, head)
    prompt = list(range(5, 25))
    alone = _verifier(model, None)
    (first,) = alone.verify([VerifyRequest("r", prompt, EMPTY)])
    context = prompt + list(first.tokens)
    (verdict,) = v.verify([VerifyRequest("r", prompt, EMPTY, head=HeadAsk("h", k=3))])
    assert list(verdict.tokens) == list(first.tokens)
    assert list(verdict.head_draft) == _reference_draft(model, head, context, 3)
    for step in range(4):
        # the target's own next tokens as the stored draft: all accepted (the accepted nodes'
        # states must reach the head), then whatever the head drafts (mostly rejected)
        truth = []
        for _ in range(3):
            (n,) = alone.verify([VerifyRequest("r", [], EMPTY, keep=len(context) + len(truth))])
            truth += list(n.tokens)
        draft = tuple(truth[:2]) if step % 2 == 0 else tuple(verdict.head_draft)
        v.heads["h"].drafts["r"] = HeadDraft(len(context), draft, None)
        (verdict,) = v.verify([VerifyRequest("r", [], TokenTree.chain(list(draft)),
                                             keep=len(context),
                                             head=HeadAsk("h", k=3, stored=len(draft)))])
        if step % 2 == 0:
            assert verdict.num_accepted == 2
        context += list(verdict.tokens)
        assert list(verdict.head_draft) == _reference_draft(model, head, context, 3)
        alone.release("r")
        alone.verify([VerifyRequest("r", context[:-1], EMPTY)])


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_output_with_a_head_equals_the_target_alone(arch: str, batch: int,
                                                           tmp_path_factory) -> None:
    target_dir, _ = make_pair(arch, tmp_path_factory.getbasetemp() / "heads")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = random_head(model.config, draft_vocab_size=4096, seed=batch)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 4000, (int(torch.randint(3, 40, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(batch)]
    with_head = _verifier(model, head, window=16)
    alone = _verifier(model, None)
    assert generate(with_head, prompts, 24, "h")[0] == generate(alone, prompts, 24, None)[0]
    assert with_head.heads["h"].drafts  # it drafted


def test_a_draft_that_is_not_the_heads_own_is_verified_as_a_plain_step() -> None:
    model = _tiny()
    v = _verifier(model, random_head(model.config, seed=2))
    prompt = list(range(30, 50))
    (a,) = v.verify([VerifyRequest("r", prompt, EMPTY, head=HeadAsk("h", k=2))])
    wrong = [(a.head_draft[0] + 1) % 300, a.head_draft[1]]
    (b,) = v.verify([VerifyRequest("r", [], TokenTree.chain(wrong), keep=len(prompt),
                                   head=HeadAsk("h", k=2, stored=2))])
    assert b.num_accepted == 0 and len(b.tokens) == 1


def test_the_feature_log_keeps_a_window_and_forgets_a_changed_context() -> None:
    log = FeatureLog(window=4)
    log.record("r", 0, torch.arange(6.0)[:, None])
    assert log.span("r") == (2, 6)  # a prefill longer than the window: its last 4
    log.record("r", 5, torch.tensor([[50.0], [60.0]]))  # replaces position 5 on
    assert log.span("r") == (2, 7)
    assert log.states("r", 4, 7)[:, 0].tolist() == [4.0, 50.0, 60.0]
    for pos in range(7, 11):  # one position a step: whole older chunks go past the window
        log.record("r", pos, torch.tensor([[float(pos)]]))
    assert log.span("r") == (7, 11) and log.states("r", 7, 11)[:, 0].tolist() == [7, 8, 9, 10]
    log.truncate("r", 9)
    assert log.span("r") == (7, 9)
    log.truncate("r", 7)
    assert log.span("r") == (0, 0)


def test_a_head_for_another_target_is_refused(tmp_path: Path) -> None:
    model = _tiny()
    other = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4)
    with pytest.raises(ValueError, match="width 32"):
        _verifier(model, random_head(other))


def test_sampled_output_with_head_drafts_follows_the_target() -> None:
    """The first two tokens after a prompt, the second verified against the head's sampled
    draft (a draft vocabulary of 6 of the 8 tokens), follow the target's joint distribution."""
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    head = random_head(cfg, draft_vocab_size=6, seed=4)
    v = Verifier(RunnerConfig(max_seqs=64, kv_cache_memory=16 << 20).load(model), {"h": head})
    counts, drafted, accepted = two_tokens(v, "h", [1, 2, 3], 8)
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert counts[:, ~head.t2d].sum() > 0  # tokens the head never drafts are emitted too
    assert chi_square_p(counts.flatten(), joint(model, [1, 2, 3], 8)) > 0.01


def _demo_target(family_dir: Path, cfg: RunnerConfig, buckets: bool) -> ModelRunner:
    """The demo target; with ``buckets`` its steps run through the static-shape buckets (on
    CUDA captured graphs, on the CPU the same bucketed step run eager)."""
    runner = cfg.load(family_dir / "target")
    if buckets and runner.device.type == "cpu":  # a runner built with a scratch block
        runner = replace(cfg, compile=True).load(family_dir / "target")
        runner.graphs = StepGraphs(runner, GraphConfig(capture=False, min_keys=64))
    return runner


@pytest.mark.parametrize("device,dtype,buckets", [
    pytest.param("cpu", "float32", False, id="cpu-float32"),
    pytest.param("cpu", "float32", True, id="cpu-float32-buckets"),
    pytest.param("cuda", "float32", True, id="cuda-float32", marks=pytest.mark.cuda),
    pytest.param("cuda", "bfloat16", True, id="cuda-bfloat16", marks=pytest.mark.cuda)])
def test_the_demo_head_drafts_losslessly_on_each_device(family_dir: Path, device: str,
                                                        dtype: str, buckets: bool) -> None:
    """The trained demo head beside the demo target, batches of 1 and 8 on the device (CUDA:
    ``scripts/gpu-check``), its states taken from the eager forward or from the static steps
    (CUDA graphs): greedy output equals the verifier alone there, in float32 token for token,
    and the head's drafts are accepted (a head fed wrong states drafts nothing the target
    keeps)."""
    cfg = RunnerConfig(device=device, dtype=dtype, max_seqs=16, kv_cache_memory=64 << 20)
    head = EagleHead.load(family_dir / "eagle", len(cfg.load(family_dir / "target").layers))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 2000, (24,), generator=g).tolist() for _ in range(8)]
    for batch in (prompts[:1], prompts):
        with_head = Verifier(_demo_target(family_dir, cfg, buckets), {"h": head})
        alone = Verifier(cfg.load(family_dir / "target"))
        steps: list[int] = []
        verify = with_head.verify
        with_head.verify = lambda reqs: steps.append(len(reqs)) or verify(reqs)  # type: ignore
        got = generate(with_head, batch, 16, "h")[0]
        if dtype == "float32":
            assert got == generate(alone, batch, 16, None)[0]
        assert all(len(o) == 16 for o in got)
        assert sum(steps) < 0.8 * 16 * len(batch)  # drafts were accepted
        graphs = with_head.runner.graphs
        assert (graphs is not None and graphs.replays > 0) == buckets
