"""The verify step: the target scores every request's token tree in one forward and decides.

Per request the verifier keeps the request's context and what its cache holds (``sequences.py``).
Each step a request's context is updated by ``(keep, delta)`` (usually nothing: the verifier
appends the tokens it emits itself); the step feeds the context tokens the cache lacks followed by
the drafted tree, in one ragged batch; the rows from the last context token on go to the
acceptance rule (``rejection.py``); the accepted path's keys and values are compacted into place
and committed, the rest is given back.

When the KV cache has too few free blocks for the batch, the youngest requests first lose their
trees (a plain step needs fewer blocks; not a seeded sampling request, whose tokens would then
differ), then are preempted: their cache is dropped, their context kept, and they get no verdict
this step (``None``); verified again later, they recompute their cache and emit what they would
have (a seeded request draws the same numbers at the same step: ``Sequences.generator``).

With draft heads (``head_runner.py``), the forward also keeps the target's states of the layers
the heads read; each request's committed positions go to the feature log, and a request whose
task asks a head to draft gets the head's chain for its next step with its verdict. A draft
model loaded beside the target (``colocated.py``) drafts the same way, from the context alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .colocated import ColocatedDrafter
from .drafter import ModelDrafter
from .eagle import EagleHead
from .head_runner import (DraftTask, FeatureLog, HeadAsk, HeadRunner,
                          InVerifierDrafter)
from .logprobs import emitted_logprobs
from .model_runner import ForwardItem, ModelRunner
from .rejection import PendingVerdicts, Verdict, decide_batch
from .sampling import SamplingParams, seeded_generator
from .sequences import Sequence, Sequences, step_seed
from .token_mask import apply_allowed, restrict_draft
from .tree import TokenTree

Split = Callable[[list[tuple[int, int]]], list[list[int]]]
"""(new tokens, context after) per request -> groups of request indices, one forward each."""


@dataclass(frozen=True)
class VerifyRequest:
    """One request's part of a verification batch."""

    request_id: str
    """Stable id of the request (keys the verifier's cache sequence)."""
    delta: tuple[int, ...] | list[int]
    """Context tokens after the first ``keep`` (a new request: its whole context)."""
    tree: TokenTree
    """Drafted tokens (empty: a plain target decoding step)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How the target's distribution is processed and sampled."""
    keep: int = 0
    """Context tokens the verifier holds that still hold (``Sequences.apply``)."""
    logprobs: int | None = None
    """None: no log-probabilities; n: each emitted token's and its n most likely alternatives
    (``logprobs.py``)."""
    head: HeadAsk | None = None
    """A head's part: its stored draft as this step's tree, a draft for the next step."""
    allowed: torch.Tensor | None = None
    """Structured output: [R, W] int32, the tokens the request's grammar allows at each row of
    ``tree`` (``token_mask.py``; R = len(tree) + 1); None: every token."""


HEAD_SEED_OFFSET = 7919
"""A seeded request's head drafts draw from (seed + this, context length): their own numbers."""
HEAD_WINDOW = 256
"""Committed positions of each request whose target states are kept for the heads (a request
that starts using a head later starts the head's attention there)."""


@dataclass
class _Step:
    request: VerifyRequest
    seq: Sequence
    tree: TokenTree
    fed: int = 0
    """Context tokens this step feeds (its tail; set at launch)."""

    def new_tokens(self, seqs: Sequences) -> int:
        return len(self.seq.context) - seqs.cache.lengths[self.seq.seq] + len(self.tree)


class Verifier:
    """The target model with its per-request contexts, caches and generators."""

    def __init__(self, runner: ModelRunner, heads: dict[str, EagleHead] | None = None,
                 head_window: int = HEAD_WINDOW) -> None:
        """``heads``: draft heads by name (all reading the same target layers)."""
        self.runner = runner
        self.seqs = Sequences(runner.cache)
        self.heads: dict[str, InVerifierDrafter] = {}
        """The drafters inside the verifier by name: draft heads and colocated draft models."""
        self.features: tuple[int, ...] | None = None
        """The target layers whose states the heads read (None without heads)."""
        self.log = FeatureLog(head_window)
        self.head_seconds: dict[str, float] = {}
        """Seconds each head's drafts took in the last step (inside ``finish``)."""
        self._head_generator = seeded_generator(None, runner.device)
        for name, head in (heads or {}).items():
            self.add_head(name, head)

    def add_head(self, name: str, head: EagleHead) -> None:
        """Serve ``head`` as ``name``: on the target's device and dtype, a cache of as many
        positions as the target's (one layer)."""
        aux = tuple(head.config.aux_layers)
        if self.features is not None and aux != self.features:
            raise ValueError(f"head {name} reads target layers {list(aux)}, the others "
                             f"{list(self.features)}: one verifier's heads must agree")
        width = self.runner.embed.shape[1]
        if head.config.target_hidden_size != width:
            raise ValueError(f"head {name} is for a target of width "
                             f"{head.config.target_hidden_size}, this one's is {width}")
        if head.config.vocab_size > self.runner.vocab_size:
            raise ValueError(f"head {name} drafts over {head.config.vocab_size} tokens, the "
                             f"target scores {self.runner.vocab_size}")
        self.features = aux
        self.runner.keep_features(aux)  # every step keeps them: through the static steps too
        blocks = self.runner.cache.blocks
        head = head.to(self.runner.device, self.runner.dtype)
        self.heads[name] = HeadRunner(name, head, self.runner.embed, blocks.num_blocks,
                                      blocks.max_seqs, blocks.block_size)

    def add_colocated(self, drafter: ModelDrafter) -> None:
        """Serve a draft model inside the verifier, under its name (``colocated.py``)."""
        if drafter.name in self.heads:
            raise ValueError(f"the verifier already serves a drafter named {drafter.name}")
        self.heads[drafter.name] = ColocatedDrafter(drafter)

    def release(self, request_id: str) -> None:
        """Forget the request and free its cache; unknown ids are ignored (idempotent)."""
        self.seqs.release(request_id)
        self._forget_states(request_id)

    def _forget_states(self, request_id: str) -> None:
        self.log.release(request_id)
        for h in self.heads.values():
            h.release(request_id)

    def _fit(self, steps: list[_Step]) -> list[_Step]:
        """The steps that get blocks this batch: the youngest drop their trees, then are
        preempted, until the rest fit."""
        blocks, lengths = self.runner.cache.blocks, self.runner.cache.lengths

        def need(st: _Step) -> int:
            return blocks.needed(st.seq.seq, lengths[st.seq.seq] + st.new_tokens(self.seqs))

        if sum(need(st) for st in steps) <= blocks.free_blocks:
            return steps
        youngest = sorted(steps, key=lambda st: -st.seq.admitted)
        for st in youngest:  # a seeded sample would differ without its tree: preempted instead
            if len(st.tree) and (st.request.sampling.greedy or st.seq.seed is None):
                st.tree = TokenTree((), ())
                if sum(need(s) for s in steps) <= blocks.free_blocks:
                    return steps
        kept = list(steps)
        for st in youngest:
            if sum(need(s) for s in kept) <= blocks.free_blocks:
                break
            self.seqs.evict(st.request.request_id)
            self._forget_states(st.request.request_id)
            kept.remove(st)
        return kept

    @torch.inference_mode()
    def verify(self, requests: list[VerifyRequest], split: Split | None = None,
               ) -> list[Verdict | None]:
        """Update every request's context, then score and decide every tree (in one forward, or
        one per group of ``split``); ``None`` for a request preempted for lack of blocks."""
        return self.start(requests, split).finish()

    @torch.inference_mode()
    def start(self, requests: list[VerifyRequest], split: Split | None = None) -> PendingStep:
        """``verify`` up to the decisions' copy to the host: contexts updated, every forward and
        decision queued on the device. Until its ``finish`` the step's requests must not be
        verified again; other requests may (the next micro-batch is prepared and queued while
        the device computes this one)."""
        if not requests:
            return PendingStep(self, [], [])
        self.seqs.tick()
        max_len = self.runner.max_len
        steps = []
        for r in requests:
            s = self.seqs.apply(r.request_id, r.keep, r.delta, r.sampling.seed)
            if len(s.context) >= max_len:
                raise ValueError(f"{r.request_id}: context of {len(s.context)} tokens is full "
                                 f"(max model length {max_len})")
            tree = self._tree(r, s)
            if r.allowed is not None:  # a draft drawn given the grammar allowed it
                tree = restrict_draft(tree, r.allowed)
            tree = tree if len(s.context) + len(tree) < max_len else TokenTree((), ())
            steps.append(_Step(r, s, tree))
        runnable = self._fit(steps)
        sizes = [(st.new_tokens(self.seqs), len(st.seq.context) + len(st.tree)) for st in runnable]
        groups = split(sizes) if split and runnable else [list(range(len(runnable)))]
        launched = [self._launch([runnable[j] for j in g]) for g in groups if g]
        return PendingStep(self, [r.request_id for r in requests], launched)

    def _tree(self, r: VerifyRequest, s: Sequence) -> TokenTree:
        """The step's tree: the task's, or its head's stored draft (with the distributions
        its tokens were drawn from) when the task says so and the tokens agree."""
        if not self.heads:
            return r.tree
        valid = self.runner.cache.lengths[s.seq]
        self.log.truncate(r.request_id, valid)
        for h in self.heads.values():
            h.rollback(r.request_id, valid)
        ask = r.head
        if ask is None or ask.stored <= 0 or ask.name not in self.heads:
            return r.tree
        d = self.heads[ask.name].stored(r.request_id, len(s.context))
        n = ask.stored
        if d is None or r.tree.tokens != d.tokens[:n] or not r.tree.is_chain:
            return TokenTree((), ())  # not what the head drafted: a plain step
        return TokenTree.chain(list(d.tokens[:n]), d.probs[:n] if d.probs is not None else None)

    def _launch(self, steps: list[_Step]) -> _Launched:
        items: list[ForwardItem] = []
        starts: list[int] = []
        for st in steps:
            tail = self.seqs.feed(st.seq)
            st.fed = len(tail)
            tree = st.tree
            parents = None if tree.is_chain else tuple(range(-1, len(tail) - 1)) + tuple(
                len(tail) - 1 if p < 0 else p + len(tail) for p in tree.parents)
            items.append(ForwardItem(st.seq.seq, tail + list(tree.tokens), parents))
            starts.append(len(tail) - 1)  # rows from the last context token on
        logits = self.runner.forward(items, logits_from=starts,
                                     features=self.features)                  # [B, N + 1, V]
        raw: dict[int, torch.Tensor] = {}
        for i, st in enumerate(steps):  # structured output: the grammar's rows only
            if st.request.allowed is not None:
                if st.request.logprobs is not None:  # reported from the model's own rows
                    raw[i] = logits[i].clone()
                apply_allowed(logits[i, :len(st.tree) + 1], st.request.allowed)
        pending = decide_batch(logits, [0] * len(steps), [st.tree for st in steps],
                               [st.request.sampling for st in steps],
                               [self.seqs.generator(st.seq) for st in steps])
        return _Launched(steps, logits, pending, self.runner.features, raw)

    def _draft(self, steps: list[_Step], verdicts: dict[str, Verdict]) -> None:
        """The heads' drafts for the next step of the requests that asked, into their
        verdicts (``Verdict.head_draft``)."""
        by_head: dict[str, list[DraftTask]] = {}
        for st in steps:
            ask, rid = st.request.head, st.request.request_id
            if ask is None or ask.k <= 0 or ask.name not in self.heads or rid not in verdicts:
                continue
            sp, gen = st.request.sampling, None
            if not sp.greedy:
                gen = (seeded_generator(step_seed(st.seq.seed + HEAD_SEED_OFFSET,
                                                  len(st.seq.context)), self.runner.device)
                       if st.seq.seed is not None else self._head_generator)
            by_head.setdefault(ask.name, []).append(
                DraftTask(rid, st.seq.context, ask.k, sp, gen))
        self.head_seconds = {}
        for name, tasks in by_head.items():
            t0 = time.perf_counter()
            for rid, d in self.heads[name].draft(tasks, self.log).items():
                verdicts[rid] = replace(verdicts[rid], head_draft=d.tokens)
            self.head_seconds[name] = time.perf_counter() - t0

    def _settle(self, launched: _Launched) -> dict[str, Verdict]:
        """A group's verdicts: log-probabilities, the accepted path compacted and committed."""
        cache, out = self.runner.cache, {}
        for b, (st, verdict) in enumerate(zip(launched.steps, launched.pending.verdicts())):
            if st.request.logprobs is not None:
                verdict = replace(verdict, logprobs=tuple(emitted_logprobs(
                    launched.raw.get(b, launched.logits[b]), verdict, st.request.logprobs)))
            base = len(st.seq.context)
            if launched.features is not None:  # the committed positions' states, for the heads
                rows = list(range(st.fed)) + [st.fed + n for n in verdict.accepted]
                self.log.record(st.request.request_id, base - st.fed,
                                launched.features[b, rows])
            cache.compact(st.seq.seq, [base + n for n in verdict.accepted], base)
            cache.commit(st.seq.seq, base + verdict.num_accepted)
            st.seq.context.extend(verdict.tokens)
            out[st.request.request_id] = verdict
        return out


@dataclass
class _Launched:
    """One forward of a step, queued: its requests, logits [B, N + 1, V] and decisions."""

    steps: list[_Step]
    logits: torch.Tensor
    pending: PendingVerdicts
    features: torch.Tensor | None = None
    """[B, Lq, F] the target's states the heads read (None without heads)."""
    raw: dict[int, torch.Tensor] = field(default_factory=dict)
    """Batch row -> its logits [N + 1, V] before the grammar restricted them (structured
    output with log-probabilities: those report the model's own distribution)."""


@dataclass
class PendingStep:
    """A verification step queued by ``Verifier.start``."""

    verifier: Verifier
    request_ids: list[str]
    """The step's requests, in order (a preempted one gets None)."""
    launched: list[_Launched]
    _result: list[Verdict | None] | None = None

    def ready(self) -> bool:
        """Whether ``finish`` would return without waiting for the device."""
        return self._result is not None or all(x.pending.ready() for x in self.launched)

    @torch.inference_mode()
    def finish(self) -> list[Verdict | None]:
        """Wait for the decisions, commit the accepted tokens; the verdicts in request order
        (``None``: preempted). Idempotent."""
        if self._result is None:
            verdicts: dict[str, Verdict] = {}
            for x in self.launched:
                verdicts.update(self.verifier._settle(x))
            self.verifier._draft([st for x in self.launched for st in x.steps], verdicts)
            self._result = [verdicts.get(rid) for rid in self.request_ids]
        return self._result
