"""Structured output in the router: each step's drafts cut to what a request's grammar allows
with the rows the verifier restricts the target to, and the grammar itself as a drafter.

Every structured-output request (``RouterRequest.constraint``, ``engine/grammar.py``) sends the
verifier, with each task, the tokens its grammar allows at every row of the task's tree; a
drafted node the grammar rejects is cut before it goes (with the nodes under it), so no draft
crosses the grammar and the matcher never sees a token it has to undo. The emitted tokens then
advance the matcher (``streaming.py``).

Where the grammar allows exactly one token, the token is appended without verification
(``Streamer.jump_forward``: constrained decoding could emit nothing else, greedy or sampled;
the verifier takes it in as context with the next step). Where it forces text that more than one
tokenization spells, ``GrammarDrafts`` (drafter ``grammar``) drafts the text's tokens: a
model-free proposer of the pool like prompt lookup, offered to a request only when the grammar
forces something there (``matches``), chosen by the learned policy as one more arm with its own
statistics.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..engine.head_runner import HeadAsk
from ..engine.model_free import GRAMMAR
from ..engine.tree import TokenTree
from ..obs import metrics
from ..policy.base import StepChoice
from ..rpc.convert import subtree
from .proposers import Group, ModelFree, Proposals
from .requests import RouterRequest


def constrain(reqs: list[RouterRequest], trees: dict[str, TokenTree],
              asks: dict[str, HeadAsk]) -> dict[str, torch.Tensor]:
    """The allowed rows ([len(tree) + 1, W] int32) of every structured-output request of a step,
    by request id; ``trees`` cut in place to the nodes the grammar allows (a tree it rejects
    whole is dropped: a plain step), a head's stored draft in ``asks`` cut with it."""
    start = time.perf_counter()
    rows: dict[str, torch.Tensor] = {}
    for r in reqs:
        if r.constraint is None:
            continue
        rid = r.request_id
        tree = trees.get(rid)
        if tree is None or not len(tree):
            rows[rid] = r.constraint.allowed()
            continue
        kept, rows[rid] = r.constraint.restrict(tree)
        if len(kept) == len(tree):
            continue
        if kept:
            trees[rid] = subtree(tree, kept)
        else:
            del trees[rid]
        ask = asks.get(rid)
        if ask is not None and ask.stored:
            asks[rid] = replace(ask, stored=len(kept))
    if rows:
        metrics.GRAMMAR_SECONDS.inc(time.perf_counter() - start)
        metrics.GRAMMAR_STEPS.inc(len(rows))
    return rows


class GrammarDrafts(ModelFree):
    """Drafts the tokens a request's grammar forces next (module doc); nothing for a request
    without a grammar or where the grammar leaves a choice."""

    name = GRAMMAR
    can_score = False  # it predicts forced tokens only: no score of a request's text

    def matches(self, r: RouterRequest) -> int:
        return int(r.constraint is not None and bool(r.constraint.forced(1)))

    def draft(self, r: RouterRequest, c: StepChoice) -> TokenTree | None:
        if r.constraint is None:
            return None
        tokens = r.constraint.forced(c.k)
        return TokenTree.chain(tokens) if tokens else None

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        return Proposals()
