"""The cost model a router's policy plans with: fitted from the step times its replicas report.

Every verifier and drafter times its own steps at start (``rpc/step_times.py``) and reports them
in its model info. The router fits ``policy.cost_model.CostModel`` on what the verifier and each
drafter reported, again whenever a drafter joins (discovery), and hands the model to the policy.
A ``--cost-model`` file (``spin profile``) is used instead when given. Either way the model
describes bare compute; the router adds its round trip to each call's constant (``rpc_overhead_s``)
and the learned policy calibrates the model on served steps from there (``policy/calibration.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ..timing.cost_model import CostModel, DraftSample, VerifySample
from ..rpc.step_times import draft_from_proto, verify_from_proto

log = logging.getLogger(__name__)


class ReplicaCosts:
    """Step times reported by the replicas, and the model fitted on them."""

    def __init__(self, file: str | None, rpc_overhead_s: float,
                 on_model: Callable[[CostModel], None] | None = None) -> None:
        self.file = file if file and Path(file).exists() else None
        """A cost model file to use instead of the replicas' reports."""
        if file and self.file is None:
            log.warning("no cost model at %s: fitting one from the replicas' step times", file)
        self.rpc_overhead_s = rpc_overhead_s
        self.on_model = on_model
        """Called with every new model (the policy's ``set_cost_model``)."""
        self.verify: list[VerifySample] = []
        self.drafts: dict[str, list[DraftSample]] = {}
        self.in_verifier: set[str] = set()
        """The verifier's draft heads (their drafts cost no round trip)."""

    def _samples(self) -> list[DraftSample]:
        return [s for ss in self.drafts.values() for s in ss]

    def model(self) -> CostModel | None:
        """The model now, round trips included: the file's, or one fitted on the reports (None
        before the verifier reported step times)."""
        if self.file is not None:
            cost = CostModel.load(self.file)
        elif self.verify:
            cost = CostModel.fit(self.verify, self._samples())
        else:
            return None
        rpc = self.rpc_overhead_s
        cost.verify = (cost.verify[0] + rpc, *cost.verify[1:])
        cost.draft = {d: (c[0] + (0.0 if d in self.in_verifier else rpc), *c[1:])
                      for d, c in cost.draft.items()}
        return cost

    def verifier(self, info) -> None:
        """The verifier's model info (``ModelInfo``)."""
        self.verify = verify_from_proto(info)
        for h in info.head_step_times:  # drafters inside the verifier: no round trip of their own
            self.drafts[h.head] = draft_from_proto(h.head, h)
            self.in_verifier.add(h.head)
        self._refit(f"the verifier's {len(self.verify)} forwards")

    def drafter(self, name: str, info) -> None:
        """A drafter's model info, once the router accepted the drafter."""
        self.drafts[name] = draft_from_proto(name, info)
        self._refit(f"{name}'s {len(self.drafts[name])} draft calls")

    def fit_error(self) -> dict[str, float]:
        """The fit's error (MAPE) on the reported step times, per part; {} before the
        verifier reported any."""
        if not self.verify:
            return {}
        return CostModel.fit(self.verify, self._samples()).mape(self.verify, self._samples())

    def _refit(self, what: str) -> None:
        if self.file is not None or not self.verify:
            if self.file is None:
                log.warning("the verifier reported no step times: k comes from the batch-size "
                            "table (give --cost-model, or let the verifier measure them)")
            return
        errors = self.fit_error()
        log.info("cost model fitted on the replicas' step times (with %s): fit error %s", what,
                 ", ".join(f"{k} {100 * v:.1f}%" for k, v in errors.items()))
        if self.on_model is not None:
            self.on_model(self.model())
