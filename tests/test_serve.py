"""``spin serve`` as a deployment: a drafter process dies mid-stream, the router drains on SIGTERM.

These tests break their own embedded deployment (one drafter, no Redis), apart from the shared one.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from service_helpers import collect, request

from spin.router.config import RouterConfig, SchedulerConfig
from spin.serve import Embedded, ServeConfig
from spin.v1 import generation_pb2, generation_pb2_grpc

PROMPT = "class Config:\n    def __init__(self, path):\n"


@pytest.fixture()
def small(tmp_path: Path):
    emb = Embedded(ServeConfig(port=0, drafters=["draft-code"], redis=False, log_dir=tmp_path))
    emb.start()
    yield emb
    emb.stop()


def test_killing_a_drafter_fails_no_request(small) -> None:
    reference, _, _ = collect(small.endpoint, request(PROMPT, max_tokens=160, mode="off",
                                                      ignore_eos=True))
    drafter = small.child("drafter", "draft-code")
    first_tokens = concurrent.futures.Future()

    def stream(i: int) -> tuple[list[int], generation_pb2.GenerateResponse]:
        with grpc.insecure_channel(small.endpoint) as ch:
            ids, last = [], None
            for msg in generation_pb2_grpc.GenerationStub(ch).Generate(
                    request(PROMPT, max_tokens=160, mode="drafter", drafter="draft-code", k=2,
                            ignore_eos=True), timeout=300):
                ids += msg.token_ids
                last = msg
                if ids and not first_tokens.done():
                    first_tokens.set_result(True)
            return ids, last

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        first_tokens.result(timeout=120)
        drafter.proc.send_signal(signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    assert drafter.proc.wait(10) == -signal.SIGKILL
    for ids, last in results:
        assert ids == reference  # still lossless
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        # the drafter served the first steps, then the requests went on without it
        assert 0 < last.speculation.drafters[0].steps < last.speculation.steps
        assert last.speculation.steps_without_speculation > 0


def test_sigterm_drains_in_flight_requests(small) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(collect, small.endpoint, request(PROMPT, max_tokens=120, mode="off",
                                                           ignore_eos=True))
        time.sleep(0.5)
        small.router.proc.send_signal(signal.SIGTERM)
        ids, _, last = fut.result(timeout=120)
    assert len(ids) == 120 and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert small.router.proc.wait(30) == 0
    with pytest.raises(grpc.RpcError) as err:  # and it accepts nothing new
        collect(small.endpoint, request(PROMPT, max_tokens=5), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_spin_serve_prints_the_endpoint_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "spin", "serve", "--port", "0", "--drafters",
                             "draft-structured", "--no-redis"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        endpoint = None
        for line in proc.stdout:
            if line.startswith("SPIN serving on "):
                endpoint = line.split()[3]
                break
        assert endpoint, "spin serve never printed its endpoint"
        ids, _, last = collect(endpoint, request(PROMPT, max_tokens=6, mode="drafter",
                                                 drafter="draft-structured", k=2))
        assert len(ids) == last.usage.completion_tokens > 0
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "stopping" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="splitting cores needs 2")
def test_split_cores_pin_each_service_and_pipeline_losslessly(tmp_path: Path) -> None:
    """``cpus="split"``: the verifier on cores of its own with one torch thread each, the drafter
    and router on the others; two micro-batches over it give the target's own output."""
    from spin.cpus import available_cpus, split

    side, own = split(available_cpus())
    router = RouterConfig(policy="fixed", default_drafter="draft-code",
                          scheduler=SchedulerConfig(micro_batches=2))
    with Embedded(ServeConfig(port=0, drafters=["draft-code"], redis=False, log_dir=tmp_path,
                              router=router, cpus="split")) as emb:
        placed = {c.role: sorted(os.sched_getaffinity(c.proc.pid)) for c in emb.children}
        assert placed == {"verifier": own, "drafter-draft-code": side, "router": side}
        assert f"--threads {len(own)} " in " ".join(emb.child("verifier", "verifier").proc.args)
        prompts = [PROMPT, "import os\nimport sys\n\n", "def main():\n", "class A:\n    x = 1\n"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            spec = list(pool.map(lambda p: collect(emb.endpoint, request(
                p, max_tokens=32, mode="drafter", drafter="draft-code", k=3, ignore_eos=True))[0],
                prompts))
        off = [collect(emb.endpoint, request(p, max_tokens=32, mode="off", ignore_eos=True))[0]
               for p in prompts]
        assert spec == off


def test_the_family_head_is_served_unless_the_target_is_ones_own(tmp_path) -> None:
    from spin.serve import ServeConfig, head_argv, served_heads

    family = ServeConfig()
    assert "eagle" in served_heads(family) and head_argv(family)[0] == "--head"
    assert served_heads(ServeConfig(target=str(tmp_path))) == {}  # heads fit their own target
    assert served_heads(ServeConfig(heads={})) == {} and head_argv(ServeConfig(heads={})) == []
    mine = ServeConfig(target=str(tmp_path), heads={"h": "/opt/h"})
    assert head_argv(mine) == ["--head", "h=/opt/h"]


def test_colocated_drafters_run_in_the_verifier_losslessly(tmp_path: Path) -> None:
    """``colocate``: the drafter loads inside the verifier (no process of its own), the router
    drafts with it as with a head, and the output is the target's own."""
    router = RouterConfig(policy="fixed", default_drafter="draft-code", default_k=4)
    with Embedded(ServeConfig(port=0, drafters=["draft-code", "draft-prose"], heads={},
                              colocate=("draft-code",), redis=False, log_dir=tmp_path,
                              router=router)) as emb:
        assert sorted(c.role for c in emb.children) == ["drafter-draft-prose", "router",
                                                        "verifier"]
        assert "--colocate draft-code=" in " ".join(emb.child("verifier", "verifier").proc.args)
        prompts = [PROMPT, "import os\nimport sys\n\n", "def main():\n"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            spec = list(pool.map(lambda p: collect(emb.endpoint, request(
                p, max_tokens=32, mode="drafter", drafter="draft-code", k=4,
                ignore_eos=True)), prompts))
        off = [collect(emb.endpoint, request(p, max_tokens=32, mode="off", ignore_eos=True))[0]
               for p in prompts]
        assert [ids for ids, _, _ in spec] == off
        used = [d for _, _, last in spec for d in last.speculation.drafters]
        assert {d.drafter for d in used} == {"draft-code"} and sum(d.accepted_tokens for d in used) > 0


def test_colocate_names_drafters_that_are_served() -> None:
    from spin.serve import colocated_names

    both = ServeConfig(drafters=["draft-code", "draft-prose"])
    assert colocated_names(both) == []
    assert colocated_names(ServeConfig(drafters=["draft-code"], colocate=("all",))) == [
        "draft-code"]
    with pytest.raises(ValueError, match="--colocate draft-x: not a draft model served here "
                                         r"\(draft-code, draft-prose\)"):
        colocated_names(ServeConfig(drafters=["draft-code", "draft-prose"],
                                    colocate=("draft-x",)))
    with pytest.raises(ValueError, match="--colocate draft-x"):  # before any child starts
        Embedded(ServeConfig(drafters=["draft-code"], colocate=("draft-x",))).start()


def test_stop_drains_the_routers_first_then_stops_the_services_at_once() -> None:
    """The routers stop one by one (their requests drain); then every service is asked to stop
    before any is waited for, so their exits overlap (a demo deployment stopped in 5.7 s
    against 10.0 s one service after another, on an idle 2-core CPU)."""
    calls: list[tuple[str, str]] = []

    class FakeChild:
        def __init__(self, role: str) -> None:
            self.role = role

        def terminate(self) -> None:
            calls.append(("terminate", self.role))

        def stop(self, grace_s: float) -> None:
            calls.append(("stop", self.role))

    emb = Embedded(ServeConfig(port=0))
    emb.children = [FakeChild(r) for r in ("verifier", "drafter-a", "router", "drafter-b",
                                           "router-share-b")]
    emb.stop()
    assert calls[:2] == [("stop", "router"), ("stop", "router-share-b")]
    services = ["verifier", "drafter-a", "drafter-b"]
    assert calls[2:] == [("terminate", r) for r in services] + [("stop", r) for r in services]
    assert emb.children == []
