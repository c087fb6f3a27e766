"""Token trees chosen by goodput: a request drafts a tree instead of a chain when the cost model
predicts more tokens per second from it.

A tree's extra branches are the drafter's runner-up tokens (``tree_shape.py``): they pay off by
how often the target's token is the drafter's second choice when it is not its first (``beta``).
The router measures that on every greedy step (``outcome``): a chain carries its runner-ups
(``TokenTree.second``), so a rejected node says whether a second branch would have caught the
target's token; a tree's walk says whether its second child did. ``RunnerUps`` keeps the rate
per request and drafter, seeded from what the drafter did on earlier requests.

Per step, after the controller chose every request's k, each greedy request whose drafter can
branch (a draft model, or prompt lookup when it found two continuations) weighs the candidate
shapes at that depth (``tree_shape.candidates``): the batch's predicted goodput with the tree
(expected accepted tokens at its alpha and beta; its nodes verified; its re-fed nodes drafted)
against the chain's, and takes the tree when it wins by ``tree_margin``. Verifying more tokens
is nearly free where a forward is bound by reading the weights (a GPU at small batch); on a CPU
every verified token costs a few percent of a step, and trees pay less often.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.model_free import MODEL_FREE
from .acceptance import AcceptanceTracker
from .base import RequestView, branches
from .tree_shape import Shape, candidates, expected_accepted, fed, nodes


class RunnerUps:
    """How often a drafter's second choice is the target's token when its first is not: per
    request, its counts seeded with ``weight`` trials at the drafter's rate over earlier steps
    (an average moving by ``ema`` per step)."""

    def __init__(self, prior: float = 0.3, weight: float = 4.0, ema: float = 0.3) -> None:
        self.prior = prior
        """The rate of a drafter with no record."""
        self.weight = weight
        """Pseudo trials a request's estimate starts from, at its drafter's rate."""
        self.ema = ema
        """Weight of the newest step in a drafter's rate across requests."""
        self.population: dict[str, float] = {}
        self._counts: dict[str, dict[str, list[float]]] = {}

    def _of(self, request_id: str, drafter: str) -> list[float]:
        """The request's (hits, trials), seeded at first sight with ``weight`` trials at its
        drafter's rate then."""
        mine = self._counts.setdefault(request_id, {})
        if drafter not in mine:
            mine[drafter] = [self.weight * self.population.get(drafter, self.prior), self.weight]
        return mine[drafter]

    def rate(self, request_id: str, drafter: str) -> float:
        hits, trials = self._of(request_id, drafter)
        return hits / trials

    def observe(self, request_id: str, drafter: str, trials: int, hits: int) -> None:
        if trials <= 0:
            return
        counts = self._of(request_id, drafter)
        counts[0] += hits
        counts[1] += trials
        old = self.population.get(drafter, self.prior)
        self.population[drafter] = old + self.ema * (hits / trials - old)

    def release(self, request_id: str) -> None:
        self._counts.pop(request_id, None)


@dataclass(frozen=True)
class Candidate:
    """One request the shapes are weighed for."""

    index: int
    """Its position in the batch."""
    alpha: float
    beta: float
    k: int
    max_nodes: int
    """Nodes its shapes may have (prompt lookup: its continuations' worth)."""


def tree_candidates(requests: list[RequestView], drafters: list[str | None], ks: list[int],
                    policy_k: list[bool], tracker: AcceptanceTracker, runner_ups: RunnerUps,
                    tree_max_nodes: int) -> list[Candidate]:
    """The requests whose shape is weighed: greedy ones past their first step whose k is the
    controller's and whose drafter can branch (a draft model, or a model-free drafter with two
    continuations, whose tree has at most 2k nodes)."""
    cands = []
    for i, (r, d, k, chosen_k) in enumerate(zip(requests, drafters, ks, policy_k)):
        if d is None or k < 1 or not (r.greedy and chosen_k and r.generated):
            continue
        if d in MODEL_FREE and branches(r, d) < 2:
            continue
        most = 2 * k if d in MODEL_FREE else tree_max_nodes
        cands.append(Candidate(i, tracker.get(r.request_id, d), runner_ups.rate(r.request_id, d),
                               k, most))
    return cands


def choose_shapes(controller, batch, ks: list[int], prefill: int, cands: list[Candidate],
                  margin: float) -> list[Shape]:
    """Each request's shape: () (a chain) unless a candidate's tree raises the batch's predicted
    goodput by ``margin`` (coordinate ascent over the candidates, in order). ``controller`` is
    the speculation-length controller (its cost model and acceptance estimates)."""
    shapes: list[Shape] = [()] * len(batch)
    if not cands or controller.cost is None:
        return shapes
    alpha = [controller.tracker.get(rid, d) if d is not None else 0.0 for rid, d, _ in batch]
    beta = [0.0] * len(batch)
    for c in cands:
        alpha[c.index], beta[c.index] = c.alpha, c.beta

    cost = controller.cost

    def goodput(trial: list[Shape]) -> float:
        scored = [nodes(s, k) + 1 for s, k in zip(trial, ks)]
        drafts, verify = controller.predicted_parts(batch, ks, prefill, scored)
        for (_, d, _), s, k, n in zip(batch, trial, ks, scored):
            if not s:
                continue
            verify += cost.tree_verify_s * n  # what a tree's mask costs (measured)
            if d is not None and d not in MODEL_FREE and d in drafts:  # its re-fed nodes
                drafts[d] += cost.tree_draft_s.get(d, 0.0) * (fed(s, k) - fed((), k))
        step = controller.step_s(drafts, verify)
        tokens = sum(1.0 + expected_accepted(a, b, s, k) if k > 0 else 1.0
                     for a, b, s, k in zip(alpha, beta, trial, ks))
        return tokens / step if step > 0 else 0.0

    best = goodput(shapes)
    for c in cands:
        for shape in candidates(c.k, c.max_nodes)[1:]:
            trial = list(shapes)
            trial[c.index] = shape
            value = goodput(trial)
            if value > best * (1 + margin):
                shapes, best = trial, value
    return shapes
