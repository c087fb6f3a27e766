"""The draft selector's regret in simulation: how much goodput the per-request bandit
(``policy/selector.py``) loses against an oracle that knows each request's best drafter.

A workload is a list of ``SimArm``: per request class, each drafter's i.i.d. acceptance rate and
drafting cost; a simulated step drafts ``SIM_K`` tokens and emits 1 + the accepted ones. Requests
cycle through the classes; the selector learns from the sampled steps, and regret counts the
expected goodput of the drafters it chose (pseudo-regret). ``regret_table`` prints the comparison
of the bandit algorithms that ``policy/selector.py``'s module doc quotes::

    python -m spin.bench.selector_sim
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Literal

from ..policy.base import PROMPT_LOOKUP
from ..policy.population import PopulationArm
from ..policy.selector import ALGORITHMS, Algorithm, DraftSelector, SelectorConfig

SIM_K = 4
"""Draft tokens per simulated step."""
SIM_VERIFY_S = 0.020
"""Verify seconds of a simulated step (shared by all drafters)."""


@dataclass(frozen=True)
class SimArm:
    """One drafter on one request class, for the regret simulation."""

    name: str
    """Drafter name."""
    accept_rate: float
    """Probability that each draft token is accepted (i.i.d.; the chain stops at a rejection)."""
    draft_s_per_token: float
    """Drafting seconds per draft token."""
    request_class: str = "default"
    """Request class this arm describes (each class lists every drafter)."""

    def expected_tokens(self, k: int = SIM_K) -> float:
        """1 + E[accepted] = sum_{i=0..k} accept_rate^i."""
        return sum(self.accept_rate ** i for i in range(k + 1))

    def step_seconds(self, switch_s: float = 0.0, k: int = SIM_K) -> float:
        """Verify + draft (+ switch) seconds of a step."""
        return SIM_VERIFY_S + k * self.draft_s_per_token + switch_s

    def expected_goodput(self, switch_s: float = 0.0) -> float:
        """Expected tokens per second of a step."""
        return self.expected_tokens() / self.step_seconds(switch_s)

    def sample_tokens(self, rng: random.Random, k: int = SIM_K) -> int:
        """Tokens emitted by one step: 1 + accepted draft tokens."""
        tokens = 1
        for _ in range(k):
            if rng.random() >= self.accept_rate:
                break
            tokens += 1
        return tokens


def three_class_workload() -> list[SimArm]:
    """Code, prose and structured requests; each class has a different best draft model."""
    names = ("sim-code", "sim-prose", "sim-structured", PROMPT_LOOKUP)
    rates = {  # class -> accept rate of each of ``names``
        "code": (0.85, 0.55, 0.60, 0.35),
        "prose": (0.50, 0.80, 0.50, 0.20),
        "structured": (0.60, 0.50, 0.85, 0.50),
    }
    return [SimArm(name, rate, 0.0001 if name == PROMPT_LOOKUP else 0.002, cls)
            for cls, row in rates.items() for name, rate in zip(names, row)]


def _classes(arms: list[SimArm]) -> dict[str, dict[str, SimArm]]:
    out: dict[str, dict[str, SimArm]] = {}  # class -> drafter -> arm
    for arm in arms:
        out.setdefault(arm.request_class, {})[arm.name] = arm
    return out


def mixture_population(arms: list[SimArm], observations: int = 1000) -> dict[str, PopulationArm]:
    """The population prior of a workload with equally many requests per class."""
    classes = _classes(arms)
    names = sorted({a.name for a in arms})
    return {n: PopulationArm(sum(c[n].expected_goodput() for c in classes.values()) / len(classes),
                             observations) for n in names}


def class_population(arms: list[SimArm], request_class: str,
                     observations: int = 1000) -> dict[str, PopulationArm]:
    """A prior that is exactly right for one class."""
    return {a.name: PopulationArm(a.expected_goodput(), observations)
            for a in arms if a.request_class == request_class}


def simulate_regret(algorithm: Algorithm, arms: list[SimArm], steps: int, requests: int,
                    seed: int = 0, config: SelectorConfig | None = None,
                    prior: Literal["mixture", "class", "none"] = "mixture") -> float:
    """Regret of the selector as a fraction of the oracle's summed expected goodput.

    Requests cycle through the classes of ``arms``; each runs ``steps`` steps, each step pays the
    selector's switch cost. Achieved = summed expected goodput of the chosen drafters (pseudo-
    regret: the sampled tokens drive learning, their luck does not count); oracle = the best
    single drafter of the request's class (paying its first catch-up prefill). ``prior``: the
    population mixture (wrong for every class), the request's own class (correct), or none (no
    population: every drafter is tried once first).
    """
    cfg = replace(config or SelectorConfig(), algorithm=algorithm, seed=seed)
    classes = _classes(arms)
    class_names = sorted(classes)
    sel = DraftSelector(cfg, mixture_population(arms) if prior == "mixture" else None)
    env = random.Random(seed + 1_000_003)
    regret = oracle_total = 0.0
    for i in range(requests):
        cls_name, rid = class_names[i % len(class_names)], f"req-{i}"
        cls = classes[cls_name]
        if prior == "class":
            sel.set_population(class_population(arms, cls_name))
        oracle = max(a.expected_goodput(sel.switch_cost_s(rid, a.name))
                     + (steps - 1) * a.expected_goodput() for a in cls.values())
        achieved = 0.0
        for _ in range(steps):
            name = sel.choose(rid, set(cls))
            switch = sel.switch_cost_s(rid, name)
            achieved += cls[name].expected_goodput(switch)
            sel.update(rid, name, cls[name].sample_tokens(env), cls[name].step_seconds(switch))
        sel.release(rid)
        regret += oracle - achieved
        oracle_total += oracle
    return regret / oracle_total


def compare_algorithms(arms: list[SimArm], steps: int = 32, requests: int = 300, seed: int = 0,
                       config: SelectorConfig | None = None) -> dict[str, float]:
    """Algorithm -> regret fraction on the same workload and seed."""
    return {alg: simulate_regret(alg, arms, steps, requests, seed, config) for alg in ALGORITHMS}


def regret_table(arms: list[SimArm], steps: tuple[int, ...] = (16, 32, 64), requests: int = 300,
                 seed: int = 0, config: SelectorConfig | None = None) -> str:
    """A printable table: one row per algorithm, one regret column per horizon."""
    rows = {s: compare_algorithms(arms, s, requests, seed, config) for s in steps}
    lines = ["algorithm  " + "".join(f"{s:>6} steps" for s in steps)]
    for alg in ALGORITHMS:
        lines.append(f"{alg:<11}" + "".join(f"{rows[s][alg]:>12.3f}" for s in steps))
    return "\n".join(lines)


if __name__ == "__main__":
    print(regret_table(three_class_workload()))
