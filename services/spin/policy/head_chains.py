"""A draft head's chain is verified once drafted: a sunk cost is never thrown away.

A head drafts inside the verifier, right after a request's verdict, the chain that the request's
*next* step verifies (``router/proposers.DraftHead``): its drafting is paid in the step that asks
for it. When the controller then gives the request k = 0 (its acceptance estimate fell after a
rejection), the chain used to be dropped with the plain step, and a return to the head cost a
step that only drafts. Verifying the chain costs only the verifier's extra rows (one request of
300 tokens on the demo target, float32, one thread: 9.9 ms for 1 token, 15.5 for 5), and it is
expected to give ``a (1 - a^n) / (1 - a)`` more tokens. So k = 0 for such a request means "verify
the chain it holds and ask for none" (``StepChoice.ask`` = 0) wherever the cost model predicts
the step's goodput higher for it (``pays``: alone, nearly always; in a large batch whose plan is
plain, the extra rows cost more than they give); the controller's k only decides whether to pay
for the next chain. On tuning prompts (sampled, one request at a time, a router
step trace of ``spin bench learned``) the warmed learned policy dropped 31-39 chains in 18
requests that way before this.

A loss guard's plain step (``loss_guard.py``) still drops the chain: a plain decision is a plain
step, and the guard measures speculation against exactly that.

Nor is a chain dropped for another drafter: a request holding one whose bandit picks another
verifies the chain and asks for none (``keep``), the pick drafting from the next step. And a
request's first step with a head (a *turn*: no chain held) verifies nothing of its own: it gives
one token, its chain the next step. The controller prices every head step as one that verifies
a chain; a turn keeps its k only where the two steps together are predicted to give more tokens a
second than both with the request at k = 0 (``transitions``). Before 2026-11-29 turns were priced
as head steps: on the tuning prompts (router step traces of ``spin bench learned``, one request at
a time) 27-49 steps a pass were turns, 10.8-15.4 ms for one token where a plain forward took
4.4-6.9 ms in speculation off's held calls, 9-19% of auto's time, and greedy requests' bandits
dropped a turn's chain at the next step for prompt lookup's draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .base import RequestView, StepChoice
from .goodput import SpecLengthController, expected_tokens


@dataclass
class HeadChains:
    """Per request: the head chain asked for in the step being verified, and the one held for
    the coming step (drafted at the context the request has now)."""

    _asking: dict[str, tuple[str, int]] = field(default_factory=dict)
    """request id -> (head, k) asked in the step being verified"""
    _held: dict[str, tuple[str, int]] = field(default_factory=dict)
    """request id -> (head, tokens asked) drafted for the request's coming step"""

    def planned(self, requests: Sequence[RequestView], choices: Sequence[StepChoice],
                heads: frozenset[str]) -> None:
        """The coming step's choices: what each asks of a head (``StepChoice.ask``, else its
        k), held for the step after once it is verified; the chains held now are verified or
        dropped by it."""
        for r, c in zip(requests, choices):
            self._held.pop(r.request_id, None)
            k = c.k if c.ask is None else c.ask
            if c.drafter in heads and k > 0:
                self._asking[r.request_id] = (c.drafter, k)
            else:
                self._asking.pop(r.request_id, None)

    def verified(self, request_id: str, ok: bool) -> None:
        """The step reported: with its verdict (``ok``), what it asked is held for the next."""
        ask = self._asking.pop(request_id, None)
        if ok and ask is not None:
            self._held[request_id] = ask

    def holding(self, request_id: str) -> str | None:
        """The head whose chain the request holds for its coming step (None: none)."""
        chain = self._held.get(request_id)
        return chain[0] if chain is not None else None

    def keep(self, requests: Sequence[RequestView], drafters: list[str | None],
             available: set[str]) -> None:
        """A request in mode auto holding an available head's chain whose bandit picked
        another drafter verifies the chain and asks for none (its drafter None here, so the
        controller gives it k = 0 and ``verify_held`` verifies the chain); the bandit's pick
        drafts from the next step (set in place). Dropped, a chain drafted for the coming
        step was a head's catch-up and drafts paid for nothing (module doc)."""
        for i, r in enumerate(requests):
            head = self.holding(r.request_id)
            if r.mode == "auto" and head in available and drafters[i] not in (None, head):
                drafters[i] = None

    def transitions(self, requests: Sequence[RequestView], drafters: list[str | None],
                    ks: list[int], heads: frozenset[str], controller: SpecLengthController,
                    prefill: int = 0) -> None:
        """Requests in mode auto that turn to a head (k > 0, no chain of it held) get one token
        from this step, their chain the next: they keep k only where the two steps together,
        this one and the next verifying the chains, are predicted to give more tokens a second
        than both steps with those requests at k = 0 (``ks`` set to 0 in place otherwise).
        Priced as a step of the head instead, a turn cost a step of one token that the
        controller expected to give E(a, k) (module doc)."""
        turning = [i for i, r in enumerate(requests)
                   if r.mode == "auto" and ks[i] > 0 and drafters[i] in heads
                   and self.holding(r.request_id) != drafters[i]]
        if not turning or controller.cost is None:
            return
        batch = [(r.request_id, d, r.context_len) for r, d in zip(requests, drafters)]
        plain = [0 if i in turning else k for i, k in enumerate(ks)]

        def two_steps(k: list[int]) -> float:  # this step's seconds, then the next one's
            now = controller.step_s(*controller.predicted_parts(batch, k, prefill))
            return now + (controller.step_s(*controller.predicted_parts(batch, k))
                          if prefill else now)

        with_chains, now = controller.expected(batch, ks), controller.expected(batch, plain)
        turn, stay = two_steps(ks), two_steps(plain)
        if turn <= 0 or stay <= 0 or (now + with_chains) / turn <= 2 * now / stay:
            for i in turning:
                ks[i] = 0

    def verify_held(self, requests: Sequence[RequestView], drafters: list[str | None],
                    ks: list[int], available: set[str], controller: SpecLengthController,
                    prefill: int = 0) -> list[int | None]:
        """Requests in mode auto at k = 0 that hold a chain of an available head verify it
        (as many of its tokens as they may still emit but one), asking for none, where the
        cost model predicts the step's goodput higher for it (``pays``): ``drafters`` and ``ks``
        set in place. Each request's ``StepChoice.ask``: 0 for those, else None."""
        held: dict[int, tuple[str, int]] = {}
        for i, r in enumerate(requests):
            chain = self._held.get(r.request_id)
            n = min(chain[1], r.remaining - 1) if chain is not None else 0
            if r.mode == "auto" and ks[i] == 0 and n > 0 and chain[0] in available:
                held[i] = chain[0], n
        if not held or not pays(requests, drafters, ks, held, controller, prefill):
            return [None] * len(requests)
        for i, (head, n) in held.items():
            drafters[i], ks[i] = head, n
        return [0 if i in held else None for i in range(len(requests))]

    def release(self, request_id: str) -> None:
        self._asking.pop(request_id, None)
        self._held.pop(request_id, None)


def pays(requests: Sequence[RequestView], drafters: list[str | None], ks: list[int],
         held: dict[int, tuple[str, int]], controller: SpecLengthController,
         prefill: int = 0) -> bool:
    """Whether verifying the ``held`` chains (index -> (head, tokens)) beside the plan
    (``drafters``, ``ks``) raises the step's predicted goodput: their expected extra tokens
    against the verifier's extra rows, their drafting being paid already (True without a cost
    model). One request alone on the demo target: 1 + ~1.3 tokens in ~19 ms against 1 in 15;
    in a batch of 32 plain requests the rows cost more than their tokens give."""
    if controller.cost is None:
        return True
    batch = [(r.request_id, d, r.context_len) for r, d in zip(requests, drafters)]
    priced = [(b[0], None, b[2]) if i in held else b for i, b in enumerate(batch)]
    with_ks = [held[i][1] if i in held else k for i, k in enumerate(ks)]
    before = controller.step_s(*controller.predicted_parts(batch, ks, prefill))
    after = controller.step_s(*controller.predicted_parts(priced, with_ks, prefill))
    tokens = controller.expected(batch, ks)
    gain = sum(expected_tokens(controller.tracker.get(requests[i].request_id, head), n) - 1
               for i, (head, n) in held.items())
    return before > 0 and after > 0 and (tokens + gain) / after > tokens / before
