"""Speculation never slower than off, by measurement: the policy's plan against plain steps.

The controller's (``goodput.py``) cost model and acceptance estimates can be wrong where it
matters most (a verifier's forward under load, a sampling request's drafts), so the learned
policy also *measures* what speculation delivers. For each kind of step (``StepKind``: the
micro-batch's size, rounded to a power of two, and whether its requests are greedy, sampled or
mixed) the guard keeps the tokens and seconds of the steps that speculated and of those that did
not, discounted to follow the load, and compares the two rates, tokens per second of step.

While speculation measures at least the rate of plain steps, the policy's plan runs; once it
measures less, that kind of step runs without speculation (k = 0 for every request in mode auto).
The side not in use is probed with one step now and then, so a decision follows the traffic: first
after ``probe_min`` steps, then, after each probe that confirmed the decision, at twice the interval
or at what keeps the probes' cost within ``probe_budget`` of the time, whichever is longer, up to
``probe_max``; from ``probe_min`` again after any change of it. A probe of speculation runs without
the policy's scoring calls (on a 2-core CPU a probe at batch 32 with the scoring that plain steps
had put off took 2.2 s, a plain step 0.1 s), heads allowed. A head drafts the chain its request's
*next* step verifies, so a request's first step with it verifies nothing; after a step the guard ran
plain (a probe of plain steps, or plain by decision) such a step is the guard's transition, not
speculation's cost: it is weighed on neither side, and in a probe of speculation the probe goes on
for one more step, which verifies the chain (before 2026-11-28 probes left heads out: 564 of 572
sampled single-stream steps ran plain where the head at k = 4 measured 1.26x plain). A head's first
step after a speculating one is weighed on speculation's side.

**One request.** A step of one request alone is decided by that request's own record: its own
speculating steps against its kind's plain ones (a lone decoding step costs the same whoever's
it is), since whether speculation pays one request alone is its own matter (before 2026-11-28
one request on which the head accepted 0-1 token a step decided plain steps for the 8 after it).
Its speculating side is the drafter's it uses now, each drafter's starting from its kind's as a
prior worth ``min_steps`` steps (``Side.prior``): a sampled step gives 1 to k + 1 tokens, and
a request's first few alike had a standard error of about 0 (requests went plain for good after
3-4 steps with the head, which at k = 4 measured 1.26x plain on those tuning prompts), while the
bandit's exploring a drafter that loses is no evidence against the one it keeps (five sampled
requests whose first 4-6 steps tried model drafters accepting 0-1 token ran plain for their ~50
other steps, where the head at k = 4 measured 1.1-2.1x plain on those prompts). A request alone
starts speculating (``cold_batch``), probing plain steps at its kind's interval (``probe_min``
until its kind's plain side has ``min_steps`` steps); plain by one drafter's record, a probe with
a drafter it has not measured that often starts speculating again, as a new request does.

A new kind of step starts from the decision of the nearest batch size of its decoding, as
large or larger, that both sides have measured, and probes the other side at ``probe_min`` until
both have ``min_steps`` steps. Without such a batch size it starts plain, but for a single
request (``cold_batch``): speculation's marginal cost grows with the batch (the verifier scores
``B * (k + 1)`` tokens, every drafter catches up with every context), so a smaller batch's win
is no evidence for a larger one, while one request is where speculation is made to win and a
probe is cheapest (borrowing smaller batches' decisions, the first 31 prompts arriving at batch
32 ran speculating at 0.68x plain: ``spin bench grid --split tuning --concurrency 32,64``).
Steps in which a request prefills its prompt are not counted (their time is the prompt's) and
probe nothing, but the decision holds there for every request, the prefilling ones too: a plain
step scores no prompt (scoring 31 prompts of 270 tokens with four drafters beside their prefill
made that step 1.6x longer on a 2-core CPU). Where speculation is decided, the scoring
calls of such a step (its prompts scored beside their prefill) are speculation's cost: the
seconds the step took beyond its predicted verification are added to its kind's speculating
side, without tokens (before 2026-11-27 they were left out, and on ``spin bench grid --split
tuning --prompts long`` such steps took 11-16 s of a 28-56 s cell unseen by the guard).
Tried and worse (one ``spin bench grid`` run each): counting those steps, medians of per-step
rates (a drafter's gains are heavy-tailed), windows of the last 16 steps. Not kept, their runs
confounded (2026-11-29, ``benchmarks/PROVENANCE.md``): holding such a step where plain steps are
decided, as speculation off holds it; a request alone's reversal leaving its kind's interval.

**Holds.** Where the guard's decision is plain steps, the policy lets the scheduler run the
forwards until its next probe in one verification call (``hold``; at most
``SchedulerConfig.plain_steps``, as for requests with speculation off): each forward counts
toward the probe interval, and the call's tokens and seconds are one plain step's on its side,
so speculation is weighed against plain steps as fast as they run (one call a token, auto lost
0.80x-0.89x against speculation off's several a call at 32 requests: ``spin bench grid
--concurrency 32``). A probe of speculation in which the controller drafts nothing (k = 0 for
every request: the cost model prices speculation at a loss there) is a held plain step, and the
next probe comes after twice the interval (such probes ran every fourth forward as a plain step
of one forward: one call in two at 32 sampled requests). Any other step in which no request
drafts, scores or prefills is held as well, for as many forwards as the scheduler runs: a probe
of plain steps (so plain steps are measured as they run), and a step the controller gave k = 0
for every request where the guard speculates (on ``spin bench grid --split tuning
--concurrency 1 --temperatures 0.8``, 342 of 1021 steps of lone sampled requests were such
steps, one forward each at 68 tokens/s of step, where speculation off ran 4 forwards a call at
about 100 and speculating steps measured 99: auto 0.948x off; held, 0.970x against 1.020x in 4
passes side by side). Where speculation is decided, a held call's further forwards are no steps
toward the next probe of plain steps: counted so, a request alone whose held probe of plain
steps ran 4 forwards was probed plain again at once, and again, its speculating side never
measured enough to decide (greedy single streams 0.956x off, one run).

A decision changes only where the other side measures better by more than the standard error
of the two rates' difference (each a ratio of discounted sums: the delta method): no threshold
is set by hand."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .outcome import StepOutcome
from .side import Side

Decoding = Literal["greedy", "sampled", "mixed"]
StepKind = tuple[int, Decoding]
"""(batch-size bucket: bit length of the batch size, decoding of its requests)."""


@dataclass(frozen=True)
class GuardConfig:
    """How the guard measures and probes."""

    enabled: bool = True
    """Off: the policy's plan always runs (the controller's prediction alone decides); the
    steps are still measured (``rates``, the metrics)."""
    decay: float = 0.95
    """Weight of the steps before each new one (per side and kind of step): an estimate follows
    about the last 1 / (1 - decay) = 20 steps of its side."""
    min_steps: int = 4
    """Steps each side needs before the comparison decides."""
    probe_min: int = 4
    """Steps between probes of the side not in use, after a reversal (and at the start)."""
    probe_max: int = 256
    """Longest interval between probes."""
    probe_budget: float = 0.02
    """Share of the time that probing may cost: after a probe that confirmed the decision, the
    next one comes no sooner than the probe's time beyond a step of the decided side divided by
    ``probe_budget`` times that step's time (a probe of speculation in a large batch makes every
    drafter catch up with every request's context: on a 2-core CPU at batch 32 it took 0.6 s
    against 0.1 s for a plain step, so it waits 250 steps; a cheap one doubles its interval)."""

    cold_batch: int = 1
    """A new kind of step in the batch-size bucket of this many requests or a smaller one
    (``step_kind``: powers of two) starts speculating when no kind of its decoding as large or
    larger has decided; larger ones start plain (module doc)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0 or self.min_steps < 1 or self.cold_batch < 0:
            raise ValueError(f"invalid guard config {self}")
        if not 0.0 < self.probe_budget < 1.0:
            raise ValueError(f"guard probe_budget must be in (0, 1), got {self.probe_budget}")
        if not 1 <= self.probe_min <= self.probe_max:
            raise ValueError(f"guard probes need 1 <= probe_min <= probe_max, got {self}")


@dataclass
class _Kind:
    """What the guard knows of one kind of step."""

    spec: Side = field(default_factory=Side)
    off: Side = field(default_factory=Side)
    plain_pred: Side = field(default_factory=Side)
    """The speculating steps' batch sizes (one token each) and the cost model's predicted
    seconds of each at k = 0: the plain side until plain steps are measured (``saving``)."""
    speculate: bool = True
    """The decision: run the plan (True) or plain steps."""
    interval: int = 0
    """Steps between probes now."""
    since_probe: int = 0
    """Steps since the last probe."""
    drafter: str | None = None  # a request alone's: the drafter of ``spec`` (module doc)
    others: dict[str, Side] = field(default_factory=dict)  # and its other drafters' sides

    def decided(self, min_steps: int) -> bool:
        """Both sides measured enough for the comparison."""
        return min(self.spec.steps, self.off.steps) >= min_steps


class GuardedRequest(Protocol):
    """What the guard reads of a request in a step (``base.RequestView``)."""

    request_id: str
    generated: int
    greedy: bool
    mode: str


def step_kind(greedy: list[bool]) -> StepKind:
    """The kind of a micro-batch of requests with these decodings."""
    decoding: Decoding = ("greedy" if all(greedy) else "sampled" if not any(greedy)
                          else "mixed")
    return len(greedy).bit_length(), decoding


class LossGuard:
    """Per kind of step: speculate, or run plain steps (module doc)."""

    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg or GuardConfig()
        self._kinds: dict[StepKind, _Kind] = {}
        self._weighed: dict[tuple[str, ...], tuple[StepKind, bool]] = {}
        """Micro-batch (its request ids) -> the kind of step it is weighed as, and whether it
        follows a plain step of the guard's, from ``plain`` to ``weigh``."""
        self._held: set[str] = set()
        """The requests the guard's last decided step ran plain."""
        self._decided = False
        """The step ``plain`` last decided runs plain by decision (held until the next probe)."""
        self._probe: tuple[_Kind, set[str]] | None = None
        """The record and requests of the probe of speculation ``plain`` last decided."""
        self._solo: dict[str, _Kind] = {}
        """Request id -> its record when it steps alone: its own speculating side, its kind's
        plain side (the same object; module doc: one request)."""
        self.hold = 1
        """Forwards the step ``plain`` last decided may run before the guard decides again:
        where the decision is plain steps, those until its next probe (module doc: holds)."""
        self.probing = False
        """The step ``plain`` last decided speculates where the decision is plain steps: a
        probe, which the policy runs without its scoring calls (they are not speculation's
        cost; a request's scoring waits for a step that speculates by decision)."""

    def plain(self, requests: Sequence[GuardedRequest]) -> list[bool]:
        """The requests of a coming step that run plain (k = 0, no scoring): all of a step of
        requests all in mode auto whose kind measures speculation at a loss. A step without a
        prefill is decided (probes too) and weighed when it reports (``weigh``); where a
        request prefills, the decision holds and the step is not weighed."""
        self.probing, self.hold, self._probe, self._decided = False, 1, None, False
        if not all(r.mode == "auto" for r in requests):
            return [False] * len(requests)
        kind = step_kind([r.greedy for r in requests])
        rec = self._record(kind, tuple(r.request_id for r in requests))
        if any(r.generated == 0 for r in requests):
            speculate = rec.speculate
        else:
            if len(self._weighed) > 64:  # steps that never reported (a failed step): forget
                self._weighed = {}
            ids = tuple(r.request_id for r in requests)
            self._weighed[ids] = kind, any(rid in self._held for rid in ids)
            speculate = self.speculate(kind, rec)
            self.probing = speculate and not rec.speculate
            self._decided = not (speculate or rec.speculate)
            if self._decided:  # plain by decision: until the next probe
                self.hold = max(1, rec.interval - rec.since_probe)
            self._held = set() if speculate else set(ids)
            self._probe = (rec, set(ids)) if self.probing else None
        return [not speculate] * len(requests)

    def drafts_nothing(self, steady: bool = True) -> None:
        """The step ``plain`` last decided drafts nothing (the controller gave every request
        k = 0, or the guard ran it plain). A probe of speculation so is a plain step as decided,
        held until the next probe, which comes after twice the interval, as after a probe that
        confirmed plain steps; any other such step, ``steady`` (no prompt prefilled, none
        scored), is held for ``probe_max`` forwards at most (module doc: holds)."""
        if self._probe is None:
            if steady and not self._decided:
                self.hold = self.cfg.probe_max
            return
        rec, self._held = self._probe
        self.probing, self._probe = False, None
        rec.interval = min(2 * rec.interval, self.cfg.probe_max)
        self.hold = max(1, rec.interval - rec.since_probe)

    def weigh(self, outcome: StepOutcome) -> None:
        """A step ``plain`` decided has run: its tokens and seconds on its side, when every
        request in it was verified."""
        ids = tuple(r.request_id for r in outcome.requests)
        kind, after_plain = self._weighed.pop(ids, (None, False))
        if kind is None:
            self._charge_scoring(outcome)
        elif after_plain and any(r.asked for r in outcome.requests):
            # a head's transition (module doc): weighed on neither side
            k = self._record(kind, ids)
            if not k.speculate:  # a probe of speculation: one more step verifies the chain
                k.since_probe = max(k.since_probe, k.interval - 1)
        elif all(r.verified for r in outcome.requests):
            speculated = any(r.choice.drafter or r.asked for r in outcome.requests)
            rec = self._record(kind, ids)
            if outcome.forwards > 1 and not rec.speculate:  # plain by decision: each forward
                rec.since_probe += outcome.forwards - 1  # a step toward the next probe
            self.observe(kind, speculated, sum(r.emitted for r in outcome.requests),
                         outcome.step_s, ids, outcome.requests[0].choice.drafter)
            plain_s = outcome.prediction.plain_s if outcome.prediction is not None else 0.0
            if speculated and plain_s > 0:  # (NaN: no prediction of it)
                self._kind(kind).plain_pred.add(len(outcome.requests), plain_s, self.cfg.decay)

    def _charge_scoring(self, outcome: StepOutcome) -> None:
        """A step with a prefill, not weighed: the seconds its scoring calls added (measured
        beyond the predicted verification) are speculation's, charged to its kind's speculating
        side (module doc: a step with a prefill)."""
        p = outcome.prediction
        if (p is None or not p.prefill_tokens or not p.scoring_work[0] or not outcome.requests
                or not all(r.verified for r in outcome.requests)):
            return
        k = self._kinds.get(step_kind([r.greedy for r in outcome.requests]))
        if k is not None and k.speculate and math.isfinite(p.verify_s):
            k.spec.charge(max(0.0, outcome.rest_s - p.verify_s))

    def _kind(self, kind: StepKind) -> _Kind:
        """The kind's record; a new kind starts from the decision of the nearest batch size
        of its decoding, as large or larger, that both sides have measured; without one,
        plain steps above ``cold_batch`` requests (module doc: a new kind of step), always
        speculating when the guard is off."""
        k = self._kinds.get(kind)
        if k is None:
            near = sorted((b - kind[0], known.speculate)
                          for (b, decoding), known in self._kinds.items() if decoding == kind[1]
                          and b >= kind[0] and known.decided(self.cfg.min_steps))
            k = self._kinds[kind] = _Kind(speculate=near[0][1] if near else self._cold(kind),
                                          interval=self.cfg.probe_min)
        return k

    def _cold(self, kind: StepKind) -> bool:
        """The decision of a kind of step, or of a request alone, that nothing decided yet."""
        return kind[0] <= self.cfg.cold_batch.bit_length() or not self.cfg.enabled

    def _record(self, kind: StepKind, ids: tuple[str, ...]) -> _Kind:
        """What decides a step of these requests: a request's own record when it steps alone
        (made at its first such step, sharing its kind's plain side and, once that is
        measured, its probe interval, with the cold decision: ``cold_batch``), else its
        kind's."""
        if len(ids) != 1 or not self.cfg.enabled:
            return self._kind(kind)
        solo = self._solo.get(ids[0])
        if solo is None:
            shared = self._kind(kind)
            known = shared.off.steps >= self.cfg.min_steps  # no plain probes to begin with
            solo = self._solo[ids[0]] = _Kind(
                spec=shared.spec.prior(self.cfg.min_steps), off=shared.off,
                speculate=self._cold(kind),
                interval=shared.interval if known else self.cfg.probe_min)
        return solo

    def release(self, request_id: str) -> None:
        """The request ended: its own record goes."""
        self._solo.pop(request_id, None)

    def speculate(self, kind: StepKind, rec: _Kind | None = None) -> bool:
        """Whether the coming step of this kind runs the policy's plan (else plain steps): the
        decision (``rec``'s: ``_record``; None: the kind's), or the other side when a probe is
        due."""
        if not self.cfg.enabled:
            return True
        k = rec if rec is not None else self._kind(kind)
        k.since_probe += 1
        if k.since_probe < k.interval:
            return k.speculate
        k.since_probe = 0
        return not k.speculate

    def observe(self, kind: StepKind, speculated: bool, tokens: int, seconds: float,
                ids: tuple[str, ...] = (), drafter: str | None = None) -> None:
        """A step of this kind (of the requests ``ids``; a request alone's ``drafter``) gave
        ``tokens`` in ``seconds``: on its kind's sides and a request alone's (``_record``)."""
        if seconds <= 0:
            return
        kind_rec = self._kind(kind)
        (kind_rec.spec if speculated else kind_rec.off).add(tokens, seconds, self.cfg.decay)
        k = self._record(kind, ids) if ids else kind_rec
        if speculated and k is not kind_rec:
            if drafter is not None and drafter != k.drafter and k.drafter:  # its own side
                k.others[k.drafter] = k.spec
                k.spec = k.others.pop(drafter, None) or kind_rec.spec.prior(self.cfg.min_steps)
                k.speculate = k.speculate or k.spec.steps < self.cfg.min_steps  # a new one's
            k.drafter = drafter or k.drafter  # chance, as a new request's (``cold_batch``)
            k.spec.add(tokens, seconds, self.cfg.decay)
        if not self.cfg.enabled or not k.decided(self.cfg.min_steps):
            return
        # a change needs the other side better by more than the difference's standard error
        gap, noise = k.spec.rate - k.off.rate, math.sqrt(k.spec.variance + k.off.variance)
        wins = gap >= -noise if k.speculate else gap > noise
        if speculated != k.speculate:  # a probe: did it confirm the decision?
            if wins == k.speculate:
                decided = k.spec if k.speculate else k.off
                extra = seconds - decided.step_s  # what the probe cost beyond such a step
                paid = math.ceil(extra / (self.cfg.probe_budget * decided.step_s))
                k.interval = min(max(2 * k.interval, paid), self.cfg.probe_max)
            else:
                k.interval = self.cfg.probe_min
        elif wins != k.speculate:  # the side in use reversed it: probed back from probe_min
            k.interval, k.since_probe = self.cfg.probe_min, 0
        k.speculate = kind_rec.speculate = wins  # a request alone's: its kind's too (reported,
        kind_rec.interval = k.interval  # and where the next request alone starts probing)

    def saving(self, kind: StepKind, at_least: bool = False) -> float | None:
        """Seconds of step that speculating saves per emitted token in this kind of step: 1 /
        the plain rate - 1 / the speculating rate (negative where it loses), from the nearest
        batch size of its decoding whose speculating side has ``min_steps`` steps; its plain
        side measured once it has as many, until then the cost model's calibrated prediction of
        the speculating steps at k = 0 (plain steps are only probed while speculation wins, and
        that prediction came within about 10% of plain steps in serving: ``spin bench trace``).
        None before any kind of its decoding has speculated that often. What work done for
        speculation's sake (a drafter scoring a request) may cost per token it is expected to
        speed up (``ScoringRounds.priced``). ``at_least``: only from this batch size or larger
        ones (a smaller batch's saving overstates a larger one's: in one tuning grid of greedy
        requests speculating steps measured 2.37x plain ones at one request, 0.42x at 32-63)."""
        n = self.cfg.min_steps

        def plain(k: _Kind) -> Side | None:
            side = k.off if k.off.steps >= n and k.off.rate > 0 else k.plain_pred
            return side if side.rate > 0 and k.spec.steps >= n and k.spec.rate > 0 else None

        known = [(abs(b - kind[0]), -b, k, side) for (b, decoding), k in self._kinds.items()
                 if decoding == kind[1] and (b >= kind[0] or not at_least)
                 and (side := plain(k)) is not None]
        if not known:
            return None
        _, _, k, side = min(known, key=lambda t: t[:2])
        return 1.0 / side.rate - 1.0 / k.spec.rate

    def rates(self) -> dict[StepKind, tuple[float, float, bool]]:
        """Per kind of step: (tokens/s speculating, tokens/s plain, the decision): metrics."""
        return {kind: (k.spec.rate, k.off.rate, k.speculate)
                for kind, k in sorted(self._kinds.items())}
