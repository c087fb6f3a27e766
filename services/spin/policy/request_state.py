"""What the learned policy (``learned.py``) keeps about one running request between its steps.

One ``RequestState`` per request: created when the policy first sees the request (its first
``choose``, or a report about it) and dropped at its ``release``. What the policy's components
learn per request stays in them: the bandit's posteriors (``selector.py``), the acceptance
estimates (``acceptance.py``), the prompt agreement (``prompt_fit.py``) and the early-stopping
chains' caps (``chain_length.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestState:
    """The learned policy's own state of one request (module doc)."""

    idle: int = 0
    """Steps in a row at k = 0; the request probes with k = 1 after ``probe_every`` of them."""
    chosen: str | None = None
    """The bandit's drafter in the step being verified (mode auto only): ``observe`` rewards it
    with one token when the step drafted nothing."""
    prefill: bool = False
    """The step being verified prefills the target (the request's first): no drafter's measure,
    so no bandit reward."""
    ctx: int = 0
    """Context length at the request's last step (what an output score's prior is predicted
    at)."""
    scored: int = 0
    """Output scoring rounds so far; 0 = none yet, so a score is of the prompt."""
    fitted: bool = False
    """The request's best-fitting drafters have been seeded from the earlier requests they
    fitted."""
    agreement: dict[str, list[float]] = field(default_factory=dict)
    """drafter -> [matches, positions] of its output scores over the rounds, each round weighing
    ``1 - controller.ema`` of the next."""
    fed: dict[str, int] = field(default_factory=dict)
    """model drafter -> context length it was last fed (drafting or scoring)."""
