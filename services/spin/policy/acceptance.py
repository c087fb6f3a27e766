"""Per (request, drafter) acceptance rates: what the speculation-length controller (``goodput.py``)
predicts each request's tokens per step from.

A step that drafts k tokens and accepts m of them is a geometric run truncated at k — m successes,
plus one failure when m < k (the chain stops at the first rejection; m = k is censored: we only
know the run lasted ≥ k). For such data the maximum-likelihood estimate is a = S / (S + F) with
S = accepted tokens and F = rejections, which is consistent (E[S] = a(1 − a^k)/(1 − a),
E[F] = 1 − a^k, ratio a). We keep exponentially discounted S and F (the newest step weighted
``ema``, older ones by (1 − ema)^age), seeded with ``prior_trials`` pseudo-trials at the
population rate of the drafter. (SmartSpec's own EMA of accepted/drafted underestimates a because
of the truncation; EMA-ing accepted/(accepted + 1) is biased too, e.g. 0.31 for a = 0.5.)

The population rates are per ``population.population_name``: a drafter's greedy and sampled
steps accept differently, so a request opened with ``begin(request_id, greedy)`` is seeded from
its own decoding's rate (the other's stands in for a drafter without one); one never opened counts
as greedy.

Evidence without a step (``add_evidence``), e.g. a drafter's greedy agreement with the request's
own output, counts each position as one accepted or rejected draft token.

**Sampling requests** are estimated otherwise: their steps are exchangeable, so S and F count
every step alike (no discount), and the population rate is a prior worth as many trials as how
much requests differ says (``dispersion.py``, measured on the released requests; ``prior_trials``
until enough have been), never spent: a request's estimate is (S + m a0) / (S + F + m), plus
the predicted evidence (``add_evidence``: a prompt fit's seed, scores), which weighs ``1 - ema``
less with each step, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .dispersion import Dispersion
from .learned_config import ControllerConfig
from .population import population_entry, population_name


@dataclass
class _Acc:
    s: float
    """Accepted tokens (discounted for a greedy request)."""
    f: float
    """Rejections (discounted for a greedy request)."""
    n: int = 0
    """Steps observed."""
    ps: float = 0.0
    """A sampling request's: predicted accepted tokens (``add_evidence``), discounted."""
    pf: float = 0.0
    """A sampling request's: predicted rejections, discounted."""


@dataclass
class AcceptanceTracker:
    """Per (request, drafter) acceptance rate: discounted truncated-geometric MLE (module doc)."""

    cfg: ControllerConfig = field(default_factory=ControllerConfig)
    """Uses ``ema``, ``prior_acceptance``, ``prior_trials`` and ``min_observations``."""
    population: dict[str, float] = field(default_factory=dict)
    """Population acceptance per entry (``population_name``): the seed of new requests."""
    _state: dict[str, dict[str, _Acc]] = field(default_factory=dict, repr=False)
    """request id -> drafter -> discounted counts"""
    _sampled: set[str] = field(default_factory=set, repr=False)
    """Requests opened as sampling ones (``begin``)."""
    dispersion: Dispersion = field(default_factory=Dispersion)
    """How much sampling requests differ per drafter: their prior's strength (module doc)."""

    def set_population(self, rates: dict[str, float]) -> None:
        """Replace the population rates, keyed by ``population_name`` (requests already seen
        keep their state)."""
        self.population = {d: min(1.0, max(0.0, float(a))) for d, a in rates.items()}

    def begin(self, request_id: str, greedy: bool) -> None:
        """``request_id`` decodes greedily or samples: which population rates seed it."""
        if greedy:
            self._sampled.discard(request_id)
        else:
            self._sampled.add(request_id)

    def prior(self, drafter: str, request_id: str | None = None) -> float:
        """The population rate of ``drafter`` for ``request_id``'s decoding (greedy when None or
        never opened), else the other decoding's, else ``prior_acceptance``."""
        rate = population_entry(self.population, drafter, request_id not in self._sampled)
        return self.cfg.prior_acceptance if rate is None else rate

    def update(self, request_id: str, drafter: str, k: int, accepted: int) -> None:
        """One step of ``request_id`` drafted ``k`` tokens with ``drafter``; ``accepted`` of
        them were accepted (chain prefix). k = 0 carries no information and is ignored."""
        if not 0 <= accepted <= max(k, 0):
            raise ValueError(f"accepted={accepted} outside 0..k={k}")
        if k <= 0:
            return
        st = self._acc(request_id, drafter)
        rejected = 1.0 if accepted < k else 0.0
        if request_id in self._sampled:  # exchangeable steps (module doc): all count alike
            st.s, st.f = st.s + accepted, st.f + rejected
        else:
            w = self.cfg.ema
            st.s = (1 - w) * st.s + w * accepted
            st.f = (1 - w) * st.f + w * rejected
        st.ps, st.pf = (1 - self.cfg.ema) * st.ps, (1 - self.cfg.ema) * st.pf
        st.n += 1

    def relax(self, request_id: str, drafter: str, steps: int = 1) -> None:
        """``steps`` steps in which ``drafter``, the request's choice, drafted nothing (the
        controller held it at k = 0; a held call's forwards each count): a greedy request's
        evidence ages toward the population rate, each step as one of ``prior_trials`` trials at
        that rate, weighted ``ema`` like a drafted one (in one go: ``(1 - ema) ** steps``), since
        a held request gets no evidence and a discounted estimate from a few steps would hold
        it at k = 0 for good (on sampled tuning prompts, when these were discounted too, two
        steps of the demo's EAGLE head accepting 2 and 0 of 4 held requests plain for their
        remaining 60 steps). A sampling request's estimate keeps its prior (module doc)."""
        st = self._state.get(request_id, {}).get(drafter)
        if st is not None and request_id not in self._sampled:
            a0, p = self.prior(drafter, request_id), self.cfg.prior_trials
            kept = (1 - self.cfg.ema) ** max(0, steps)
            st.s = kept * st.s + (1 - kept) * a0 * p
            st.f = kept * st.f + (1 - kept) * (1 - a0) * p

    def add_evidence(self, request_id: str, drafter: str, accepted: float, rejected: float,
                     keep: float = 1.0) -> None:
        """Count draft tokens known to be accepted or rejected without a step, e.g. a drafter's
        greedy agreement with the request's own output (each position one Bernoulli trial); the
        evidence so far weighs ``keep`` first. A sampling request's is a prediction, not its
        steps: kept apart, it weighs ``1 - ema`` less with each step (module doc)."""
        st = self._acc(request_id, drafter)
        if request_id in self._sampled:
            st.ps = keep * st.ps + max(0.0, accepted)
            st.pf = keep * st.pf + max(0.0, rejected)
            return
        st.s = keep * st.s + max(0.0, accepted)
        st.f = keep * st.f + max(0.0, rejected)

    def _acc(self, request_id: str, drafter: str) -> _Acc:
        """The request's state for ``drafter``, seeded at the population rate when new."""
        per = self._state.setdefault(request_id, {})
        st = per.get(drafter)
        if st is None:  # (a sampling request's prior is added in ``get``: module doc)
            a0, p = self.prior(drafter, request_id), self.cfg.prior_trials
            p = 0.0 if request_id in self._sampled else p
            st = per[drafter] = _Acc(a0 * p, (1 - a0) * p)
        return st

    def strength(self, drafter: str) -> float:
        """Trials the sampled population rate of ``drafter`` is worth in a sampling request's
        estimate: measured (``dispersion.py``), else ``prior_trials``."""
        m = self.dispersion.strength(population_name(drafter, greedy=False))
        return self.cfg.prior_trials if m is None else m

    def observations(self, request_id: str, drafter: str) -> int:
        st = self._state.get(request_id, {}).get(drafter)
        return st.n if st else 0

    def get(self, request_id: str, drafter: str) -> float:
        """The acceptance estimate of ``request_id`` with ``drafter``."""
        st = self._state.get(request_id, {}).get(drafter)
        if st is None or st.n < self.cfg.min_observations:
            return self.prior(drafter, request_id)
        if request_id in self._sampled:
            m, a0 = self.strength(drafter), self.prior(drafter, request_id)
            s, n = st.s + st.ps + m * a0, st.s + st.f + st.ps + st.pf + m
            return s / n if n > 0 else a0
        return st.s / (st.s + st.f) if st.s + st.f > 0 else self.prior(drafter, request_id)

    def release(self, request_id: str) -> None:
        """The request ended: a sampling one's steps of each drafter join its dispersion."""
        for drafter, st in self._state.pop(request_id, {}).items():
            if request_id in self._sampled and st.n:
                self.dispersion.record(population_name(drafter, greedy=False), st.s, st.f)
        self._sampled.discard(request_id)
