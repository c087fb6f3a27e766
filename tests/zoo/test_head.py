"""The EAGLE-3 head stage: the unrolled forward, training, the saved head, acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from spin.engine.eagle import EagleHead, default_aux_layers, random_head
from spin.zoo.head import (HeadSpec, acceptance, batch_loss, build_data, draft_vocab,
                           expected_steps, generate, greedy_steps, head_drafter, new_head,
                           save_head, train_head, unrolled)

TINY = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   initializer_range=0.2, tie_word_embeddings=True)
AUX = default_aux_layers(TINY.num_hidden_layers)
SPEC = HeadSpec(prompt_tokens=8, new_tokens=24, draft_vocab=200, batch=4, lr=3e-3,
                budget_s=60.0, val_seqs=4, seed=3)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY).eval()


@pytest.fixture(scope="module")
def data(target: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    prompts = torch.randint(1, TINY.vocab_size, (16, SPEC.prompt_tokens),
                            generator=torch.Generator().manual_seed(1))
    return build_data(target, prompts, SPEC, AUX)


def _inputs(target: LlamaForCausalLM, head: EagleHead, data: dict[str, torch.Tensor], n: int = 2
            ) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = head.fuse(data["features"][:n, :-1].float())                     # [n, T-1, D]
    return hidden, F.embedding(data["tokens"][:n, 1:], target.get_input_embeddings().weight)


@torch.no_grad()
def test_step0_equals_dense(target, data) -> None:
    head = random_head(TINY, 200, seed=1)
    hidden, embeds = _inputs(target, head, data)
    outs = unrolled(head, hidden, embeds, 3)
    assert len(outs) == 3
    torch.testing.assert_close(outs[0], head.dense(hidden, embeds), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_every_step_equals_a_drafted_chain(target, data) -> None:
    """Step j at position s + j is the chain drafted from s: the head's causal forward over the
    target's states up to s, then its own outputs, one position at a time (serving)."""
    head = random_head(TINY, 200, seed=2)
    hidden, embeds = _inputs(target, head, data, 1)
    outs = unrolled(head, hidden, embeds, 3)
    for s in (0, 5, 17):
        states = hidden[:, :s + 1]
        for j in range(3):
            out = head.dense(states, embeds[:, :s + 1 + j])                        # [1, s+1+j, D]
            torch.testing.assert_close(outs[j][:, s + j], out[:, -1], atol=1e-5, rtol=1e-5)
            states = torch.cat([states, out[:, -1:]], dim=1)


@torch.no_grad()
def test_head_drafter_gives_each_chain_token(target, data) -> None:
    """The drafter's row [i, t] is the chain's (i + 1)-th token, t + 1, drafted from the target's
    states up to t - 1 - i (the chain's earlier tokens accepted)."""
    head = random_head(TINY, 200, seed=6)
    embed = target.get_input_embeddings().weight
    tokens, feats = data["tokens"][0], data["features"][0].float()                 # [T], [T, 3D]
    rows = head_drafter(head, embed, 3)(tokens, feats)                             # [3, T, V]
    hidden, embeds = _inputs(target, head, data, 1)
    for s in (0, 6, 20):
        states = hidden[:, :s + 1]
        for i in range(3):
            out = head.dense(states, embeds[:, :s + 1 + i])[:, -1]                 # [1, D]
            want = head.logits(out)[0]                                             # [Vd]
            torch.testing.assert_close(rows[i, s + 1 + i, head.target_ids], want,
                                       atol=1e-5, rtol=1e-5)
            states = torch.cat([states, out[:, None]], dim=1)
    assert torch.isinf(rows[:, :, ~head.t2d]).all()


def test_training_lowers_the_loss_and_is_deterministic(target, data) -> None:
    ids = draft_vocab(data["tokens"], TINY.vocab_size, SPEC.draft_vocab)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    fixed = {k: v[:4] for k, v in data.items()}
    head = new_head(target, ids, SPEC.seed)
    with torch.no_grad():
        before, _ = batch_loss(head, embed, lm_head, fixed, SPEC)
    record = train_head(head, data, embed, lm_head, SPEC, steps=30, device=CPU)
    assert record["steps"] == 30
    with torch.no_grad():
        after, _ = batch_loss(head, embed, lm_head, fixed, SPEC)
    assert after < before - 0.3, (before, after)
    assert record["curve"][-1]["val_loss"] < record["curve"][0]["val_loss"]
    twins = [new_head(target, ids, SPEC.seed) for _ in range(2)]
    for twin in twins:
        train_head(twin, data, embed, lm_head, SPEC, steps=4, device=CPU)
    for a, b, c in zip(twins[0].parameters(), twins[1].parameters(), head.parameters(),
                       strict=True):
        assert torch.equal(a, b) and a.shape == c.shape
    assert not torch.equal(twins[0].fc.weight, head.fc.weight)


def test_draft_vocabulary_is_the_most_frequent_tokens() -> None:
    tokens = torch.tensor([[5, 5, 5, 2, 2, 9], [9, 7, 7, 1, 1, 5]])
    assert draft_vocab(tokens, 10, 3).tolist() == [1, 2, 5]  # 5: 4, then 1, 2, 7, 9: 2 each


def test_saved_head_loads_with_its_vocabulary(target, data, tmp_path: Path) -> None:
    ids = draft_vocab(data["tokens"], TINY.vocab_size, 150)
    head = new_head(target, ids, 0)
    save_head(head, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    loaded = EagleHead.load(tmp_path, TINY.num_hidden_layers)
    assert loaded.fc.weight.dtype == torch.float32
    assert loaded.target_ids.tolist() == ids.tolist()
    assert loaded.t2d.nonzero().flatten().tolist() == ids.tolist()
    assert loaded.config.aux_layers == AUX
    torch.testing.assert_close(loaded.lm_head.weight, head.lm_head.weight, atol=2e-2, rtol=1e-2)


def test_greedy_and_expected_steps_by_hand() -> None:
    seq = [9, 9, 1, 2, 3, 4, 5, 6]
    t_arg = [9, 1, 2, 3, 4, 5, 6, 0]             # the target's next token after each prefix
    proposals = [[0, 1, 2, 0, 4, 5, 6, 0], [0, 0, 2, 3, 0, 0, 6, 0]]
    # from 2: depth 0 at 1 ok, depth 1 at 2 ok -> 2; from 5: depth 0 at 4 ok, depth 1 at 5 no
    # -> 1; from 7: depth 0 at 6 ok (the last token) -> 1
    assert greedy_steps(seq, t_arg, proposals, 2, 2) == [2, 1, 1]
    alpha = [[0.5] * 6, [0.5] * 6]
    assert expected_steps(alpha, 2, 6, 2) == [0.75] * 3


def test_acceptance_of_an_oracle_is_k(target) -> None:
    prompt = torch.randint(1, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    k = 4
    seq = generate(target, prompt, 20, 0.0, 0)[0]                                    # [28]

    def oracle(tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return target(tokens[None]).logits[0].float().expand(k, -1, -1)

    head = random_head(TINY, 200, seed=5)
    drafters = {"oracle": oracle, "head": head_drafter(head, target.get_input_embeddings().weight,
                                                       k)}
    greedy = acceptance(target, [seq], 8, drafters, k, 0.0, AUX)
    assert greedy["oracle"] == [4, 4, 4, 4]
    assert all(0 <= a <= k for a in greedy["head"]) and sum(greedy["head"]) < 16
    sampled = acceptance(target, [seq], 8, drafters, k, 0.8, AUX)
    assert sampled["oracle"] == pytest.approx([4.0] * 17, abs=1e-4)
    assert all(0 <= a < 4 for a in sampled["head"])
