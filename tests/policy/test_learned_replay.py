"""The learned policy replayed: a fixed sequence of choose / observe (one request's step, one
drafter's score or one step's times: ``steps.py``) / release calls makes exactly the choices (and step predictions) recorded in
``learned_replay.json``.

The recording was taken from the policy as it was before its per-request state moved into one
object (``request_state.py``) and ``choose`` into phases (drafters, k, scoring, prediction); any
change to what the policy chooses shows up here as the first step that differs. Re-record
(``python tests/policy/test_learned_replay.py``) only for a change meant to alter the choices, and
say so where the change is described. Last re-recorded when the loss guard's plain steps stopped
counting toward a request's k = 1 probe (a probe of speculation then runs the controller's plan).
Before that, when a request held at k = 0 began to
age its drafter's acceptance estimate back toward the population's (``AcceptanceTracker.relax``)
and every bandit prior moved to the population's measured scale (``_prior_from_rate``): held
requests speculate again sooner, so every later choice differs. Before that, when scoring calls
with no known saving stopped going ahead once their cost is measured (``scoring_rounds.py``).

Each scenario runs a small synthetic deployment: requests of three kinds arrive, share batches of
up to four, accept draft tokens at their kind's rate per drafter (a seeded ``random.Random``), score
what the policy asks them to, finish at their ``max_tokens`` or are cancelled; the served step
times are derived from the plan's prediction, so calibration and the scoring cost are exercised.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from spin.policy.base import PROMPT_LOOKUP, RequestView, StepChoice, StepPlan
from spin.timing.cost_model import CostModel
from spin.policy.learned import LearnedPolicy, learned_config
from spin.stats.store import DrafterStats
from policy.steps import observe, observe_score, observe_step

FIXTURE = Path(__file__).with_name("learned_replay.json")
MODELS = ("draft-code", "draft-prose", "draft-structured")
DRAFTERS = frozenset({*MODELS, PROMPT_LOOKUP})
KINDS = ("code", "prose", "structured")
ACCEPT = {  # kind -> drafter -> acceptance rate on the output
    "code": {"draft-code": 0.85, "draft-prose": 0.5, "draft-structured": 0.55, PROMPT_LOOKUP: 0.4},
    "prose": {"draft-code": 0.45, "draft-prose": 0.8, "draft-structured": 0.4, PROMPT_LOOKUP: 0.2},
    "structured": {"draft-code": 0.6, "draft-prose": 0.45, "draft-structured": 0.85,
                   PROMPT_LOOKUP: 0.6},
}
PROMPT = {  # kind -> model drafter -> agreement with the prompt
    "code": {"draft-code": 0.55, "draft-prose": 0.35, "draft-structured": 0.5},
    "prose": {"draft-code": 0.3, "draft-prose": 0.5, "draft-structured": 0.28},
    "structured": {"draft-code": 0.5, "draft-prose": 0.3, "draft-structured": 0.56},
}
MATCH = {"code": 0.6, "prose": 0.3, "structured": 0.8}
"""kind -> probability that prompt lookup finds a match at a step"""

NO_GUARD = {"guard": {"enabled": False}}
SCENARIOS: dict[str, dict] = {
    "default": {"overrides": {**NO_GUARD}},
    "output_scores": {"overrides": {"prompt_fit": False, "score_rounds": 3, "score_every": 6,
                                    **NO_GUARD}},
    "pruned": {"overrides": {"lookup_rescore": False, "fit_prune_after": 3,
                             "fit_explore_every": 2, **NO_GUARD}},
    "by_acceptance": {"overrides": {"fit_by_goodput": False, "fit_margin": 0.05,
                                    "fit_pooled_seed": False, "probe_every": 3, **NO_GUARD}},
    "no_cost_model": {"overrides": {**NO_GUARD}, "cost": False},
    "pipelined_thompson": {"overrides": {"controller": {"pipelined": True, "k_max": 8},
                                         "selector": {"algorithm": "thompson"},
                                         "stop_below": 0.0, "probe_every": 2, **NO_GUARD},
                           "population": False},
}
"""The guard (``loss_guard.py``) is off: it weighs whole steps, which this replay reports request
by request (``test_loss_guard.py`` tests it, and its place in the policy)."""
STEPS = 100
"""choose calls per scenario"""


def _cost() -> CostModel:
    return CostModel(verify=(0.010, 2e-4, 1e-4, 1e-7, 2e-8),
                     draft={"draft-code": (0.001, 0.0012, 1e-4, 1e-7, 2e-4),
                            "draft-prose": (0.001, 0.0020, 1e-4, 1e-7, 2e-4),
                            "draft-structured": (0.0005, 0.0008, 1e-4, 1e-7, 1e-4)})


def _population() -> dict[str, DrafterStats]:
    return {"draft-code": DrafterStats(drafts=200, draft_tokens=800, accepted_tokens=430,
                                       draft_seconds=0.9, verify_seconds=2.4),
            "draft-prose": DrafterStats(drafts=150, draft_tokens=600, accepted_tokens=300,
                                        draft_seconds=0.9, verify_seconds=1.8),
            "draft-structured": DrafterStats(drafts=100, draft_tokens=400, accepted_tokens=150,
                                             draft_seconds=0.3, verify_seconds=1.2),
            PROMPT_LOOKUP: DrafterStats(drafts=300, draft_tokens=1200, accepted_tokens=400,
                                        draft_seconds=0.01, verify_seconds=3.6)}


@dataclass
class _Request:
    rid: str
    kind: str
    prompt: int
    max_tokens: int
    mode: str = "auto"
    drafter: str | None = None
    k: int = 0
    generated: int = 0
    fed: dict[str, int] = field(default_factory=dict)
    """drafter -> context length it last scored"""

    @property
    def context(self) -> int:
        return self.prompt + self.generated


def _new_request(rng: random.Random, n: int) -> _Request:
    r = _Request(f"r{n}", rng.choice(KINDS), rng.randint(20, 300), rng.randint(6, 60))
    roll = rng.random()
    if roll < 0.05:
        r.mode = "off"
    elif roll < 0.12:
        r.mode, r.drafter = "drafter", rng.choice(sorted(DRAFTERS))
        r.k = rng.choice((0, 3))
    return r


def _binomial(rng: random.Random, n: int, p: float) -> int:
    return sum(rng.random() < p for _ in range(n))


def _accepted(rng: random.Random, k: int, rate: float) -> int:
    m = 0
    while m < k and rng.random() < rate:
        m += 1
    return m


def _record(plan: StepPlan) -> list:
    p = plan.prediction
    return [[[c.drafter, c.k, list(c.branching), list(c.score), c.stop_below] for c in plan],
            None if p is None else [p.step_s, sorted(p.draft_s.items()), p.verify_s,
                                    list(p.scoring_work), p.scoring_s]]


def run_scenario(name: str) -> list:
    """The scenario's plans, one per choose call, as ``_record`` writes them."""
    spec = SCENARIOS[name]
    rng = random.Random(sorted(SCENARIOS).index(name) + 1)
    # chains only: the recording predates token trees (``tree_choice.py``), which change choices
    cfg = learned_config({"refresh_s": 3600.0, "trees": False, **spec["overrides"]})
    policy = LearnedPolicy(cfg, _cost() if spec.get("cost", True) else None,
                           population=_population if spec.get("population", True) else None)
    plans, running, arrived = [], [], 0
    try:
        for _ in range(STEPS):
            while len(running) < 4 and (not running or rng.random() < 0.5):
                running.append(_new_request(rng, arrived))
                arrived += 1
            available = set(DRAFTERS)
            if rng.random() < 0.1:
                available.discard(rng.choice(MODELS))  # a drafter down this step
            views = [RequestView(r.rid, r.context, r.generated, r.max_tokens - r.generated, True,
                                 r.mode, r.drafter, r.k, lookup_match=rng.random() < MATCH[r.kind])
                     for r in running]
            plan = policy.choose(views, available)
            plans.append(_record(plan))
            scoring = 0
            for r, c in zip(running, plan):
                for scorer in c.score:
                    if scorer == c.drafter:
                        continue
                    positions = max(1, r.context - r.fed.get(scorer, 0))
                    r.fed[scorer] = r.context
                    rate = (PROMPT[r.kind][scorer] if r.generated == 0 and scorer in MODELS
                            else ACCEPT[r.kind][scorer])
                    scoring += scorer != PROMPT_LOOKUP
                    observe_score(policy, r.rid, scorer, _binomial(rng, positions, rate),
                                         positions)
            draft_s: dict[str, float] = {}
            finished = []
            for r, c in zip(running, plan):
                if c.drafter is None or c.k <= 0 or rng.random() < 0.05:  # no tree came back
                    choice, accepted = StepChoice(None), 0
                    seconds = 0.0
                else:
                    drafted = rng.randint(1, c.k) if c.stop_below else c.k
                    choice = replace(c, k=drafted) if drafted < c.k else c
                    accepted = _accepted(rng, drafted, ACCEPT[r.kind][c.drafter])
                    seconds = 0.0005 if c.drafter == PROMPT_LOOKUP else 0.002 + 0.001 * drafted
                    draft_s[c.drafter] = max(draft_s.get(c.drafter, 0.0), seconds)
                    r.fed[c.drafter] = r.context
                verify_s = 0.011 + 0.0002 * len(running)
                observe(policy, r.rid, choice, accepted, seconds, verify_s)
                r.generated += accepted + 1
                if r.generated >= r.max_tokens or rng.random() < 0.02:  # done, or cancelled
                    finished.append(r)
            p = plan.prediction
            if p is not None and p.step_s > 0:
                served = {d: 1.2 * s + 0.001 for d, s in p.draft_s.items()}
                observe_step(policy, p, served, 1.1 * p.verify_s + 0.002 + 0.004 * scoring)
            for r in finished:
                policy.release(r.rid)
                running.remove(r)
    finally:
        policy.close()
    return plans


def record() -> None:
    """Write the fixture from the policy as it is now."""
    data = {name: run_scenario(name) for name in SCENARIOS}
    lines = ["{"]
    for i, (name, plans) in enumerate(data.items()):
        lines.append(f"  {json.dumps(name)}: [")
        rows = [f"    {json.dumps(p, separators=(',', ':'))}" for p in plans]
        lines += [row + ("," if j < len(rows) - 1 else "") for j, row in enumerate(rows)]
        lines.append("  ]" + ("," if i < len(data) - 1 else ""))
    lines.append("}")
    FIXTURE.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def recorded() -> dict[str, list]:
    return json.loads(FIXTURE.read_text())


def test_the_recording_covers_every_path(recorded: dict[str, list]) -> None:
    """The replay is worth something only if the recorded steps exercise the policy's phases."""
    assert set(recorded) == set(SCENARIOS)
    choices = [c for plans in recorded.values() for step, _ in plans for c in step]
    assert sum(len(plans) for plans in recorded.values()) == STEPS * len(SCENARIOS)
    assert {c[0] for c in choices} == {*DRAFTERS, None}
    assert any(c[1] == 1 for c in choices) and max(c[1] for c in choices) >= 7  # probes, long k
    assert any(set(c[3]) >= {"draft-code", "draft-prose"} for c in choices)  # prompt scoring
    assert any(c[3] == [PROMPT_LOOKUP] for c in choices)  # lookup rescoring
    assert any(c[4] > 0 for c in choices) and any(c[0] and c[4] == 0 for c in choices)
    predicted = [p for plans in recorded.values() for _, p in plans if p is not None]
    assert any(p[3][0] > 0 for p in predicted) and any(p[4] > 0 for p in predicted)
    assert any(p is None for _, p in recorded["no_cost_model"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_policy_makes_the_recorded_choices(name: str, recorded: dict[str, list]) -> None:
    # through JSON, as recorded: tuples become lists, floats round-trip exactly
    replayed = json.loads(json.dumps(run_scenario(name)))
    for i, (got, want) in enumerate(zip(replayed, recorded[name])):
        assert got == want, f"{name}: step {i} differs"
    assert len(replayed) == len(recorded[name])


if __name__ == "__main__":
    sys.exit(record())
