"""Drafting: model drafters (any small checkpoint) and the model-free prompt-lookup drafter.

Both take a batch of ``DraftRequest`` and return one ``TokenTree`` per request. A request may use a
different drafter at every step: a model drafter keeps the tokens its cache holds per request and,
before drafting, rolls back to the longest common prefix with the request's context and feeds the
rest (catch-up), so switching in costs one prefill of the missing context.

Tree shape: ``branching[d]`` children per node at depth d+1 (e.g. (2, 1, 1) = two branches of three
tokens), a chain of ``k`` when ``branching`` is empty. Greedy requests take the top-b tokens of the
draft distribution (one-hot drafts); sampling requests draw b i.i.d. tokens from it and ship the
distribution rows, which stochastic verification needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .kv_cache import RequestSlots
from .model_runner import ForwardItem, ModelRunner
from .prompt_lookup import prompt_lookup
from .sampling import SamplingParams, probs_from_logits
from .tree import TokenTree


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter needs to propose for one request."""

    request_id: str
    """Stable id of the request (keys the drafter's per-request state)."""
    context: tuple[int, ...]
    """The request's whole token context: prompt + tokens emitted so far."""
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

    def shape(self) -> tuple[int, ...]:
        """Children per node for each of the k levels."""
        return tuple(self.branching[d] if d < len(self.branching) else 1 for d in range(self.k))


class Drafter(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]: ...

    def release(self, request_id: str) -> None: ...


class PromptLookupDrafter:
    """Model-free n-gram drafting from the request's own context (chains only, one-hot drafts)."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        return [TokenTree.chain(prompt_lookup(r.context, r.k, self.max_ngram)) for r in requests]

    def release(self, request_id: str) -> None:
        return None


class ModelDrafter:
    """A draft model with its own KV cache; drafts all requests of a batch level by level."""

    def __init__(self, name: str, runner: ModelRunner) -> None:
        self.name = name
        self.runner = runner
        self.slots = RequestSlots(runner.cache, seed_offset=1)  # a stream apart from the verifier's

    def release(self, request_id: str) -> None:
        """Free the request's cache slot (finished, cancelled, or switched away for good)."""
        self.slots.release(request_id)

    def _catch_up_item(self, r: DraftRequest) -> ForwardItem:
        """The item that feeds what the slot lacks of the context (at least the last token,
        whose logits draft the first level)."""
        slot, common = self.slots.sync(r.request_id, r.context, r.sampling.seed)
        return ForwardItem(slot, tuple(r.context[common:]))

    @torch.inference_mode()
    def score(self, requests: list[DraftRequest], start: list[int]) -> list[tuple[int, int]]:
        """How well this model predicts each request's context: (matches, positions) over the
        context positions from ``start`` on whose preceding token the slot lacked (all but the
        first token it is fed), ``matches`` of them equal to the greedy prediction from the
        tokens before them (for greedy decoding: this drafter's acceptance rate on that text).
        The prefill stays in the cache for later drafts."""
        if not requests:
            return []
        items = [self._catch_up_item(r) for r in requests]
        logits = self.runner.forward(items)                                        # [B, Lq, V]
        out = []
        for i, (r, it, s) in enumerate(zip(requests, items, start)):
            n, first = len(it.tokens), len(r.context) - len(it.tokens)  # fed = context[first:]
            self.runner.cache.commit(it.slot, len(r.context))
            self.slots.hold(r.request_id, list(r.context))
            lo = max(0, s - first - 1)  # logits row t predicts context[first + t + 1]
            if n - 1 <= lo:
                out.append((0, 0))
                continue
            pred = logits[i, lo: n - 1].argmax(-1)                                  # [P]
            want = torch.tensor(it.tokens[lo + 1:], device=pred.device)             # [P]
            out.append((int((pred == want).sum()), n - 1 - lo))
        return out

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        active = [r for r in requests if r.k > 0]
        trees: dict[str, TokenTree] = {r.request_id: TokenTree((), ()) for r in requests}
        if not active:
            return [trees[r.request_id] for r in requests]
        items = [self._catch_up_item(r) for r in active]
        last = self.runner.forward(items, last_only=True)[:, 0]                # [B, V]
        for r, it in zip(active, items):
            self.runner.cache.commit(it.slot, len(r.context))
        nodes = {r.request_id: ([], [], []) for r in active}  # tokens, parents, prob rows (sampling)
        frontier = {r.request_id: [(-1, last[i])] for i, r in enumerate(active)}  # (node, logits)
        held = {r.request_id: list(r.context) for r in active}
        chain = {r.request_id: not r.branching or max(r.branching) <= 1 for r in active}
        sure = {r.request_id: 1.0 for r in active}  # a chain's probability so far
        leaves: dict[str, list[int]] = {}
        for depth in range(max(r.k for r in active)):
            for r in active:
                if depth < r.k and sure[r.request_id] >= r.stop_below:
                    leaves[r.request_id] = self._expand(r, depth, nodes[r.request_id],
                                                        frontier[r.request_id])
                    if r.stop_below > 0 and chain[r.request_id]:
                        sure[r.request_id] *= self._chosen_prob(r, nodes[r.request_id],
                                                                frontier[r.request_id][0][1])
            level = [r for r in active if depth + 1 < r.k and leaves[r.request_id]
                     and sure[r.request_id] >= r.stop_below]
            if not level:
                break
            # A chain feeds only its new leaf and keeps it (a drafted token sits at the position
            # it would have in the context, so the next step reuses it when it is accepted); a
            # tree re-feeds all its nodes with their tree mask and keeps none.
            out = self.runner.forward(
                [ForwardItem(self.slots.slot(r.request_id), (nodes[r.request_id][0][-1],))
                 if chain[r.request_id] else
                 ForwardItem(self.slots.slot(r.request_id), tuple(nodes[r.request_id][0]),
                             tuple(nodes[r.request_id][1])) for r in level],
                last_only=all(chain[r.request_id] for r in level))
            for i, r in enumerate(level):  # logits at the new leaves drive the next level
                rid = r.request_id
                if chain[rid]:
                    slot = self.slots.slot(rid)
                    self.runner.cache.commit(slot, self.runner.cache.lengths[slot] + 1)
                    held[rid].append(nodes[rid][0][-1])
                    frontier[rid] = [(leaves[rid][0], out[i, 0])]
                else:
                    frontier[rid] = [(n, out[i, n]) for n in leaves[rid]]
        for r in active:
            self.slots.hold(r.request_id, held[r.request_id])
            toks, pars, rows = nodes[r.request_id]
            probs = torch.stack(rows) if rows else None
            trees[r.request_id] = TokenTree(tuple(toks), tuple(pars), probs)
        return [trees[r.request_id] for r in requests]

    @staticmethod
    def _chosen_prob(r: DraftRequest, nodes: tuple[list, list, list], logit: torch.Tensor,
                     ) -> float:
        """Draft probability of the chain's newest token, drawn from ``logit`` [V]."""
        toks, _, rows = nodes
        q = rows[-1] if rows else torch.softmax(logit.float(), -1)                  # [V]
        return float(q[toks[-1]])

    def _expand(self, r: DraftRequest, depth: int, nodes: tuple[list, list, list],
                frontier: list[tuple[int, torch.Tensor]]) -> list[int]:
        """Add the children of every frontier node (node, logits [V]); return the new nodes."""
        toks, pars, rows = nodes
        width = r.shape()[depth]
        new = []
        for parent, logit in frontier:
            if r.sampling.greedy:  # top-b of the logits, verified as one-hot drafts
                children = logit.topk(width).indices.tolist()
            else:
                q = probs_from_logits(logit, r.sampling)                        # [V]
                children = torch.multinomial(q, width, replacement=True,
                                             generator=self.slots.generator(r.request_id)).tolist()
                rows.extend([q] * width)
            for tok in children:
                toks.append(int(tok))
                pars.append(parent)
                new.append(len(toks) - 1)
        return new
