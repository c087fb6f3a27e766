"""The cost model reaches every router: a verifier times its own forwards at start and reports
them in its model info, and a router configured as the Helm chart configures it (no cost model
file, no profile step) fits its goodput controller from them. Two processes, router and
verifier: the router's choices are the fitted model's, a longer k for a lone request than any
the model gives when 64 requests saturate the verifier, or a shorter one where the model says
so (prompt lookup, whose drafts cost nothing, at an acceptance rate the fitted model prices
differently alone and under load)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from pathlib import Path

import grpc
import pytest
from service_helpers import request

from spin.policy.goodput import ControllerConfig, SpecLengthController
from spin.router.cost import ReplicaCosts
from spin.supervisor import Child
from spin.v1 import generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

PROMPT = "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n    return"
RATES = (0.05, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8)
# OpenMP threads that sleep soon after a forward, as `spin serve` runs its services: threads
# that spin keep another process's forward off the cores, and the start-up times with them
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="10000")


def _spin(*args: str) -> list[str]:
    return [sys.executable, "-m", "spin", *args]


def _steps(endpoint: str, n: int) -> list:
    """The streamed steps of ``n`` concurrent requests naming prompt lookup without a k, but
    those that prefilled a request: the verifier prefills the requests admitted in a step, which
    the model prices (the prompts' tokens make the step longer whatever k is, so speculation may
    pay there). A request's own first step prefills it; a later step that prefilled newcomers is
    one whose batch grew (on a busy machine the requests arrive over several steps)."""
    def one(_: int) -> list:
        with grpc.insecure_channel(endpoint) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return [m.step for m in stub.Generate(
                request(PROMPT, max_tokens=24, mode="drafter", drafter="prompt-lookup",
                        ignore_eos=True), timeout=300)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return [s for steps in pool.map(one, range(n))
                for prev, s in zip(steps[1:], steps[2:]) if s.batch_size <= prev.batch_size]


def test_a_router_plans_with_the_model_its_verifier_reports(family_dir: Path,
                                                            tmp_path: Path) -> None:
    verifier = Child("verifier", _spin("verifier", "--model", str(family_dir / "target"),
                                       "--port", "0", "--threads", "2"), tmp_path, ENV)
    router = None
    try:
        verifier.wait_ready(300)
        with grpc.insecure_channel(f"127.0.0.1:{verifier.port}") as ch:
            info = verifier_pb2_grpc.VerifierStub(ch).GetVerifierInfo(
                verifier_pb2.GetVerifierInfoRequest(), timeout=30).info
        assert len(info.step_times) >= 12  # the grid's points that fit the cache
        costs = ReplicaCosts(None, 0.0015)  # the router's fit, round trips as it adds them
        costs.verifier(info)
        cost = costs.model()

        def k(rate: float, batch: int, context: int = 60) -> int:
            c = SpecLengthController(cost, ControllerConfig(prior_acceptance=rate,
                                                            min_observations=10 ** 6))
            return max(c.choose([(f"r{i}", "prompt-lookup", context) for i in range(batch)]))

        def lone_ks(rate: float) -> set[int]:
            """The k the model gives a lone request at any context it reaches."""
            return {k(rate, 1, c) for c in range(25, 61, 5)}

        def busy_ks(rate: float) -> set[int]:
            """The k the model gives any batch of 16..64 requests at any context they reach
            (measured step times are noisy on a busy machine: the fitted model need not be
            monotone in the batch size, so no batch size is taken for another)."""
            return {k(rate, b, c) for b in range(16, 65) for c in (25, 40, 55)}

        # a rate at which the model drafts differently for a lone request than under load. On
        # an idle machine a lone request drafts longer: it pays a forward over several rows to
        # speculate at all (the cost model's c5), 16 or more pay it anyway. Measured beside
        # busy processes, a forward over several rows may cost the lone request four times one
        # row (its OpenMP team waits for the cores), and it drafts less than a batch.
        tables: dict[float, tuple[set[int], set[int]]] = {}
        for rate in RATES:
            lone, busy_range = tables[rate] = lone_ks(rate), busy_ks(rate)
            if min(lone) > max(busy_range) or max(lone) < min(busy_range):
                break
        else:
            pytest.fail(f"no rate at which the model drafts apart alone and busy: {tables}")
        # as the chart runs it: learned policy, no --cost-model; the acceptance pinned to `rate`,
        # no k = 1 probes and no online calibration, so that its choices are the fitted model's
        config = {"probe_every": 10 ** 6, "controller": {
            "prior_acceptance": rate, "min_observations": 10 ** 6, "calibration": 0.0}}
        router = Child("router", _spin(
            "router", "--verifier", f"127.0.0.1:{verifier.port}", "--tokenizer",
            str(family_dir / "target"), "--port", "0", "--policy", "learned", "--max-batch",
            "64", "--policy-config", json.dumps(config)), tmp_path, ENV)
        router.wait_ready(120)
        endpoint = f"127.0.0.1:{router.port}"
        # a cost model is in use: every step predicted, but the calls of held plain steps
        # (several forwards a call, ``StepPlan.hold``; a request finishing in one may have run
        # one), which nothing calibrates on: a call's steps share its time
        alone = _steps(endpoint, 1)
        assert all(s.predicted_step_seconds > 0 for s in alone if s.forwards == 1)
        busy = [s for s in _steps(endpoint, 64) if s.batch_size >= 16]
        held = {s.step_seconds for s in busy if s.forwards > 1}
        assert len(busy) > 64 and all(s.predicted_step_seconds > 0 for s in busy
                                      if s.step_seconds not in held)
        if min(lone) > max(busy_range):  # longer alone
            assert any(s.k > max(busy_range) and s.batch_size == 1 for s in alone)
            assert all(s.k <= max(busy_range) for s in busy), ({s.k for s in busy}, tables)
        else:  # longer under load
            assert all(s.k <= max(lone) for s in alone), ({s.k for s in alone}, tables)
            assert any(s.k > max(lone) for s in busy), ({s.k for s in busy}, tables)
    finally:
        for c in (router, verifier):
            if c is not None:
                c.stop(30)
    log = (tmp_path / "router.log").read_text()
    assert "cost model fitted on the replicas' step times" in log
