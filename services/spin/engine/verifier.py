"""The verify step: the target scores every request's token tree in one forward and decides.

Per request the verifier keeps the tokens its cache slot holds. Each step feeds the context tokens
the cache lacks (the tokens emitted by the last step) followed by the drafted tree, in one ragged
batch; the rows from the last context token on go to the acceptance rule (``rejection.py``); the
accepted path's keys and values are compacted into place and committed, the rest is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import RequestSlots
from .model_runner import ForwardItem, ModelRunner
from .rejection import Verdict, verify_greedy, verify_stochastic
from .sampling import SamplingParams, probs_from_logits
from .tree import TokenTree


@dataclass(frozen=True)
class VerifyRequest:
    """One request's part of a verification batch."""

    request_id: str
    """Stable id of the request (keys the verifier's cache slot)."""
    context: tuple[int, ...]
    """The request's whole token context: prompt + tokens emitted so far."""
    tree: TokenTree
    """Drafted tokens (empty: a plain target decoding step)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How the target's distribution is processed and sampled."""


class Verifier:
    """The target model with its per-request caches and generators."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.slots = RequestSlots(runner.cache)

    def release(self, request_id: str) -> None:
        """Free the request's cache slot; unknown ids are ignored (release is idempotent)."""
        self.slots.release(request_id)

    def _item(self, r: VerifyRequest) -> tuple[ForwardItem, int]:
        """The forward item (uncached context tail + tree) and the tail length."""
        slot, common = self.slots.sync(r.request_id, r.context, r.sampling.seed)
        tail = r.context[common:]
        if r.tree.is_chain:
            return ForwardItem(slot, tuple(tail) + r.tree.tokens), len(tail)
        parents = tuple(range(-1, len(tail) - 1)) + tuple(
            len(tail) - 1 if p < 0 else p + len(tail) for p in r.tree.parents)
        return ForwardItem(slot, tuple(tail) + r.tree.tokens, parents), len(tail)

    @torch.inference_mode()
    def verify(self, requests: list[VerifyRequest]) -> list[Verdict]:
        """Score and decide every request's tree in one target forward."""
        if not requests:
            return []
        built = [self._item(r) for r in requests]
        logits = self.runner.forward([item for item, _ in built])              # [B, Lq, V]
        verdicts = []
        for i, (r, (item, tail)) in enumerate(zip(requests, built)):
            rows = logits[i, tail - 1:tail + len(r.tree)]                       # [N + 1, V]
            if r.sampling.greedy:
                verdict = verify_greedy(r.tree, rows)
            else:
                verdict = verify_stochastic(r.tree, probs_from_logits(rows, r.sampling),
                                            self.slots.generator(r.request_id))
            base = len(r.context)
            self.runner.cache.compact(item.slot, [base + n for n in verdict.accepted], base)
            self.runner.cache.commit(item.slot, base + verdict.num_accepted)
            self.slots.hold(r.request_id, list(r.context) + [r.tree.tokens[n] for n in verdict.accepted])
            verdicts.append(verdict)
        return verdicts
