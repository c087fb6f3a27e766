"""How much of k early-stopping chains draft: the fraction that scales their predicted k."""

from __future__ import annotations

import pytest

from spin.policy.base import PROMPT_LOOKUP, StepChoice
from spin.policy.chain_length import EMA, ChainLength


def test_only_early_stopping_chains_are_scaled_by_what_their_drafter_drafted() -> None:
    chains = ChainLength()
    stopping = StepChoice("draft-code", 8, stop_below=0.1)
    assert chains.expected_k(stopping) == 8.0  # nothing seen: k
    chains.chosen("a", stopping)
    chains.observe("a", StepChoice("draft-code", 2, stop_below=0.1))  # drafted 2 of 8
    assert chains.expected_k(stopping) == pytest.approx(8 * (1 - EMA * 0.75))
    assert chains.expected_k(StepChoice("draft-code", 8)) == 8.0  # full length asked
    assert chains.expected_k(StepChoice("draft-prose", 8, stop_below=0.1)) == 8.0  # its own
    chains.chosen("b", StepChoice(PROMPT_LOOKUP, 4))  # no stop: not followed
    chains.observe("b", StepChoice(PROMPT_LOOKUP, 1))
    assert chains.expected_k(StepChoice(PROMPT_LOOKUP, 4, stop_below=0.1)) == 4.0


def test_a_step_counts_once_and_a_released_request_not_at_all() -> None:
    chains = ChainLength()
    chains.chosen("a", StepChoice("draft-code", 4, stop_below=0.1))
    chains.observe("a", StepChoice("draft-code", 4))  # all of k
    chains.observe("a", StepChoice("draft-code", 1))  # no chain chosen since: ignored
    chains.chosen("b", StepChoice("draft-code", 4, stop_below=0.1))
    chains.release("b")
    chains.observe("b", StepChoice("draft-code", 1))
    assert chains.expected_k(StepChoice("draft-code", 4, stop_below=0.1)) == 4.0
