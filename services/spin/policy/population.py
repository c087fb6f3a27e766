"""What the population (every request, every router: the acceptance statistics in Redis) tells
the policy, and how its entries are named.

A drafter accepts differently under greedy decoding and sampling, so each drafter has two
population entries (``population_name``); the policy seeds a request from its own decoding's
(``population_entry``). The router records steps under these names (``router/accounting.py``) and
the statistics store keeps whatever names it is given; the policy reads the store's entries
through ``StepStats``, the fields it needs, without importing the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)


SAMPLED_SUFFIX = "@sampled"
"""Suffix of the entry that counts a drafter's steps for sampling requests (``population_name``)."""


def population_name(drafter: str, greedy: bool) -> str:
    """The population entry that counts ``drafter``'s steps: its own name for greedy requests,
    ``{drafter}@sampled`` for sampling ones. A drafter accepts differently under the two: a greedy
    draft is accepted when it equals the target's argmax, a sampled one with probability
    min(1, p/q). On code prompts draft-code accepts 2.58 tokens of a greedy 4-token draft
    (``models/demo/README.md``), about 0.83 per token, against about 0.58 per token of sampled
    output (temperature 0.8, top-p 0.95). One entry for both would give each the other's rate."""
    return drafter if greedy else drafter + SAMPLED_SUFFIX


_T = TypeVar("_T")


def population_entry(entries: Mapping[str, _T], drafter: str, greedy: bool) -> _T | None:
    """``drafter``'s value in ``entries`` (keyed by ``population_name``) for requests of that
    decoding: its own decoding's, else the other's (a drafter without statistics of its own
    decoding yet), else None."""
    own = entries.get(population_name(drafter, greedy))
    return own if own is not None else entries.get(population_name(drafter, not greedy))


class StepStats(Protocol):
    """What the policy reads of one population entry (``stats.store.DrafterStats`` has it)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    draft_seconds: float
    verify_seconds: float

    @property
    def chain_acceptance(self) -> float: ...


@dataclass(frozen=True)
class PopulationArm:
    """What the population knows about one drafter."""

    mean_reward: float
    """Mean goodput of a step (tokens per second)."""
    observations: int
    """Steps behind that mean (0 = no data: the drafter gets the optimistic prior)."""


def population_from_stats(stats: Mapping[str, StepStats],
                          step_s_hint: float | None = None) -> dict[str, PopulationArm]:
    """Population priors from acceptance statistics.

    mean_reward = (drafts + accepted_tokens) / (draft_seconds + verify_seconds): tokens emitted per
    second over all steps (each step emits its accepted tokens plus one). When a drafter has steps
    but no recorded time, ``step_s_hint`` (seconds per step) stands in for it; without a hint such a
    drafter is left out (and gets the optimistic prior). observations = drafts.
    """
    out: dict[str, PopulationArm] = {}
    for name, s in stats.items():
        seconds = s.draft_seconds + s.verify_seconds
        if seconds <= 0.0 and step_s_hint is not None and step_s_hint > 0.0:
            seconds = s.drafts * step_s_hint
        if s.drafts > 0 and seconds > 0.0:
            out[name] = PopulationArm((s.drafts + s.accepted_tokens) / seconds, s.drafts)
    return out


class PopulationFeed:
    """Reads the population statistics now and then every ``every_s`` seconds in a background
    thread, handing each reading to ``update`` (a store that fails is logged and tried again)."""

    def __init__(self, read: Callable[[], Mapping[str, StepStats]],
                 update: Callable[[Mapping[str, StepStats]], None], every_s: float) -> None:
        self.read, self.update, self.every_s = read, update, every_s
        self._stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._loop, daemon=True, name="policy-population").start()

    def refresh(self) -> None:
        """Read the statistics and hand them on."""
        try:
            stats = self.read()
        except Exception as e:  # the store never raises by contract; stay safe regardless
            log.warning("population statistics unavailable: %s", e)
            return
        self.update(stats)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
