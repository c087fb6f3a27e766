"""Drafters inside the verifier (draft heads, colocated draft models), driven step by step as
the router drives them: generation that verifies each step's stored draft (``generate``), and
the sampled-distribution check (``two_tokens``: each asked for a chain with a prompt's first
token, its stored draft verified for the second; the pairs must follow ``joint``)."""

from __future__ import annotations

import torch

from spin.engine.head_runner import HeadAsk
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest


def generate(v: Verifier, prompts: list[list[int]], n: int, name: str | None,
             rest_every: int = 0) -> tuple[list[list[int]], int]:
    """Each prompt's first ``n`` greedy tokens and the drafted tokens accepted: every step
    verifies drafter ``name``'s last chain and asks for the next (k from 1 to 4 by request; none
    every ``rest_every``-th step); ``name`` None: plain steps."""
    out: list[list[int]] = [[] for _ in prompts]
    drafts: dict[int, tuple[int, ...]] = {}
    accepted, step = 0, 0
    while any(len(o) < n for o in out):
        reqs, idx = [], []
        for i, p in enumerate(prompts):
            if len(out[i]) >= n:
                continue
            d = drafts.get(i, ())
            keep = len(p) + len(out[i]) if out[i] else 0  # the verifier holds all it was told
            k = 0 if rest_every and step % rest_every == rest_every - 1 else 1 + i % 4
            reqs.append(VerifyRequest(f"r{i}", [] if keep else p, TokenTree.chain(list(d)),
                                      keep=keep, head=HeadAsk(name, k=k, stored=len(d))
                                      if name else None))
            idx.append(i)
        for i, verdict in zip(idx, v.verify(reqs)):
            out[i] += list(verdict.tokens)
            drafts[i] = verdict.head_draft
            accepted += verdict.num_accepted
        step += 1
    return [o[:n] for o in out], accepted


def two_tokens(v: Verifier, name: str, prompt: list[int], vocab: int, batches: int = 48,
               width: int = 64) -> tuple[torch.Tensor, int, int]:
    """(counts [V, V] of the first two sampled tokens, draft tokens, accepted tokens) over
    ``batches`` x ``width`` requests, temperature 1."""
    sp = SamplingParams(temperature=1.0)
    counts = torch.zeros(vocab, vocab)
    drafted = accepted = 0
    for batch in range(batches):
        ids = [f"b{batch}-{i}" for i in range(width)]
        first = v.verify([VerifyRequest(rid, prompt, TokenTree((), ()), sp,
                                        head=HeadAsk(name, k=2)) for rid in ids])
        second = v.verify([VerifyRequest(rid, [], TokenTree.chain(list(f.head_draft)), sp,
                                         keep=len(prompt) + 1,
                                         head=HeadAsk(name, stored=len(f.head_draft)))
                           for rid, f in zip(ids, first)])
        for f, s in zip(first, second):
            counts[f.tokens[0], s.tokens[0]] += 1
            drafted += len(f.head_draft)
            accepted += s.num_accepted
        for rid in ids:
            v.release(rid)
    return counts, drafted, accepted


def joint(model, prompt: list[int], vocab: int) -> torch.Tensor:
    """The target's probabilities of the first two tokens after ``prompt`` [V * V]."""
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)             # [V]
        p2 = torch.softmax(model(torch.tensor([prompt + [a] for a in range(vocab)]))
                           .logits[:, -1], -1)                                          # [V, V]
    return (p1[:, None] * p2).flatten()
