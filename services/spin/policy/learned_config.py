"""The learned policy's settings (``LearnedPolicyConfig``, with its speculation-length
controller's ``ControllerConfig``) and their JSON overrides (``learned_config``: the router's
``--policy-config``, ``spin bench ab``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from .loss_guard import GuardConfig
from .selector import SelectorConfig


@dataclass
class ControllerConfig:
    """Settings of the speculation-length controller and its acceptance tracker."""

    k_max: int = 16
    """Largest speculation length chosen. Prompt lookup's drafts cost almost nothing, and in the
    repeating spans where it matches they are accepted whole: ``spin bench ab --a '{}' --b
    '{"controller": {"k_max": 16}}' --rounds 5`` measured B / A = 0.959 against 8 (12 against 8:
    0.992, 16 against 12: 0.984, 24 against 16: 1.008, 6 against 8: 1.068). A model drafter's
    chain rarely gets that long: it stops early (``LearnedPolicyConfig.stop_below``)."""
    margin: float = 0.10
    """Speculate only when the predicted goodput beats k = 0 for all by this fraction."""
    ema: float = 0.3
    """Weight of the newest step in the per-request acceptance moving average (0 < ema ≤ 1)."""
    prior_acceptance: float = 0.5
    """Acceptance used for a drafter with no population estimate."""
    min_observations: int = 0
    """Steps a (request, drafter) must have been observed before its own estimate is used; until
    then the population (or prior) acceptance is."""
    prior_trials: float = 2.0
    """Weight of the population seed, in pseudo draft tokens (trials) at the population rate."""
    pipelined: bool = False
    """Step time = max(draft, verify) (SPIN's pipeline) instead of draft + verify."""
    objective: Literal["throughput", "fair"] = "fair"
    """What a step's k maximise: "throughput", the batch's expected tokens per second (SmartSpec's
    goodput); "fair", B times the geometric mean of each request's expected tokens per second
    (proportional fairness), which counts every request's slowdown from a longer step, so a
    request that gains little is not slowed for the others' speculation. The same for one
    request alone."""
    calibration: float = 0.1
    """Online calibration of the cost model in serving (``calibration.py``): each part's
    correction factor (the plain verification, what speculating adds to it, each drafter's call)
    moves this fraction of the way to its measured / predicted ratio on every step that shows
    that part, so round trips, service overheads and contention that a profile of bare forwards
    misses are learnt within tens of steps; 0 = off."""

    def __post_init__(self) -> None:
        if self.k_max < 0 or not 0.0 < self.ema <= 1.0 or self.margin < 0:
            raise ValueError(f"invalid controller config {self}")
        if not 0.0 <= self.prior_acceptance <= 1.0 or self.prior_trials <= 0:
            raise ValueError(f"invalid controller config {self}")
        if not 0.0 <= self.calibration <= 1.0:
            raise ValueError(f"calibration must be in [0, 1], got {self.calibration}")
        if self.objective not in ("throughput", "fair"):
            raise ValueError(f"objective must be 'throughput' or 'fair', got {self.objective!r}")


@dataclass
class LearnedPolicyConfig:
    """Settings of the learned policy."""

    selector: SelectorConfig = field(default_factory=SelectorConfig)
    """The per-request bandit. Its population prior weighs 3 steps: with the prompt fit a request
    weighs two candidates. When 8 was the default, ``spin bench ab --a '{}' --b '{"selector":
    {"prior_strength": 3.0}}'`` measured B / A = 0.959 with the prompt fit (0.977 before it)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The speculation-length controller."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Speculation measured against plain steps, per kind of step (``loss_guard.py``)."""
    refresh_s: float = 5.0
    """How often the population statistics are re-read (in a background thread)."""
    probe_every: int = 16
    """Steps at k = 0 after which a request probes once with k = 1 (each forward of a held
    plain call a step: ``LossGuard.hold``)."""
    score_after: int = 4
    """Generated tokens after which every unused candidate scores the request's output (see the
    module doc); 0 = never (and no prompt fit)."""
    score_every: int = 0
    """Generated tokens between later scoring rounds (0 = ``score_after``)."""
    score_rounds: int = 1
    """Scoring rounds per request at most (each adds the new tokens to the counts). One was no
    worse than more when every drafter scored and a round held up its step: ``spin bench ab --a
    '{"score_rounds": 4}' --b '{}'`` measured B / A = 0.987 (its noise floor is about 2%)."""
    sampled_scores: bool = True
    """For a sampling request, an output score counts the drafter's estimate of what its
    sampled drafts would get accepted (from the target's probabilities of the output tokens:
    ``learned.py``, Scoring) instead of its greedy agreement, which understates that by about
    half at temperature 0.8. False: greedy agreement for every request. ``spin bench ab
    --sampled --requests 12 --rounds 3 --a '{"sampled_scores": false}' --b '{}'`` (its passes
    then sharing one seed) measured B / A = 0.995, within its noise: with the prompt fit a
    request's model drafter scores its output at most once (``score_rounds``), in a step in
    which it does not draft."""
    prompt_fit: bool = True
    """At a request's first step (prompt lookup drafts) every model drafter scores the prompt
    while the target prefills it (the router sends scoring calls during the verification); the
    request's candidates then narrow to the best-fitting drafter and prompt lookup, the former
    seeded from earlier best-fit requests (``prompt_fit.py``)."""
    price_scoring: bool = True
    """A request's model drafters score it (prompt or output) only while their calls' predicted
    seconds are at most what speculating measures to save over its remaining tokens
    (``ScoringRounds.priced``); False: they score whatever the step."""
    price_catch_up: bool = True
    """A request starts drafting with a model drafter that has not seen its context only while
    that catch-up's predicted seconds are at most what speculating measures to save over its
    remaining tokens (``ScoringRounds.unaffordable``); False: any drafter, whatever it costs."""
    fit_margin: float = 0.0
    """Model drafters whose prompt agreement is within this of the best-fitting one's are
    candidates too.
    ``spin bench ab --a '{}' --b '{"fit_margin": 0.05}'`` measured B / A = 0.998: a structured
    request whose best drafter came second by prompt gained, code requests lost as much to the
    extra exploration."""
    fit_rank_margin: float = 1.0
    """Only model drafters whose prompt agreement is within this of the best's may fit a
    request best (``PromptFit.rank_margin``); 1 = all."""
    fit_deficit_weight: float = 3.0
    """A drafter's expected acceptance on a request is its record on the earlier requests it
    fitted less this times how far its prompt agreement is behind the best one's
    (``PromptFit.deficit_weight``; ``spin bench fit``, signal ``prompt_record``). The rule before
    (record within 0.02 of the best agreement, agreement otherwise, acceptance not goodput) is
    ``{"fit_rank_margin": 0.02, "fit_deficit_weight": 0.0, "fit_by_goodput": false}``."""
    fit_prune_after: int = 16
    """A model drafter that fitted none of the last this many requests whose prompt it scored
    scores only every ``fit_explore_every``-th prompt (``PromptFit.worth_scoring``); 0 = every
    model drafter scores every prompt."""
    fit_explore_every: int = 4
    """How often such a drafter scores a prompt anyway."""
    fit_by_goodput: bool = True
    """Rank the drafters by the goodput the cost model predicts for that expected acceptance at
    the best k (a cheap specialist beats a general model that accepts a little more); false =
    by the expected acceptance."""
    fit_pooled_seed: bool = True
    """A best-fitting drafter without a record of its own yet starts from all drafters' record
    on the requests each fitted (``PromptFit.pooled_acceptance``) instead of its population
    rate, which for a specialist is mostly other kinds of requests: after fixed runs of every
    drafter on the whole mixed workload the structured drafter's population rate held it at
    k = 0 on the first structured request it fitted (plain steps for most of the output).
    ``spin bench ab --a '{"fit_pooled_seed": false}' --b '{}' --rounds 2`` (two rounds: the
    first, cold one weighs half, as in ``spin bench policy --quick``) measured B / A = 0.922."""
    fit_trials: float = 8.0
    """Weight, in draft tokens, of that seed in the request's acceptance estimate."""
    score_trials: float = 4.0
    """Weight, in steps, of the bandit prior predicted from a drafter's agreement (the agreement
    itself adds one accepted or rejected draft token per scored position to the acceptance
    estimate)."""
    stop_below: float = 0.1
    """A model drafter's chain whose k the controller chose (mode auto, or a named drafter
    without its own k) stops early once its probability, the product of its
    tokens' draft probabilities, falls below this (``DraftTask.stop_below``): k is the longest
    chain the step may draft. 0 = always k. ``spin bench ab --a '{"stop_below": 0}' --b
    '{"stop_below": 0.1}'`` measured B / A = 0.969 (and 0.968 with ``k_max`` 12); 0.3 measured
    1.093: a step's fixed costs (round trips, the verifier's forward) dwarf a draft token's."""
    fallback: bool = True
    """A request whose drafter gets k = 0 tries its next-best drafter in the same step."""
    lookup_rescore: bool = True
    """After a request's first scoring round, prompt lookup (free: it runs in the router) scores
    each step's new tokens while another drafter drafts. Its acceptance estimate and bandit prior
    follow the recent tokens (each round weighs ``1 - controller.ema`` of the one before), so a
    request whose output starts repeating itself moves to prompt lookup."""
    trees: bool = True
    """Greedy requests draft token trees where the cost model predicts more goodput than a
    chain (``tree_choice.py``); False: chains only."""
    tree_max_nodes: int = 16
    """Most nodes a tree may have."""
    tree_margin: float = 0.10
    """A tree replaces the chain only when the batch's predicted goodput rises by this (the
    margin speculation itself must win by: ``ControllerConfig.margin``). With 0.03 on this
    project's 2-core CPU, ``spin bench ab --a '{"trees": false}' --b '{"trees": true}'``
    measured B / A = 1.025 (trees slower: a verified token costs ~0.35 ms at batch 1, a tree's
    ~0.3 ms more, against a ~9 ms step)."""
    runner_up_prior: float = 0.3
    """How often a drafter's second choice is the target's token when its first is not, before
    any measure of it (``tree_choice.RunnerUps``)."""


def _checked(where: str, key: str, old: object, value: object) -> object:
    """``value`` for a setting whose default is ``old`` (an int may stand for a float); else
    ``ValueError``."""
    ok = (type(value) is type(old) or (type(value) is int and type(old) is float)
          or (old is None and isinstance(value, (int, float, str))))
    if not ok:
        raise ValueError(f"{where} setting {key!r} takes {type(old).__name__} values, "
                         f"got {value!r}")
    return value


def learned_config(overrides: dict | None = None, **base) -> LearnedPolicyConfig:
    """A ``LearnedPolicyConfig`` from ``base`` keyword arguments and JSON-like ``overrides``
    (``{"score_rounds": 2, "selector": {"ucb_c": 0.1}, "controller": {"k_max": 6}}``), e.g. from
    the router's ``--policy-config``. ``ValueError`` names an unknown or ill-typed setting."""
    cfg = LearnedPolicyConfig(**base)
    nested = {"selector": SelectorConfig, "controller": ControllerConfig, "guard": GuardConfig}
    known = sorted(f.name for f in fields(LearnedPolicyConfig))
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ValueError(f"unknown learned-policy setting {key!r}; known: {known}")
        if key in nested:
            if not isinstance(value, dict):
                raise ValueError(f"learned-policy setting {key!r} takes an object, got {value!r}")
            inner = getattr(cfg, key)
            names = sorted(f.name for f in fields(nested[key]))
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"unknown {key} setting(s) {unknown}; known: {names}")
            value = replace(inner, **{k: _checked(key, k, getattr(inner, k), v)
                                      for k, v in value.items()})
        else:
            value = _checked("learned-policy", key, getattr(cfg, key), value)
        cfg = replace(cfg, **{key: value})
    return cfg
