"""LossGuard: per kind of step, speculation measured against plain steps; and its place in the
learned policy (a plain step for every request in mode auto when speculation measures less)."""

from __future__ import annotations

import pytest

from spin.policy.base import PROMPT_LOOKUP, RequestView
from spin.policy.choice import StepChoice, StepPrediction
from spin.policy.learned import LearnedPolicy, learned_config
from spin.policy.loss_guard import GuardConfig, LossGuard, step_kind
from spin.policy.outcome import RequestOutcome, StepOutcome
from spin.timing.cost_model import CostModel
from policy.steps import timed_step

KIND = step_kind([False] * 8)


def run(guard: LossGuard, steps: int, spec_rate: float, off_rate: float) -> list[bool]:
    """``steps`` steps of one kind: each speculating one measures ``spec_rate`` tokens/s, each
    plain one ``off_rate``; what the guard chose for each."""
    out = []
    for _ in range(steps):
        spec = guard.speculate(KIND)
        out.append(spec)
        rate = spec_rate if spec else off_rate
        guard.observe(KIND, spec, 8, 8 / rate)
    return out


def test_step_kinds_bucket_the_batch_size_and_the_decoding() -> None:
    assert step_kind([True]) == (1, "greedy") and step_kind([False] * 3) == (2, "sampled")
    assert step_kind([True, False, True, True]) == (3, "mixed")
    assert step_kind([True] * 32) == step_kind([True] * 63) != step_kind([True] * 64)


def test_speculation_that_measures_less_turns_into_plain_steps_and_is_probed_back() -> None:
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=64, cold_batch=8))
    chose = run(guard, 200, spec_rate=80.0, off_rate=100.0)
    first_plain = chose.index(False)
    assert first_plain == 3  # the first probe of plain steps, after probe_min steps
    assert chose[40:].count(True) <= 3  # then plain, speculation probed ever more rarely
    assert guard.rates()[KIND] == (pytest.approx(80.0), pytest.approx(100.0), False)


def test_speculation_that_pays_keeps_running_with_rarer_probes() -> None:
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=64))
    chose = run(guard, 300, spec_rate=150.0, off_rate=100.0)
    assert chose[100:].count(False) <= 200 // 64 + 1  # one plain step in probe_max at most
    assert guard.rates()[KIND][2] is True


@pytest.mark.parametrize("tokens, speculates", [((1, 4), True), ((1, 2), False)])
def test_the_decision_changes_only_beyond_the_noise(tokens, speculates) -> None:
    """Speculating steps that give 1 or 4 tokens (95 tokens/s) against plain ones at 100 are
    within the noise of a few steps: the decision holds. At 1 or 2 (57) it changes."""
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=16, cold_batch=8))
    n = 0
    for _ in range(200):
        spec = guard.speculate(KIND)
        n += spec
        guard.observe(KIND, spec, tokens[n % 2] if spec else 1, 0.0263 if spec else 0.01)
    spec_rate, off_rate, decision = guard.rates()[KIND]
    assert off_rate == pytest.approx(100.0) and decision is speculates
    assert spec_rate == pytest.approx(sum(tokens) / 2 / 0.0263, rel=0.1)


def test_a_change_of_load_reverses_the_decision() -> None:
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=16))
    run(guard, 100, spec_rate=150.0, off_rate=100.0)
    assert guard.rates()[KIND][2] is True
    later = run(guard, 200, spec_rate=60.0, off_rate=100.0)  # the machine got busy
    assert later[-100:].count(True) <= 100 // 16 + 1
    assert guard.rates()[KIND][2] is False


def test_disabled_it_always_speculates_and_still_measures() -> None:
    guard = LossGuard(GuardConfig(enabled=False))
    assert run(guard, 50, spec_rate=1.0, off_rate=100.0) == [True] * 50
    assert guard.rates() == {KIND: (pytest.approx(1.0), 0.0, True)}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        GuardConfig(decay=1.0)
    with pytest.raises(ValueError):
        GuardConfig(probe_min=8, probe_max=4)


def _cost() -> CostModel:
    return CostModel(verify=(0.010, 0.0, 1e-4, 0.0, 0.0),
                     draft={"draft-code": (0.0005, 0.001, 0.0, 0.0)})


def test_the_learned_policy_runs_plain_steps_where_its_speculation_measured_less() -> None:
    """Sampled requests at batch 4 whose drafts the cost model thinks pay, but whose steps with
    speculation give fewer tokens per second than plain ones: the policy turns to plain steps
    (no drafter, no k, no scoring) for that kind of step, and probes speculation now and then.
    The cost model's calibration is off: it would learn the same loss from the step times and
    price speculation out for every kind, where this test asks what the guard does per kind."""
    policy = LearnedPolicy(learned_config({"score_after": 0, "trees": False,
                                           "controller": {"calibration": 0.0},
                                           "guard": {"cold_batch": 4}}), _cost())
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(4)]
    plain = []
    for step in range(60):
        plan = policy.choose(views, {"draft-code", PROMPT_LOOKUP})
        spec = any(c.drafter for c in plan)
        plain.append(not spec)
        # measured: a speculating step gives 1.2 tokens a request in 30 ms, a plain one 1 in 10
        tokens, seconds = (6 if spec else 4), (0.030 if spec else 0.010)
        outcomes = tuple(RequestOutcome(v.request_id, False, c, c.k, 0,
                                        tokens // 4 + (i < tokens % 4), True)
                         for i, (v, c) in enumerate(zip(views, plan)))
        policy.observe(StepOutcome(outcomes, plan.prediction, seconds / 3, seconds * 2 / 3,
                                   seconds))
    assert plain[3] and sum(plain[30:]) >= 26  # plain steps but for rare probes
    spec_rate, off_rate, decision = policy.guard.rates()[step_kind([False] * 4)]
    assert spec_rate == pytest.approx(200.0) and off_rate == pytest.approx(400.0)
    assert decision is False
    greedy = [RequestView(f"g{i}", 300, 10, 200, True) for i in range(4)]
    assert any(c.drafter for c in policy.choose(greedy, {"draft-code", PROMPT_LOOKUP}))


def test_a_draft_heads_first_step_counts_as_speculation() -> None:
    """A request's first step with a draft head verifies no draft but pays the head's drafting
    of the next chain (``RequestOutcome.asked``): it is weighed on speculation's side, one token
    in its time, never as a plain step that took longer."""
    guard = LossGuard(GuardConfig(cold_batch=1))
    kind = step_kind([False])
    for asked in (True, False):
        assert guard.plain([RequestView("r", 300, 10, 200, False)]) == [False]
        o = RequestOutcome("r", False, StepChoice(None), 0, 0, 1, True, asked=asked)
        guard.weigh(StepOutcome((o,), None, 0.0, 0.02 if asked else 0.01,
                                0.02 if asked else 0.01))
    spec_rate, off_rate, _ = guard.rates()[kind]
    assert (spec_rate, off_rate) == (pytest.approx(50.0), pytest.approx(100.0))


def test_heavy_tailed_gains_count_by_their_sum() -> None:
    """Most speculating steps accept nothing (9 tokens in 0.12 s, below plain steps' 8 in
    0.1 s), one in four a whole chain (40 tokens): speculation pays 1.5x in all, and the guard
    keeps it on (a median of per-step rates would call it a loss)."""
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4))
    n = 0
    for _ in range(200):
        spec = guard.speculate(KIND)
        if spec:
            n += 1
        guard.observe(KIND, spec, (40 if n % 4 == 0 else 9) if spec else 8,
                      0.12 if spec else 0.1)
    on, off, decision = guard.rates()[KIND]
    assert on > 1.2 * off and decision is True


def test_a_plain_decision_holds_in_steps_where_a_request_prefills() -> None:
    """Once plain steps measure more, a step in which a request arrives runs plain too, the
    arriving request included (no prompt scored), and the step, whose time is the prompt's,
    is not weighed on either side."""
    policy = LearnedPolicy(learned_config({"trees": False}), _cost())
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(4)]
    for _ in range(40):
        plan = policy.choose(views, {"draft-code", PROMPT_LOOKUP})
        spec = any(c.drafter for c in plan)
        outcomes = tuple(RequestOutcome(v.request_id, False, c, c.k, c.k, c.k + 1, True)
                         for v, c in zip(views, plan))  # every draft accepted, but slow:
        policy.observe(StepOutcome(outcomes, plan.prediction, 0.0, 0.01, 0.5 if spec else 0.01))
    kind = step_kind([False] * 5)  # the same kind as 4 requests'
    assert policy.guard.rates()[kind][2] is False
    before = policy.guard.rates()[kind]
    batch = [*views, RequestView("new", 300, 0, 200, False)]
    for _ in range(8):  # more than a probe interval: a step with a prefill probes nothing
        plan = policy.choose(batch, {"draft-code", PROMPT_LOOKUP})
        assert all(c.drafter is None and c.k == 0 and not c.score for c in plan)
        outcomes = tuple(RequestOutcome(v.request_id, False, c, c.k, 0, 1, True)
                         for v, c in zip(batch, plan))
        policy.observe(StepOutcome(outcomes, plan.prediction, 0.0, 0.2, 0.2))
    assert policy.guard.rates()[kind] == before  # prefill steps are not weighed


def test_a_probe_of_speculation_carries_no_scoring_and_expensive_probes_come_rarely() -> None:
    """Plain steps decided, a probe speculates without the policy's scoring calls; a probe that
    costs 25 plain steps' time more than a plain step is next repeated no sooner than that cost
    over ``probe_budget`` of a plain step (1250 steps at 2%), here ``probe_max``."""
    policy = LearnedPolicy(learned_config({"trees": False}), _cost())
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(4)]
    kinds = []
    for _ in range(80):
        plan = policy.choose(views, {"draft-code", PROMPT_LOOKUP})
        spec = any(c.drafter for c in plan)
        decided = policy.guard.rates().get(step_kind([False] * 4), (0, 0, True))[2]
        if spec and not decided:
            assert policy.guard.probing and not any(c.score for c in plan)
        kinds.append(spec)
        # every draft accepted (the controller keeps drafting), but a speculating step is slow
        outcomes = tuple(RequestOutcome(v.request_id, False, c, c.k, c.k, c.k + 1, True)
                         for v, c in zip(views, plan))
        policy.observe(StepOutcome(outcomes, plan.prediction, 0.0, 0.01, 0.26 if spec else 0.01))
    assert sum(kinds[40:]) == 0  # after the learning and one confirming probe: no more probes
    assert policy.guard._kinds[step_kind([False] * 4)].interval == GuardConfig().probe_max


def test_a_heads_first_step_after_plain_ones_is_a_transition_and_a_probe_goes_on() -> None:
    """A head drafts the chain its request's next step verifies. After steps the guard ran
    plain, a step that only asks a head for its first chain is weighed on neither side; in a
    probe of speculation the probe goes on one more step, which verifies the chain and is
    weighed. So a kind once decided plain can see a head win again."""
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=2, cold_batch=1))
    view = [RequestView("r", 300, 10, 200, False)]
    kind = step_kind([False])

    def step(drafter: str | None, asked: bool, tokens: int, seconds: float) -> None:
        o = RequestOutcome("r", False, StepChoice(drafter, 4 if drafter else 0),
                           4 if drafter else 0, tokens - 1, tokens, True, asked=asked)
        guard.weigh(StepOutcome((o,), None, 0.0, seconds, seconds))

    while guard.rates().get(kind, (0, 0, True))[2]:  # a slow drafter, then plain steps
        spec = not guard.plain(view)[0]
        step("draft-code" if spec else None, False, 1, 0.03 if spec else 0.01)
    while guard.plain(view)[0]:
        step(None, False, 1, 0.01)  # plain by decision, until the probe of speculation
    assert guard.probing
    before = guard.rates()[kind]
    step(None, True, 1, 0.03)  # the probe's step asked the head for its first chain
    assert guard.rates()[kind] == before  # weighed on neither side
    assert guard.plain(view) == [False] and guard.probing  # the probe goes on
    step("eagle", False, 5, 0.02)  # the head's chain: 5 tokens in 20 ms
    spec_rate, _, _ = guard.rates()[kind]
    assert spec_rate > before[0]  # weighed: speculation measured with the head
    guard.plain(view)
    step(None, True, 1, 0.03)  # a head's first step after a speculating one: speculation's
    assert guard.rates()[kind][0] < spec_rate


def test_a_request_alone_decides_by_its_own_speculation_and_its_kinds_plain_steps() -> None:
    """One request's drafts accepted badly and it ran plain: the next request alone starts
    speculating again (its acceptance is its own), weighed against the plain steps measured
    before it (no plain probes to begin with); while its speculation wins it keeps
    speculating."""
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, cold_batch=1))

    def steps(rid: str, n: int, spec_tokens: int) -> list[bool]:
        view, out = [RequestView(rid, 300, 10, 200, False)], []
        for _ in range(n):
            spec = not guard.plain(view)[0]
            out.append(spec)
            o = RequestOutcome(rid, False, StepChoice("eagle" if spec else None, 4),
                               4 if spec else 0, spec_tokens - 1 if spec else 0,
                               spec_tokens if spec else 1, True)
            guard.weigh(StepOutcome((o,), None, 0.0, 0.03 if spec else 0.01,
                                    0.03 if spec else 0.01))
        guard.release(rid)
        return out

    first = steps("a", 40, 1)  # 33 tokens/s speculating against 100 plain
    assert sum(first[20:]) <= 2
    second = steps("b", 40, 5)  # 167 tokens/s
    assert all(second[:8]) and sum(second) >= 37  # at most a rare probe of plain steps


def test_a_request_alone_starts_from_its_kinds_speculation_as_a_prior() -> None:
    """A sampled step gives 1 to k + 1 tokens: a request whose first four steps gave one token
    each has a standard error of about 0 on its own. Its speculating side starts from its
    kind's (worth ``min_steps`` steps), so such a start does not decide plain steps for good
    where earlier requests measured speculation at a gain with that spread; a request that
    goes on accepting nothing still goes plain."""
    def run(guard: LossGuard, rid: str, tokens: list[int]) -> list[bool]:
        view, out = [RequestView(rid, 300, 10, 200, False)], []
        for t in tokens:
            spec = not guard.plain(view)[0]
            out.append(spec)
            o = RequestOutcome(rid, False, StepChoice("eagle" if spec else None, 4),
                               4 if spec else 0, t - 1 if spec else 0, t if spec else 1, True)
            guard.weigh(StepOutcome((o,), None, 0.0, 0.03 if spec else 0.014,
                                    0.03 if spec else 0.014))
        return out

    warm = LossGuard(GuardConfig(min_steps=4, probe_min=4, cold_batch=1))
    run(warm, "a", [3, 1, 5, 2, 4, 1, 3, 5] * 5)  # 100 tokens/s against 71 (its probes)
    warm.release("a")
    assert warm.rates()[step_kind([False])][1] > 0  # the plain side is measured
    assert all(run(warm, "b", [1] * 5))  # a bad start: still speculating
    assert not all(run(warm, "b", [1] * 20))  # but no better later: plain
    cold = LossGuard(GuardConfig(min_steps=4, probe_min=4, cold_batch=1))
    run(cold, "a", [1] * 8)  # plain probes measured, speculation at a loss
    cold.release("a")
    assert not all(run(cold, "c", [1] * 8))


def test_a_request_alone_weighs_each_drafter_on_its_own_side() -> None:
    """A request alone whose bandit first tries a drafter that gives one token a step, then
    keeps one that gives four, is weighed by the drafter it uses: the loser's steps are no
    evidence against the other, which starts from the kind's side as a prior and, plain by the
    loser's record, speculates again from its first probe. With one drafter throughout the
    same steps stay plain; returning to the loser finds its own record."""
    def run(guard: LossGuard, rid: str, steps: list[tuple[str, int]]) -> list[bool]:
        view, out = [RequestView(rid, 300, 10, 200, False)], []
        for drafter, t in steps:
            spec = not guard.plain(view)[0]
            out.append(spec)
            o = RequestOutcome(rid, False, StepChoice(drafter if spec else None, 4),
                               4 if spec else 0, t - 1 if spec else 0, t if spec else 1, True)
            guard.weigh(StepOutcome((o,), None, 0.0, 0.03 if spec else 0.014,
                                    0.03 if spec else 0.014))
        return out

    def warm() -> LossGuard:
        guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, cold_batch=1))
        run(guard, "a", [("eagle", t) for t in [3, 1, 5, 2, 4, 1, 3, 5] * 5])
        guard.release("a")
        return guard

    tried = [("draft-code", 1)] * 6  # 33 tokens/s against 71 plain: plain after them
    switched = run(warm(), "b", tried + [("eagle", 4)] * 10)
    assert switched[:6] == [True] * 6 and not any(switched[6:9])
    assert sum(switched[9:]) >= 5  # the probe with the head: a new chance, and it wins
    kept = run(warm(), "b", tried + [("draft-code", 4)] * 10)
    assert sum(kept[9:]) <= 1  # its own record: plain but for probes
    guard = warm()
    run(guard, "b", tried + [("eagle", 4)] * 4)
    assert sum(run(guard, "b", [("draft-code", 1)] * 8)[1:]) <= 1  # back to its record


def test_the_learned_policy_probes_with_a_head() -> None:
    """Plain by decision, the learned policy's probes of speculation may use a draft head (the
    only drafter with a cost, every request's bandit picks it; a turn to it, priced over the
    two steps it takes, pays: every draft is accepted, the steps are slow)."""
    cost = _cost()
    cost.draft = {"eagle": (0.0, 0.0002, 0.0, 0.0, 0.0)}
    policy = LearnedPolicy(learned_config({"trees": False, "score_after": 0,
                                           "guard": {"cold_batch": 4}}), cost)
    heads = frozenset({"eagle"})
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(4)]
    used: dict[bool, set[str | None]] = {True: set(), False: set()}
    for _ in range(120):
        decided = policy.guard.rates().get(step_kind([False] * 4), (0, 0, True))[2]
        plan = policy.choose(views, {"eagle"}, heads)
        spec = any(c.drafter for c in plan)
        if spec:
            used[decided and not policy.guard.probing] |= {c.drafter for c in plan}
        outcomes = tuple(RequestOutcome(v.request_id, False, c, c.k, c.k, c.k + 1, True)
                         for v, c in zip(views, plan))  # every draft accepted, but slow:
        policy.observe(StepOutcome(outcomes, plan.prediction, 0.0, 0.01, 0.5 if spec else 0.01))
    assert used[True] == {"eagle"}  # by decision
    assert used[False] == {"eagle"}  # and in the probes once plain


def test_a_new_batch_size_starts_from_the_nearest_decided_one_as_large_or_plain() -> None:
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=2))
    assert guard.speculate(step_kind([True])) is True  # one request: speculating from the start
    assert guard.speculate(step_kind([True] * 16)) is False  # nothing as large: plain
    for _ in range(12):  # batch 8 of sampled requests, speculation at a gain (a new kind of
        spec = guard.speculate(KIND)  # 8 starts plain: the first probe speculates)
        guard.observe(KIND, spec, 8, 0.05 if spec else 0.1)
    assert guard.rates()[KIND][2] is True
    assert guard.speculate(step_kind([False] * 4)) is True  # a smaller batch: batch 8's win
    assert guard.speculate(step_kind([False] * 16)) is False  # a larger one: plain
    for _ in range(30):  # speculation turns into a loss at batch 8
        spec = guard.speculate(KIND)
        guard.observe(KIND, spec, 8, 0.2 if spec else 0.1)
    assert guard.rates()[KIND][2] is False
    assert guard.speculate(step_kind([False] * 2)) is False  # batch 8's decision
    warm = LossGuard(GuardConfig(cold_batch=16))
    assert warm.speculate(step_kind([True] * 16)) is True  # within cold_batch: speculating
    assert warm.speculate(step_kind([True] * 32)) is False


def test_saving_is_what_speculating_measures_to_save_per_token_at_the_nearest_batch_size() -> None:
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=16))
    assert guard.saving(KIND) is None  # nothing measured
    run(guard, 6, spec_rate=160.0, off_rate=100.0)
    assert guard.saving(KIND) is None  # one plain probe so far: not both sides
    run(guard, 40, spec_rate=160.0, off_rate=100.0)
    assert guard.saving(KIND) == pytest.approx(1 / 100 - 1 / 160)
    assert guard.saving((KIND[0] + 2, KIND[1])) == pytest.approx(1 / 100 - 1 / 160)  # nearest
    assert guard.saving((KIND[0], "greedy")) is None  # another decoding: not measured
    small = step_kind([False])
    for _ in range(4):
        guard.observe(small, True, 1, 1 / 20.0)
        guard.observe(small, False, 1, 1 / 40.0)
    assert guard.saving(small) == pytest.approx(1 / 40 - 1 / 20)  # a loss: negative
    assert guard.saving(KIND) == pytest.approx(1 / 100 - 1 / 160)


def test_until_plain_steps_are_measured_saving_weighs_speculation_against_the_predicted_plain(
        ) -> None:
    """A kind that speculates from the start has no plain steps but its probes; its saving
    compares the speculating steps' measured rate with the calibrated prediction of the same
    steps at k = 0 (``StepPrediction.plain_s``), and the measured plain steps once there are
    enough of them."""
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=64, probe_max=64))
    views = [RequestView(f"r{j}", 100, 5, 50, False) for j in range(3)]
    kind = step_kind([False] * 3)

    def step(spec: bool) -> None:
        guard.plain(views)
        guard.weigh(timed_step(spec))  # speculating: 6 tokens in 0.25 s, 0.1 s predicted plain

    step(True)
    assert guard.saving(kind) is None  # one speculating step: fewer than min_steps
    step(True)
    assert guard.saving(kind) == pytest.approx(0.1 / 3 - 0.25 / 6)  # predicted: a loss
    guard.observe(kind, False, 3, 0.05)
    guard.observe(kind, False, 3, 0.05)  # plain steps measured: 3 tokens in 0.05 s
    assert guard.saving(kind) == pytest.approx(0.05 / 3 - 0.25 / 6)


def test_the_scoring_calls_beside_a_prefill_are_charged_to_speculation() -> None:
    """A step in which requests prefill is not weighed, but where speculation is decided, what
    its scoring calls added beyond the predicted verification counts against speculation's
    rate; a plain-decided kind or a step without scoring calls is not charged."""
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=2, cold_batch=8))
    run(guard, 20, spec_rate=160.0, off_rate=100.0)
    before = guard.rates()[KIND]
    assert before[2] is True
    ids = [f"r{i}" for i in range(8)]
    reqs = tuple(RequestOutcome(r, False, StepChoice(None), 0, 0, 1, True) for r in ids)

    def prefill(scoring: tuple[int, int], seconds: float) -> StepOutcome:
        p = StepPrediction(0.1, {}, 0.1, scoring, prefill_tokens=300)
        return StepOutcome(reqs, p, 0.0, seconds, seconds)

    guard.weigh(prefill((0, 0), 0.5))  # no scoring calls: nothing charged
    assert guard.rates()[KIND] == before
    guard.weigh(prefill((16, 2400), 0.3))  # 0.2 s beyond the predicted verification
    spec = guard._kinds[KIND].spec
    assert spec.tokens / (spec.tokens / before[0] + 0.2) == pytest.approx(guard.rates()[KIND][0])
    assert guard.rates()[KIND][1:] == before[1:]  # the plain side untouched
    run(guard, 60, spec_rate=80.0, off_rate=100.0)  # now plain steps win
    assert guard.rates()[KIND][2] is False
    after = guard.rates()[KIND]
    guard.weigh(prefill((16, 2400), 0.3))  # plain decided: no scoring ran for speculation
    assert guard.rates()[KIND] == after


def _held_run(cap: int, forwards: int) -> tuple[list[int], int]:
    """Eight sampled requests whose speculating steps give 2 tokens each in 50 ms and whose
    plain forwards 1 in 10 ms, a call running ``min(hold, cap)`` plain forwards: the forward at
    which each step of speculation began, and the calls."""
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=4, probe_max=16, cold_batch=8))
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(8)]
    done, calls, speculated = 0, 0, []
    while done < forwards:
        plain = guard.plain(views)[0]
        n = min(guard.hold, cap) if plain else 1
        assert n >= 1 and (plain or guard.hold == 1)
        if not plain:
            speculated.append(done)
        outcomes = tuple(RequestOutcome(v.request_id, False, StepChoice(None) if plain
                                        else StepChoice("draft-code", 4), 0 if plain else 4,
                                        0 if plain else 1, n if plain else 2, True)
                         for v in views)
        seconds = 0.01 * n if plain else 0.05
        guard.weigh(StepOutcome(outcomes, None, 0.0, seconds, seconds, forwards=n))
        done, calls = done + n, calls + 1
    return speculated, calls


def test_plain_steps_by_decision_hold_until_the_next_probe_each_forward_a_step() -> None:
    """Plain steps decided, a step may run the plain forwards until the guard's next probe in
    one call (``hold``); a call of n forwards counts n steps toward the probe, so speculation is
    probed at the same forwards however many a call runs (the scheduler's cap), every
    ``probe_max`` once decided, in fewer calls."""
    one, calls_one = _held_run(cap=1, forwards=300)
    four, calls_four = _held_run(cap=4, forwards=300)
    held, calls_held = _held_run(cap=64, forwards=300)
    for probes in (one, four, held):
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert len(gaps) > 12 and set(gaps[-12:]) == {16}  # probe_max forwards apart
    assert one == four == held  # the cap changes the calls, not the decisions
    assert calls_held < calls_four <= calls_one / 3


def test_a_probe_of_speculation_that_drafts_nothing_is_a_held_plain_step() -> None:
    """Plain steps decided, a probe of speculation in which the controller drafts nothing (k = 0
    for every request) runs as a plain step held until the next probe, which comes after twice
    the interval: such probes hold ever longer, up to ``probe_max``, and are not weighed as
    speculation."""
    guard = LossGuard(GuardConfig(min_steps=2, probe_min=4, probe_max=64, cold_batch=8))
    views = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(8)]

    def call(n: int, spec: bool) -> None:
        outcomes = tuple(RequestOutcome(v.request_id, False, StepChoice("draft-code", 4)
                                        if spec else StepChoice(None), 4 if spec else 0,
                                        1 if spec else 0, 2 if spec else n, True) for v in views)
        seconds = 0.05 if spec else 0.01 * n
        guard.weigh(StepOutcome(outcomes, None, 0.0, seconds, seconds, forwards=n))

    for _ in range(200):  # until speculation loses: plain decided
        if not guard.rates().get(KIND, (0, 0, True))[2]:
            break
        spec = not guard.plain(views)[0]
        call(1 if spec else min(guard.hold, 4), spec)
    else:
        pytest.fail("plain steps not decided in 200 calls")
    before = guard.rates()[KIND]
    holds = []
    for _ in range(12):
        if not guard.plain(views)[0]:  # a probe of speculation
            assert guard.probing
            guard.drafts_nothing()
            assert not guard.probing
            holds.append(guard.hold)
        call(guard.hold, False)
    assert len(holds) >= 4 and holds[:4] == [8, 16, 32, 64] and set(holds[4:]) <= {64}
    assert guard.rates()[KIND][0] == before[0]  # speculation's side: nothing weighed


def test_a_step_without_drafts_holds_and_only_plain_steps_by_decision_advance_the_probe() -> None:
    """A step in which no request drafts, scores or prefills is held (``drafts_nothing``):
    where speculation is decided (a probe of plain steps, the controller's k = 0 for every
    request) for ``probe_max`` forwards, whose further forwards are no steps toward the next
    probe; where plain steps are decided until that probe. Counted toward it, a request alone
    whose held probe of plain steps ran 4 forwards was probed plain again at once, and again,
    its speculating side never measured enough to decide: plain for good."""
    guard = LossGuard(GuardConfig(min_steps=4, probe_min=4, probe_max=64))
    alone = [RequestView("solo", 300, 10, 200, False)]
    calls = []
    for _ in range(60):
        spec = not guard.plain(alone)[0]
        if spec:  # 3 tokens in 20 ms: 150 tokens/s
            outcome = RequestOutcome("solo", False, StepChoice("draft-code", 2), 2, 2, 3, True)
            guard.weigh(StepOutcome((outcome,), None, 0.0, 0.02, 0.02))
        else:  # held: 4 forwards at 10 ms each, 100 tokens/s
            guard.drafts_nothing(steady=True)
            assert guard.hold == 64
            n = min(guard.hold, 4)
            outcome = RequestOutcome("solo", False, StepChoice(None), 0, 0, n, True)
            guard.weigh(StepOutcome((outcome,), None, 0.0, 0.01 * n, 0.01 * n, forwards=n))
        calls.append(spec)
    assert calls[20:].count(False) <= 2 and guard.rates()[step_kind([False])][2] is True
    guard.plain(alone)
    guard.drafts_nothing(steady=False)  # a step that scores or prefills: one forward
    assert guard.hold == 1

    batch = [RequestView(f"r{i}", 300, 10, 200, False) for i in range(8)]
    run(guard, 40, spec_rate=80.0, off_rate=100.0)  # plain decided for batches of 8
    for _ in range(16):  # a probe of speculation comes only every few calls
        if guard.plain(batch)[0]:
            break
    else:
        pytest.fail("no plain step in 16 calls with plain steps decided")
    decided = guard.hold  # until the next probe
    guard.drafts_nothing(steady=True)
    assert guard.hold == decided < 64
