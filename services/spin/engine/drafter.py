"""Drafting: model drafters (any small checkpoint) and the model-free prompt-lookup drafter.

Both take a batch of ``DraftRequest`` and return one ``TokenTree`` per request. A request may use a
different drafter at every step: a drafter keeps each request's context, updated by
``(keep, delta)`` (``sequences.py``), and a model drafter feeds what its cache lacks of it before
drafting (catch-up), so switching in costs one prefill of the missing context.

Tree shape: ``branching[d]`` children per node at depth d+1 (e.g. (2, 1, 1) = two branches of three
tokens), a chain of ``k`` when ``branching`` is empty. Greedy requests take the top-b tokens of the
draft distribution (one-hot drafts); sampling requests draw b i.i.d. tokens from it and ship the
distribution rows, which stochastic verification needs. Those rows are rounded to fp16 before the
draw (the draw uses the rounded values, normalised), so the rows that travel as fp16 bytes are
exactly the distribution the tokens were drawn from.

A model drafter's KV cache has a block budget: when a batch needs more blocks than are free, the
caches of requests not in the batch are dropped, least recently used first (their contexts stay;
they catch up when drafted again), then the batch's youngest requests get no draft this step.
Each level of a draft is one forward and one copy of the chosen tokens to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple, Protocol

import torch

from .model_runner import ForwardItem, ModelRunner
from .prompt_lookup import PROMPT_LOOKUP, prompt_lookup
from .sampling import SamplingParams, probs_from_logits
from .sequences import Sequence, Sequences
from .tree import TokenTree


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter needs to propose for one request."""

    request_id: str
    """Stable id of the request (keys the drafter's per-request state)."""
    delta: tuple[int, ...] | list[int]
    """Context tokens after the first ``keep`` (a new request: its whole context)."""
    k: int
    """Speculation length (tree depth); 0 = no speculation."""
    branching: tuple[int, ...] = ()
    """Children per node at each depth; () = a chain of k."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The request's sampling parameters (draft distributions use the same transform)."""
    stop_below: float = 0.0
    """A chain stops growing once the product of its tokens' draft probabilities (the greedy
    token's softmax probability; a sampled token's probability under the draft distribution)
    falls below this; the token that crosses the line is kept. 0 = always ``k`` tokens."""
    keep: int = 0
    """Context tokens the drafter holds that still hold (``Sequences.apply``)."""
    context_probs: tuple[float, ...] | list[float] = ()
    """Scoring a sampling request: the target's probability of each ``delta`` token (0 =
    unknown), for the acceptance estimate of ``ModelDrafter.score``; () = none."""

    def target_prob(self, position: int) -> float:
        """The target's probability of context token ``position`` (0.0 when unknown)."""
        i = position - self.keep
        return float(self.context_probs[i]) if 0 <= i < len(self.context_probs) else 0.0

    def shape(self, k: int | None = None) -> tuple[int, ...]:
        """Children per node for each of the k levels."""
        k = self.k if k is None else k
        return tuple(self.branching[d] if d < len(self.branching) else 1 for d in range(k))

    def tree_size(self, k: int) -> int:
        """Nodes of this request's tree at depth ``k``."""
        size, width = 0, 1
        for b in self.shape(k):
            width *= b
            size += width
        return size


class Score(NamedTuple):
    """How well a drafter predicts one request's context (``ModelDrafter.score``)."""

    matches: int
    """Scored positions whose token equals the drafter's greedy prediction."""
    positions: int
    """Positions scored."""
    accepted: float = 0.0
    """With the target's probabilities (a sampling request): the sum of min(1, q(x) / p(x))
    over the scored positions where p is known, q the drafter's processed distribution. Since
    x was drawn from p, its expectation is sum_x min(p, q) per position: what a sampled draft
    token is accepted with (``rejection.py``)."""
    accepted_positions: int = 0
    """Scored positions ``accepted`` covers (0: no estimate)."""


class Drafter(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]: ...

    def held(self, request_id: str) -> int:
        """Context tokens the drafter holds for the request (the ``keep`` to send next)."""

    def release(self, request_id: str) -> None: ...


class PromptLookupDrafter:
    """Model-free n-gram drafting from the request's own context (chains only, one-hot drafts)."""

    name = PROMPT_LOOKUP

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self._contexts: dict[str, list[int]] = {}

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        out = []
        for r in requests:
            ctx = self._contexts.setdefault(r.request_id, [])
            del ctx[r.keep:]
            ctx.extend(r.delta)
            out.append(TokenTree.chain(prompt_lookup(ctx, r.k, self.max_ngram)))
        return out

    def held(self, request_id: str) -> int:
        return len(self._contexts.get(request_id, ()))

    def release(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)


@dataclass
class _Draft:
    """One request's draft in progress."""

    request: DraftRequest
    seq: Sequence
    k: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    """fp16 draft distribution [V'] of each node (sampling requests)."""
    frontier: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(node, logits [V'] after it) of the nodes whose children come next."""
    leaves: list[int] = field(default_factory=list)
    sure: float = 1.0
    """A chain's probability so far (``stop_below``)."""
    generator: torch.Generator | None = None
    """The request's generator for this step (sampling)."""
    second: list[int] = field(default_factory=list)
    """A greedy chain's runner-up token at each node's position."""

    @property
    def chain(self) -> bool:
        return not self.request.branching or max(self.request.branching) <= 1

    def growing(self, depth: int) -> bool:
        return depth < self.k and self.sure >= self.request.stop_below

    def add(self, parent: int, tokens: list[float]) -> None:
        """Children of ``parent`` (token ids as the host copy gives them)."""
        for tok in tokens:
            self.tokens.append(int(tok))
            self.parents.append(parent)
            self.leaves.append(len(self.tokens) - 1)

    def add_second(self, token: list[float]) -> None:
        self.second.append(int(token[0]))

    def scale(self, prob: list[float]) -> None:
        self.sure *= prob[0]


class ModelDrafter:
    """A draft model with its own KV cache; drafts all requests of a batch level by level."""

    def __init__(self, name: str, runner: ModelRunner) -> None:
        self.name = name
        self.runner = runner
        self.seqs = Sequences(runner.cache, seed_offset=1)  # a stream apart from the verifier's
        self.evictions = 0
        """Caches of idle requests dropped for lack of blocks (the service's metric)."""

    def release(self, request_id: str) -> None:
        """Forget the request and free its cache (finished, cancelled, or switched away)."""
        self.seqs.release(request_id)

    def held(self, request_id: str) -> int:
        return self.seqs.held(request_id)

    def _prepare(self, requests: list[DraftRequest], draft: bool) -> list[tuple[DraftRequest, Sequence, int]]:
        """Update every request's context; (request, sequence, k) of those that get blocks for
        their catch-up and (with ``draft``) their tree (k lowered to fit the context)."""
        self.seqs.tick()
        blocks, lengths, max_len = self.runner.cache.blocks, self.runner.cache.lengths, self.runner.max_len
        work, need = [], {}
        for r in requests:
            if r.request_id not in self.seqs and (r.keep or not blocks.free_seqs):
                continue  # unknown here, or no sequence id free: nothing for it this step
            s = self.seqs.apply(r.request_id, r.keep, r.delta, r.sampling.seed)
            k = r.k if draft else 0
            while k > 0 and len(s.context) + r.tree_size(k) > max_len:
                k -= 1
            if (draft and k <= 0) or len(s.context) >= max_len:
                continue
            need[r.request_id] = blocks.needed(s.seq, len(s.context) + r.tree_size(k))
            work.append((r, s, k))
        total = sum(need.values())
        if total > blocks.free_blocks:
            busy = set(need)
            for idle in sorted((x for x in self.seqs if x.request_id not in busy
                                and lengths[x.seq] > 0), key=lambda x: x.last_used):
                self.seqs.evict(idle.request_id)
                self.evictions += 1
                if total <= blocks.free_blocks:
                    break
            for r, s, k in sorted(work, key=lambda w: -w[1].admitted):
                if total <= blocks.free_blocks:
                    break
                work.remove((r, s, k))
                total -= need[r.request_id]
        return work

    @torch.inference_mode()
    def score(self, requests: list[DraftRequest], start: list[int]) -> list[Score]:
        """How well this model predicts each request's context, over the context positions from
        ``start`` on whose preceding token the cache lacked (all but the first token it is fed):
        how many equal the greedy prediction from the tokens before them (for greedy decoding:
        this drafter's acceptance rate on that text) and, for a sampling request that sent the
        target's probabilities, the expected accepted tokens of sampled drafts (``Score``).
        The prefill stays in the cache for later drafts."""
        work = self._prepare(requests, draft=False)
        out = {r.request_id: Score(0, 0) for r in requests}
        if not work:
            return list(out.values())
        fed = [self.seqs.feed(s) for _, s, _ in work]
        at = {r.request_id: f for r, f in zip(requests, start)}
        # fed row t predicts context[first + t + 1]: the rows from lo on predict positions >= start
        los = [min(max(0, at[r.request_id] - (len(s.context) - len(f)) - 1), len(f) - 1)
               for (r, s, _), f in zip(work, fed)]
        logits = self.runner.forward([ForwardItem(s.seq, f) for (_, s, _), f in zip(work, fed)],
                                     logits_from=los)                                   # [B, Lr, V']
        preds = logits.argmax(-1).tolist()                                              # [B, Lr]
        for i, ((r, s, _), f, lo) in enumerate(zip(work, fed, los)):
            self.runner.cache.commit(s.seq, len(s.context))
            if len(f) - 1 > lo:
                n = len(f) - 1 - lo
                hits = sum(p == w for p, w in zip(preds[i], f[lo + 1:]))
                first = len(s.context) - len(f) + lo + 1  # context position of the first scored
                out[r.request_id] = Score(hits, n, *_sampled_acceptance(
                    r, logits[i, :n], f[lo + 1:], first))
        return list(out.values())

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        trees: dict[str, TokenTree] = {r.request_id: TokenTree((), ()) for r in requests}
        work = self._prepare(requests, draft=True)
        if not work:
            return list(trees.values())
        items = [ForwardItem(s.seq, self.seqs.feed(s)) for _, s, _ in work]
        last = self.runner.forward(items, last_only=True)[:, 0]                        # [B, V']
        drafts = []
        for i, (r, s, k) in enumerate(work):
            self.runner.cache.commit(s.seq, len(s.context))
            drafts.append(_Draft(r, s, k, frontier=[(-1, last[i])],
                                 generator=None if r.sampling.greedy else self.seqs.generator(s)))
        for depth in range(max(d.k for d in drafts)):
            level = [d for d in drafts if d.growing(depth)]
            if not level:
                break
            self._expand(level, depth)
            grow = [d for d in level if d.growing(depth + 1) and d.leaves]
            if not grow:
                break
            # A chain feeds only its new leaf and keeps it (a drafted token sits at the position
            # it would have in the context, so the next step reuses it when it is accepted); a
            # tree re-feeds all its nodes with their tree mask and keeps none.
            out = self.runner.forward(
                [ForwardItem(d.seq.seq, (d.tokens[-1],)) if d.chain
                 else ForwardItem(d.seq.seq, tuple(d.tokens), tuple(d.parents)) for d in grow],
                last_only=all(d.chain for d in grow))
            for i, d in enumerate(grow):  # logits at the new leaves drive the next level
                if d.chain:
                    seq = d.seq.seq
                    self.runner.cache.commit(seq, self.runner.cache.lengths[seq] + 1)
                    d.seq.drafted.append(d.tokens[-1])
                    d.frontier = [(d.leaves[0], out[i, 0])]
                else:
                    d.frontier = [(n, out[i, n]) for n in d.leaves]
        for d in drafts:
            probs = torch.stack(d.rows) if d.rows else None
            trees[d.request.request_id] = TokenTree(tuple(d.tokens), tuple(d.parents), probs,
                                                    tuple(d.second))
        return list(trees.values())

    def _expand(self, level: list[_Draft], depth: int) -> None:
        """Add the children of every frontier node of every draft in ``level``: top-b of the
        logits (greedy) or b draws from the fp16-rounded distribution (sampling); one copy of
        the chosen tokens and the chains' probabilities to the host."""
        segments: list[tuple[torch.Tensor, Callable[[list[float]], None]]] = []
        for d in level:
            d.leaves = []
        greedy = [(d, node, row) for d in level if d.request.sampling.greedy
                  for node, row in d.frontier]
        if greedy:
            rows = torch.stack([row for _, _, row in greedy])                          # [F, V']
            width = max(2, *(d.request.shape(d.k)[depth] for d, _, _ in greedy))
            top = rows.topk(min(width, rows.shape[-1])).indices                         # [F, W]
            for f, (d, node, row) in enumerate(greedy):
                segments.append((top[f, :d.request.shape(d.k)[depth]], partial(d.add, node)))
                if d.chain and top.shape[1] > 1:  # its runner-up (``TokenTree.second``)
                    segments.append((top[f, 1:2], d.add_second))
                if d.chain and d.request.stop_below > 0:  # the chosen token's probability
                    segments.append((torch.softmax(row.float(), -1)[top[f, :1]], d.scale))
        for d in level:
            if d.request.sampling.greedy:
                continue
            width = d.request.shape(d.k)[depth]
            for node, row in d.frontier:
                q = probs_from_logits(row, d.request.sampling).half()                    # [V']
                picks = torch.multinomial(q.float(), width, replacement=True,
                                          generator=d.generator)                         # [w]
                d.rows.extend([q] * width)
                segments.append((picks, partial(d.add, node)))
                if d.chain and d.request.stop_below > 0:
                    segments.append((q[picks[:1]].float() / q.float().sum(), d.scale))
        host = torch.cat([t.float() for t, _ in segments]).tolist()  # the level's one copy
        pos = 0
        for t, consume in segments:
            consume(host[pos:pos + t.numel()])
            pos += t.numel()


def _sampled_acceptance(r: DraftRequest, logits: torch.Tensor, tokens: list[int],
                        first: int) -> tuple[float, int]:
    """``Score.accepted`` and ``accepted_positions`` of ``tokens`` (context positions ``first``
    on), ``logits`` [n, V'] the drafter's rows that predict them; (0.0, 0) for greedy requests
    or without the target's probabilities."""
    if r.sampling.greedy or not r.context_probs:
        return 0.0, 0
    p = torch.tensor([r.target_prob(first + t) for t in range(len(tokens))])           # [n]
    known = (p > 0) & (p <= 1)  # anything else: unknown
    if not bool(known.any()):
        return 0.0, 0
    q_all = probs_from_logits(logits, r.sampling)                                       # [n, V']
    x = torch.tensor(tokens, device=q_all.device)                                       # [n]
    inside = x < q_all.shape[-1]  # a token past the draft vocabulary: q(x) = 0
    q = torch.where(inside, q_all.gather(1, x.clamp(max=q_all.shape[-1] - 1)[:, None])[:, 0],
                    torch.zeros((), device=q_all.device)).cpu()                        # [n]
    ratio = torch.clamp(q / p.clamp(min=1e-30), max=1.0)
    return float(ratio[known].sum()), int(known.sum())
