"""SPIN draft selection: a multi-armed bandit per request over the available drafters.

Arms are the draft models plus ``prompt-lookup``. A verification step of a request with drafter d
gives the reward ``tokens / seconds``: the step's goodput, tokens = accepted + 1 (the target's bonus
or correction token), seconds = draft + verify seconds of the step + ``switch_cost_s(request, d)``
(the catch-up prefill a model drafter pays when it was not the request's previous drafter).

Warm start: ``set_population`` gives every drafter a prior mean reward from the population
statistics (Redis, all requests and router replicas) worth at most ``prior_strength`` observations,
so a new request starts from the population and learns its own difficulty in a few steps. Greedy
and sampling requests have separate population entries (``population.population_name``): a
request opened with ``begin(request_id, greedy)`` starts from its own decoding's entry (the other's
stands in for a drafter that has none yet); one never opened counts as greedy. Rewards
are normalised by the best prior mean (by the request's first reward when there is no population),
so tokens/s scales do not matter. A drafter with no population data gets an optimistic prior
(``optimistic_mean``) so it is tried.

Measured regret (the fraction of the per-request oracle's summed expected goodput that is lost;
3-class workload; population prior = the class mixture, so it is wrong for every request) in the
bandit's simulation (``spin/bench/selector_sim.py``), from ``print(regret_table(
three_class_workload(), steps=(16, 32, 64), requests=1500, seed=0))`` (~5 s):

    algorithm      16 steps    32 steps    64 steps
    thompson          0.128       0.089       0.051
    ucb               0.127       0.079       0.043
    greedy            0.155       0.110       0.084

Default: UCB (``ucb_c`` 0.3): the lowest regret at every horizon (seed 1: same order), deterministic
given the data, and its first step is the prior's best arm. Thompson (``thompson_scale`` 0.5) is
within 0.01, also on three other hand-made workloads at 32 steps, where plain Thompson (scale 1) or
ucb_c 0.5 lost 0.01-0.03 more. Epsilon-greedy pays epsilon forever. At 32 steps with a correct prior
(``prior="class"``) regret is 0.009 (ucb) / 0.004 (thompson); with none, 0.148 / 0.147: the rest
above is finding the class's arm through noisy steps (1..5 tokens each).
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field
from typing import Literal

from .base import MODEL_FREE
from .population import SAMPLED_SUFFIX, PopulationArm, population_entry

Algorithm = Literal["thompson", "ucb", "greedy"]
ALGORITHMS: tuple[Algorithm, ...] = ("thompson", "ucb", "greedy")


@dataclass(frozen=True)
class SelectorConfig:
    """How the per-request bandit explores and learns."""

    algorithm: Algorithm = "ucb"
    """'thompson' (Gaussian posterior sampling), 'ucb' (UCB1-style bonus) or 'greedy' (epsilon)."""
    prior_strength: float = 3.0
    """Cap on the pseudo-count of a population prior: it weighs at most this many observations."""
    switch_cost_s: float = 0.002
    """Catch-up prefill seconds a drafter pays in a step when it was not the previous drafter."""
    switch_free: frozenset[str] = MODEL_FREE
    """Drafters without a KV cache to catch up (model-free): their switch cost is always 0."""
    thompson_scale: float = 0.5
    """Multiplier of the posterior standard deviation Thompson samples with (1 = plain Thompson;
    0.5 measured better: per-step goodput is noisy, tokens 1..k+1, and the gaps are large)."""
    ucb_c: float = 0.3
    """Exploration coefficient of UCB: bonus = ucb_c * sqrt(ln(t) / weight), t = the request's steps
    + 1 (so the first step follows the prior), weight = prior pseudo-count + observations."""
    epsilon: float = 0.1
    """Probability that 'greedy' picks a uniformly random available drafter."""
    seed: int | None = 0
    """Seed of the selector's one ``random.Random`` (None: not reproducible)."""
    discount: float = 1.0
    """Exponential forgetting per step of a request (1.0 = none; 0.95 tracks drifting requests)."""
    prior_var: float = 0.1
    """Per-step variance of a normalised reward, counted as one pseudo-observation (Thompson)."""
    var_floor: float = 0.01
    """Lower bound of an arm's estimated per-step variance (normalised rewards), for Thompson."""
    optimistic_mean: float = 1.25
    """Normalised prior mean of a drafter without population data (> 1: above the best known).
    With no population data at all, every drafter is untried and tried once before any repeat."""
    optimistic_weight: float = 1.0
    """Pseudo-count of that optimistic prior."""


@dataclass
class _Arm:
    """Posterior of one drafter in one request (normalised rewards)."""

    mean: float
    """Posterior mean of the normalised reward."""
    weight: float
    """Prior pseudo-count + (discounted) observations."""
    m2: float
    """Weighted sum of squared deviations from ``mean`` (pseudo-counts sit at the prior mean)."""
    n: int = 0
    """Own observations in this request."""
    own_sum: float = 0.0
    """(Discounted) sum of the own observations' normalised rewards."""
    own_weight: float = 0.0
    """(Discounted) count of the own observations."""

    def variance(self, prior_var: float, floor: float) -> float:
        """Per-step reward variance; ``prior_var`` counts as one pseudo-observation."""
        return max(floor, (self.m2 + prior_var) / (self.weight + 1.0))


@dataclass
class _Request:
    scale: float | None
    """Reward that normalises to 1.0 (best prior mean, or the first reward)."""
    arms: dict[str, _Arm] = field(default_factory=dict)
    """Drafter -> posterior, created when the drafter is first available or used."""
    greedy: bool = True
    """Greedy decoding: which population entries seed the arms (``population_name``)."""
    previous: str | None = None
    """Drafter of the last step (no switch cost for it)."""
    steps: int = 0
    """Steps learned from."""


class DraftSelector:
    """Per-request bandit over drafters; see the module docstring. Thread-safe."""

    def __init__(self, config: SelectorConfig | None = None,
                 population: dict[str, PopulationArm] | None = None) -> None:
        self.config = config or SelectorConfig()
        if self.config.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.config.algorithm!r}")
        if not 0.0 < self.config.discount <= 1.0:
            raise ValueError("discount must be in (0, 1]")
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._population: dict[str, PopulationArm] = {}
        """Population entry (``population_name``) -> prior."""
        self._scale: dict[bool, float | None] = {True: None, False: None}
        """greedy -> the best prior mean reward of that decoding's requests."""
        self.set_population(population or {})

    def set_population(self, stats: dict[str, PopulationArm]) -> None:
        """Replace the population priors, keyed by ``population_name`` (a drafter's name for
        greedy steps, ``{name}@sampled`` for sampling ones); running requests keep the priors they
        started with."""
        usable = {n: a for n, a in stats.items()
                  if a.observations > 0 and math.isfinite(a.mean_reward) and a.mean_reward >= 0.0}
        drafters = {n.removesuffix(SAMPLED_SUFFIX) for n in usable}
        with self._lock:
            self._population = usable
            for greedy in (True, False):
                means = [a.mean_reward for d in drafters
                         if (a := population_entry(usable, d, greedy)) is not None]
                self._scale[greedy] = max(means, default=0.0) or None

    def begin(self, request_id: str, greedy: bool) -> None:
        """Open ``request_id`` with the population of its decoding (greedy or sampling); a
        request already known keeps its state."""
        with self._lock:
            if request_id not in self._requests:
                self._requests[request_id] = _Request(scale=self._scale[greedy], greedy=greedy)

    def choose(self, request_id: str, available: set[str]) -> str:
        """The drafter for the request's next step, one of ``available``."""
        if not available:
            raise ValueError("no drafter available")
        cfg = self.config
        with self._lock:
            req = self._request(request_id)
            names = sorted(available)
            arms = [self._arm(req, name) for name in names]
            untried = [name for name, a in zip(names, arms) if a.weight <= 0.0]
            if untried:  # no prior and no observation: try it (infinitely optimistic)
                return self._rng.choice(untried)
            if cfg.algorithm == "thompson":
                sds = [math.sqrt(a.variance(cfg.prior_var, cfg.var_floor) / a.weight) for a in arms]
                scores = [a.mean + cfg.thompson_scale * sd * self._rng.gauss(0.0, 1.0)
                          for a, sd in zip(arms, sds)]
            elif cfg.algorithm == "ucb":
                log_t = math.log(req.steps + 1)
                scores = [a.mean + cfg.ucb_c * math.sqrt(log_t / a.weight) for a in arms]
            else:
                if self._rng.random() < cfg.epsilon:
                    return self._rng.choice(names)
                scores = [a.mean for a in arms]
            best = max(scores)
            ties = [name for name, s in zip(names, scores) if s == best]
            return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def switch_cost_s(self, request_id: str, drafter: str) -> float:
        """Seconds ``drafter`` adds to the request's next step: 0 when it was the previous drafter
        (or needs no KV cache), else ``config.switch_cost_s`` (catch-up prefill)."""
        with self._lock:
            req = self._requests.get(request_id)
            previous = req.previous if req is not None else None
        if drafter == previous or drafter in self.config.switch_free:
            return 0.0
        return self.config.switch_cost_s

    def update(self, request_id: str, drafter: str, tokens: int, seconds: float) -> None:
        """Learn from one step: ``tokens`` emitted in ``seconds`` (switch cost included)."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or tokens < 0:
            return  # nothing sensible to learn; the previous drafter stays as it was
        reward = tokens / seconds
        with self._lock:
            req = self._request(request_id)
            if req.scale is None:
                req.scale = reward or None
            arm = self._arm(req, drafter)
            gamma = self.config.discount
            if gamma < 1.0:
                for other in req.arms.values():
                    other.weight *= gamma
                    other.m2 *= gamma
                    other.own_sum *= gamma
                    other.own_weight *= gamma
            x = reward / req.scale if req.scale else 0.0
            arm.weight += 1.0
            delta = x - arm.mean
            arm.mean += delta / arm.weight
            arm.m2 += delta * (x - arm.mean)
            arm.n += 1
            arm.own_sum += x
            arm.own_weight += 1.0
            req.previous = drafter
            req.steps += 1

    def scale_prior(self, request_id: str, drafter: str, factor: float) -> None:
        """Scale the request's prior of ``drafter`` (before its first own observation), e.g. by
        how much better than average the drafter is predicted to do on this request."""
        if not (factor >= 0.0 and math.isfinite(factor)):
            return
        with self._lock:
            req = self._request(request_id)
            arm = self._arm(req, drafter)
            if arm.n == 0:
                arm.mean *= factor

    def set_prior(self, request_id: str, drafter: str, reward: float, weight: float) -> None:
        """Replace the request's prior of ``drafter`` by ``reward`` tokens/s worth ``weight``
        observations (e.g. a prediction from measured acceptance); its own observations stay."""
        if not (reward >= 0.0 and math.isfinite(reward)) or weight <= 0.0:
            return
        with self._lock:
            req = self._request(request_id)
            if req.scale is None:
                req.scale = reward or None
            arm = self._arm(req, drafter)
            if req.scale:
                arm.weight = weight + arm.own_weight
                arm.mean = (reward / req.scale * weight + arm.own_sum) / arm.weight
                arm.m2 = 0.0 if arm.n == 0 else arm.m2

    def population_reward(self, request_id: str, drafter: str) -> float | None:
        """The population's measured goodput (tokens/s) of ``drafter`` for the request's
        decoding (``population_entry``); None when it has none."""
        with self._lock:
            pop = population_entry(self._population, drafter, self._request(request_id).greedy)
        return pop.mean_reward if pop is not None else None

    def release(self, request_id: str) -> None:
        """Forget the request (finished or cancelled)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def snapshot(self, request_id: str) -> dict[str, tuple[float, int]]:
        """Drafter -> (posterior mean reward in tokens/s, own observations) of a running request."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return {}
            scale = req.scale or 1.0
            return {name: (a.mean * scale, a.n) for name, a in sorted(req.arms.items())}

    def next_best(self, request_id: str, current: str, cands: set[str]) -> str | None:
        """The request's best drafter among ``cands`` but ``current``, by posterior mean."""
        ranked = sorted(((mean, name) for name, (mean, _) in self.snapshot(request_id).items()
                         if name in cands and name != current), reverse=True)
        return ranked[0][1] if ranked else None

    def _request(self, request_id: str) -> _Request:
        return self._requests.get(request_id) or self._requests.setdefault(
            request_id, _Request(scale=self._scale[True]))

    def _arm(self, req: _Request, name: str) -> _Arm:
        arm = req.arms.get(name)
        if arm is None:
            cfg = self.config
            pop = population_entry(self._population, name, req.greedy)
            if pop is not None and req.scale:
                mean = pop.mean_reward / req.scale
                weight = min(pop.observations, cfg.prior_strength)
            elif req.scale:  # nothing known about it: optimistic relative to the request's scale
                mean, weight = cfg.optimistic_mean, cfg.optimistic_weight
            else:  # nothing known at all: untried, chosen before any tried drafter
                mean, weight = 0.0, 0.0
            arm = req.arms[name] = _Arm(mean, weight, 0.0)
        return arm
