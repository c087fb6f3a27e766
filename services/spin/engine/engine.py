"""In-process speculative generation: draft step + verify step, composed, for tests and benchmarks.

The services run the same two steps in different processes; here they are plain calls. Every step,
each active request gets a drafter, k and tree shape (from the request, or from a ``choose``
callback — the hook the selection and speculation-length policies plug into), drafters propose in
batches, the verifier decides for the whole batch in one target forward, and requests leave the
batch as they finish (max_tokens or EOS), freeing their caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .drafter import Drafter, DraftRequest
from .sampling import SamplingParams
from .tree import TokenTree
from .verifier import Verifier, VerifyRequest


@dataclass(frozen=True)
class GenerationRequest:
    """One generation to run."""

    request_id: str
    """Unique id."""
    prompt: tuple[int, ...]
    """Prompt token ids (at least one)."""
    max_tokens: int
    """Tokens to generate at most."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Greedy by default."""
    drafter: str | None = None
    """Drafter name; None = no speculation (target alone)."""
    k: int = 4
    """Speculation length."""
    branching: tuple[int, ...] = ()
    """Tree shape (children per node per level); () = chain."""
    stop_at_eos: bool = True
    """Stop after emitting the EOS token."""


@dataclass
class GenerationResult:
    """What a request produced and how speculation went for it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    """Verification steps (target forwards that included this request)."""
    drafted: int = 0
    """Draft tokens proposed (tree nodes)."""
    accepted: int = 0
    """Draft tokens accepted."""
    drafters: list[str] = field(default_factory=list)
    """Drafter used at each step ('' = none)."""

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (accepted + the bonus/correction token)."""
        return len(self.tokens) / self.steps if self.steps else 0.0


@dataclass
class StepTimes:
    """Where an engine's time went, summed over its steps (wall seconds)."""

    steps: int = 0
    """Batch steps run (one verification forward each)."""
    draft_s: float = 0.0
    """Drafting (every drafter of the step, catch-up included)."""
    verify_s: float = 0.0
    """Verification: the target forward, the acceptance rule and the cache commit."""
    total_s: float = 0.0
    """Whole steps, engine bookkeeping included."""

    @property
    def verify_share(self) -> float:
        """verify_s / total_s: the bench's efficiency (tau x verify steps/s over achieved)."""
        return self.verify_s / self.total_s if self.total_s else 0.0


Choice = tuple[str | None, int, tuple[int, ...]]
"""(drafter name or None, k, branching) for one request and step."""


class SpecEngine:
    """A verifier and a pool of drafters."""

    def __init__(self, verifier: Verifier, drafters: dict[str, Drafter],
                 eos_id: int | None = None) -> None:
        self.verifier = verifier
        self.drafters = drafters
        self.eos_id = eos_id
        self.times = StepTimes()

    def generate(self, requests: list[GenerationRequest],
                 choose: Callable[[GenerationRequest, GenerationResult], Choice] | None = None,
                 ) -> list[GenerationResult]:
        """Run every request to completion in one continuous batch."""
        for r in requests:
            if not r.prompt or r.max_tokens <= 0:
                raise ValueError(f"{r.request_id}: empty prompt or max_tokens <= 0")
            if len(r.prompt) + r.max_tokens > self.verifier.runner.max_len:
                raise ValueError(f"{r.request_id}: prompt ({len(r.prompt)} tokens) + max_tokens "
                                 f"({r.max_tokens}) exceeds the context of "
                                 f"{self.verifier.runner.max_len} tokens")
            if r.drafter is not None and r.drafter not in self.drafters:
                raise ValueError(f"{r.request_id}: unknown drafter {r.drafter!r}; "
                                 f"known: {sorted(self.drafters)}")
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        active = list(requests)
        try:
            while active:
                t0 = time.perf_counter()
                plan = {r.request_id: (choose(r, results[r.request_id]) if choose
                                       else (r.drafter, r.k, r.branching)) for r in active}
                trees = self._draft(active, results, plan)
                t1 = time.perf_counter()
                verdicts = self.verifier.verify([
                    # the verifier appends what it emits: after the first step it holds it all
                    VerifyRequest(r.request_id, () if results[r.request_id].steps else r.prompt,
                                  trees[r.request_id], r.sampling,
                                  keep=len(r.prompt) + len(results[r.request_id].tokens)
                                  if results[r.request_id].steps else 0)
                    for r in active])
                t2 = time.perf_counter()
                still = []
                for r, v in zip(active, verdicts):
                    if v is None:  # preempted (the cache had no room): verified again next step
                        still.append(r)
                        continue
                    res = results[r.request_id]
                    res.steps += 1
                    res.drafted += len(trees[r.request_id])
                    res.accepted += v.num_accepted
                    res.drafters.append(plan[r.request_id][0] or "")
                    if self._emit(r, res, v.tokens):
                        still.append(r)
                    else:
                        self._release(r.request_id)
                active = still
                self.times.steps += 1
                self.times.draft_s += t1 - t0
                self.times.verify_s += t2 - t1
                self.times.total_s += time.perf_counter() - t0
        finally:
            for r in active:
                self._release(r.request_id)
        return [results[r.request_id] for r in requests]

    def _draft(self, active: list[GenerationRequest], results: dict[str, GenerationResult],
               plan: dict[str, Choice]) -> dict[str, TokenTree]:
        trees = {r.request_id: TokenTree((), ()) for r in active}
        groups: dict[str, list[DraftRequest]] = {}
        for r in active:
            name, k, branching = plan[r.request_id]
            out = results[r.request_id].tokens
            room = r.max_tokens - len(out) - 1
            k = min(k, room)
            if name is None or k <= 0:
                continue
            keep = self.drafters[name].held(r.request_id)
            delta = r.prompt[keep:] + tuple(out[max(0, keep - len(r.prompt)):])
            groups.setdefault(name, []).append(DraftRequest(r.request_id, delta, k, branching,
                                                            r.sampling, keep=keep))
        for name, reqs in groups.items():
            for req, tree in zip(reqs, self.drafters[name].propose(reqs)):
                trees[req.request_id] = tree
        return trees

    def _emit(self, r: GenerationRequest, res: GenerationResult, tokens: tuple[int, ...]) -> bool:
        """Append tokens up to max_tokens / EOS; return whether the request goes on."""
        for tok in tokens:
            res.tokens.append(tok)
            if len(res.tokens) >= r.max_tokens or (r.stop_at_eos and tok == self.eos_id):
                return False
        return True

    def _release(self, request_id: str) -> None:
        self.verifier.release(request_id)
        for drafter in self.drafters.values():
            drafter.release(request_id)
