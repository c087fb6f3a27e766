"""Which draft model fits a request, from how well each predicts its prompt.

At a request's first step every model drafter prefills the prompt anyway (to draft or score it
later); counting how many prompt tokens each predicts (greedy, from the tokens before them) costs
nothing more. That agreement is not the drafter's acceptance rate on the output (the prompt is the
user's text, not the target's), but it *ranks* the drafters well. ``spin bench fit`` on the demo
family's 144 held-out prompts: the drafter that predicts the prompt best was the best on the
target's output (64 tokens) for 115 of them (mean acceptance lost to the best: 0.028), against 72
(0.128) for agreement on the first 5 output tokens, which is what scoring the output early sees.

The drafters are ranked by what each is expected to deliver on the request's output: its record
(how it did on the earlier requests it fitted, ``acceptance``) less ``deficit_weight`` times how
far its prompt agreement falls behind the best one's, turned into goodput by ``value`` (the
learned policy's cost model: tokens per second at the best k). A general model often predicts a
prompt about as well as the specialist but accepts less on the output, at several times the
cost. On ``spin bench fit``'s 144 prompts, a drafter's output acceptance falls 3.3 points per
point of prompt agreement it is behind the best-fitting one (least squares through the origin,
the 202 drafters less than 0.15 behind); hence the weight of 3. ``spin bench fit`` replays the
144 prompts with the record built as they go and the cost model of ``spin profile --quick``;
goodput lost to the output's best drafter (one request alone, best k), mean over 20 shuffled
orders: 1.6% (worst order 1.9%), 0.8% (1.1%) with runner-up rounds, where the rule before
(record only for drafters within 0.02 of the best agreement, agreement otherwise, no cost) lost
4.4% (4.9%) and 2.5% (3.1%); in its one order, acceptance lost 0.010 against 0.018.

So a request's candidates narrow to its best-fitting model drafter (and any within ``margin`` of
its agreement) plus prompt lookup, and each starts from what it achieved on the *earlier*
requests it fitted (``acceptance``: accepted and rejected draft tokens of their steps and output
scores, in this router, kept apart for greedy and sampling requests as the population is: a
sampled draft is accepted less, ``population.population_name``), not from its population rate
over all requests (same run: 0.84, 0.85 and 0.88 for the code, prose and structured drafters
on the requests they fit best, against 0.60, 0.53 and 0.31 on all); a drafter without such a
record yet starts from all drafters' record together (``pooled_acceptance``).

A drafter that fitted none of the last ``prune_after`` requests whose prompt it scored scores
only every ``explore_every``-th prompt (``worth_scoring``): scoring is a prefill beside the
target's, on the same cores. Replayed as ``spin bench fit`` does (its 144 prompts; shuffled
orders 0, 1 and 2 of ``_with_record``), 16 and 4 leave 3.33-3.40 scorers per prompt instead of 4
(the general model sits out most) at the same goodput lost (1.17-1.34%). 8 left 3.06-3.26 but
lost 2.4-5.0%: a specialist can miss 8 requests of a mixed workload in a row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .population import SAMPLED_SUFFIX, population_name


@dataclass
class PromptFit:
    """Per request: the model drafters' prompt agreement; per drafter: how its fitted requests
    went. Not thread-safe (the router's scheduler calls the policy from one event loop)."""

    min_trials: float = 8.0
    """Draft tokens of fitted requests before ``acceptance`` answers (else None)."""
    margin: float = 0.0
    """Drafters whose prompt agreement is within this of the best-fitting one's are candidates
    too."""
    rank_margin: float = 1.0
    """Only drafters whose prompt agreement is within this of the best's are ranked (the
    others never fit best); 1 = all."""
    deficit_weight: float = 3.0
    """Acceptance a drafter is expected to lose on the output per unit of prompt agreement it is
    behind the best one's (module doc); 0 = rank by record alone."""
    value: Callable[[str, str, float], float] | None = None
    """(request id, drafter, expected acceptance) -> what ranks the drafters: the goodput the
    learned policy's cost model predicts; None = the expected acceptance itself."""
    prune_after: int = 16
    """A drafter that fitted none of the last this many requests whose prompt it scored
    scores only every ``explore_every``-th prompt (``worth_scoring``); 0 = all score always."""
    explore_every: int = 4
    """How often such a drafter scores a prompt anyway (its record stays current)."""
    _agreement: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)
    """request id -> drafter -> fraction of the scored prompt tokens it predicted"""
    _wins: dict[str, deque[bool]] = field(default_factory=dict, repr=False)
    """drafter -> whether it fitted each of the last ``prune_after`` requests it scored"""
    _prompts: int = field(default=0, repr=False)
    """Prompts ``worth_scoring`` has chosen scorers for."""
    _fitting: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    """request id -> ``fitting``, recomputed as prompt scores arrive"""
    _trials: dict[str, list[float]] = field(default_factory=dict, repr=False)
    """``population_name`` (drafter and decoding) -> [accepted, rejected] draft tokens on the
    requests it fitted"""
    _sampled: set[str] = field(default_factory=set, repr=False)
    """Requests opened as sampling ones (``begin``)."""

    def begin(self, request_id: str, greedy: bool) -> None:
        """``request_id`` decodes greedily or samples: which record its drafters are ranked and
        seeded by, and which its steps add to (one never opened counts as greedy)."""
        if greedy:
            self._sampled.discard(request_id)
        else:
            self._sampled.add(request_id)

    def _name(self, drafter: str, request_id: str) -> str:
        return population_name(drafter, request_id not in self._sampled)

    def worth_scoring(self, drafters: Iterable[str]) -> tuple[str, ...]:
        """Which of ``drafters`` score the next request's prompt: all but those that fitted
        none of the last ``prune_after`` requests they scored, which score every
        ``explore_every``-th prompt only; all when fewer than two would be left. Each scorer
        prefills the prompt beside the target's prefill, and a drafter that never fits costs
        that time on every request (a general model among specialists; with runner-up rounds
        on, its near misses make it a runner-up too, whose rounds cost more)."""
        names = sorted(drafters)
        if not self.prune_after:
            return tuple(names)
        self._prompts += 1
        if self.explore_every and self._prompts % self.explore_every == 0:
            return tuple(names)
        kept = [n for n in names if not self._losing(n)]
        return tuple(kept if len(kept) >= 2 else names)

    def _losing(self, drafter: str) -> bool:
        wins = self._wins.get(drafter)
        return wins is not None and len(wins) == self.prune_after and not any(wins)

    def observe_prompt(self, request_id: str, drafter: str, matches: int, positions: int) -> None:
        """``drafter`` predicted ``matches`` of the request's last ``positions`` prompt tokens."""
        if positions <= 0:
            return
        agreement = self._agreement.setdefault(request_id, {})
        agreement[drafter] = matches / positions
        if len(agreement) >= 2:
            top = max(agreement.values())
            best = max((n for n, a in agreement.items() if a >= top - self.rank_margin),
                       key=lambda n: (self._expected(request_id, n, top - agreement[n]),
                                      agreement[n], n))
            self._fitting[request_id] = (best, *(
                name for a, name in sorted(((a, n) for n, a in agreement.items()), reverse=True)
                if name != best and abs(a - agreement[best]) <= self.margin))

    def _expected(self, request_id: str, drafter: str, deficit: float) -> float:
        """What ``drafter`` is expected to deliver on the request: its record (1 without enough
        of one, so that it gets one) less ``deficit_weight`` x its prompt agreement ``deficit``,
        through ``value``."""
        rate = self.acceptance(drafter, request_id)
        rate = min(1.0, max(0.0, (1.0 if rate is None else rate) - self.deficit_weight * deficit))
        return rate if self.value is None else self.value(request_id, drafter, rate)

    def fitting(self, request_id: str) -> tuple[str, ...]:
        """The request's best-fitting model drafters, best first: the best by expected goodput
        (``_expected``) among those within ``rank_margin`` of the best agreement, then by
        agreement those within ``margin`` of its agreement; () until two or more have scored its
        prompt."""
        return self._fitting.get(request_id, ())

    def record(self, request_id: str, drafter: str, accepted: float, rejected: float) -> None:
        """Draft tokens of ``drafter`` on the request (a step's, or an output score's); counted
        for the drafter when it fits the request best (``fitting``)."""
        if drafter in self.fitting(request_id):
            t = self._trials.setdefault(self._name(drafter, request_id), [0.0, 0.0])
            t[0] += max(0.0, accepted)
            t[1] += max(0.0, rejected)

    def acceptance(self, drafter: str, request_id: str = "") -> float | None:
        """Acceptance rate of ``drafter`` on the requests of ``request_id``'s decoding it
        fitted (None: too few yet)."""
        return self._rate(*self._trials.get(self._name(drafter, request_id), (0.0, 0.0)))

    def pooled_acceptance(self, request_id: str = "") -> float | None:
        """Acceptance rate of all drafters together on the requests of ``request_id``'s decoding
        each fitted (None: too few yet): what a drafter without a record of its own is expected
        to accept on a request it fits. Its population rate is no such estimate: a specialist's
        is mostly the requests of other kinds (on the demo family the structured drafter's is
        about 0.3, against 0.88 on the requests it fits)."""
        own = [t for name, t in self._trials.items()
               if name.endswith(SAMPLED_SUFFIX) == (request_id in self._sampled)]
        return self._rate(sum(t[0] for t in own), sum(t[1] for t in own))

    def _rate(self, accepted: float, rejected: float) -> float | None:
        total = accepted + rejected
        return accepted / total if total >= self.min_trials else None

    def release(self, request_id: str) -> None:
        """Forget the request; each drafter that scored its prompt records whether it fitted
        it best in the end (``worth_scoring``)."""
        agreement = self._agreement.pop(request_id, {})
        fitting = self._fitting.pop(request_id, ())
        self._sampled.discard(request_id)
        if fitting and self.prune_after:
            for name in agreement:
                wins = self._wins.setdefault(name, deque(maxlen=self.prune_after))
                wins.append(name == fitting[0])
