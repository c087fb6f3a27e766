"""A measured point is the fastest of timings that agree (``timing.measure.steady_time``): a
call another process preempted is timed again, not averaged in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spin.timing import measure


class Calls:
    """A call whose durations are given in advance, on a clock only it advances."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.now = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def __call__(self) -> None:
        self.now += self.durations[self.calls]
        self.calls += 1


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch):
    def make(durations: list[float]) -> Calls:
        c = Calls(durations)
        monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=c.clock))
        return c
    return make


def test_a_preempted_call_is_timed_again_until_two_agree(calls) -> None:
    c = calls([5.0, 9.0, 1.0, 9.0, 1.05, 1.0])  # the warm-up, then two calls preempted
    assert measure.steady_time(c, reps=3) == pytest.approx(1.0)
    assert c.calls == 5  # the warm-up and four: 1.0 and 1.05 agree within 10%


def test_timings_that_agree_at_once_take_the_given_repetitions(calls) -> None:
    c = calls([5.0, 1.02, 1.0, 1.01, 1.0])
    assert measure.steady_time(c, reps=3) == pytest.approx(1.0)
    assert c.calls == 4


def test_timings_that_never_agree_stop_at_four_times_the_repetitions(calls) -> None:
    c = calls([5.0] + [2.0 ** i for i in range(20)])
    assert measure.steady_time(c, reps=2) == pytest.approx(1.0)  # the fastest of them
    assert c.calls == 1 + 8
