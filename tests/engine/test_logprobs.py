"""The target's log-probabilities of emitted tokens: those of the target decoding alone at each
position, from a tree step and a chain step alike, and asking for them changes no token."""

from __future__ import annotations

from pathlib import Path

import torch

from spin.engine.logprobs import emitted_logprobs
from spin.engine.model_runner import ModelRunner
from spin.engine.rejection import Verdict
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest
from spin.zoo.corpus import heldout_prompts


def test_rows_follow_the_accepted_path() -> None:
    logits = torch.randn(6, 11)                                                  # [N + 1, V]
    out = emitted_logprobs(logits, Verdict(accepted=(1, 4), tokens=(3, 8, 2)), top=3)
    ref = logits.log_softmax(-1)
    assert [round(t.logprob, 5) for t in out] == [round(float(ref[r, tok]), 5)
                                                  for r, tok in ((0, 3), (2, 8), (5, 2))]
    ids, values = zip(*out[1].top)
    assert list(ids) == ref[2].topk(3).indices.tolist()
    assert list(values) == sorted(values, reverse=True)
    assert all(t.top == () for t in emitted_logprobs(logits, Verdict((), (5,)), top=0))


def test_logprobs_are_the_targets_and_change_no_token(family_dir: Path, target,
                                                      tokenizer) -> None:
    text = heldout_prompts(family_dir)[0]["prompt"]
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"][-40:]

    def run(logprobs: int | None) -> list:
        verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=2, max_model_len=128,
                                        kv_cache_bytes=8 << 20))
        out = [verifier.verify([VerifyRequest("r", prompt, TokenTree((), ()),
                                              logprobs=logprobs)])[0]]
        context = list(prompt) + list(out[0].tokens)
        # a chain that agrees for two tokens, then a branching tree
        with torch.no_grad():
            alone = target(torch.tensor([context])).logits[0, -1].argmax().item()
        chain = TokenTree.chain([alone, alone, 7])
        out.append(verifier.verify([VerifyRequest("r", (), chain, keep=len(context),
                                                  logprobs=logprobs)])[0])
        context += out[-1].tokens
        with torch.no_grad():
            alone = target(torch.tensor([context])).logits[0, -1].argmax().item()
        tree = TokenTree((5, alone, 9, 11), (-1, -1, 1, 1))  # two roots, the second branching
        out.append(verifier.verify([VerifyRequest("r", (), tree, keep=len(context),
                                                  logprobs=logprobs)])[0])
        return out

    plain, with_lp = run(None), run(4)
    assert [v.tokens for v in plain] == [v.tokens for v in with_lp]
    assert all(v.logprobs is None for v in plain)
    context = list(prompt)
    for verdict in with_lp:
        assert len(verdict.logprobs) == len(verdict.tokens)
        for tok, lp in zip(verdict.tokens, verdict.logprobs):
            with torch.no_grad():
                ref = target(torch.tensor([context])).logits[0, -1].float().log_softmax(-1)
            assert abs(lp.logprob - float(ref[tok])) < 1e-3
            assert [i for i, _ in lp.top] == ref.topk(4).indices.tolist()
            assert lp.top[0][0] == tok  # greedy: the emitted token is the most likely
            context.append(tok)
