"""The fault suite: a real ``spin serve`` (the CLI, in a process of its own) broken under load.

Each fault test runs 64 concurrent greedy requests (speculation auto), kills one process when
a quarter of their tokens have streamed, and checks that every request completes with the
output of speculation off (computed first, on the same deployment), and that the killed
process is back (a new pid, serving: the next test's load goes through it). Then: a thousand
streams cancelled mid-way leave no request held anywhere; a load past the queue is refused with
RESOURCE_EXHAUSTED and the rest served; and ``kill -9`` of ``spin serve`` leaves no process of
it behind. Run with ``-s`` to see the figures each test prints.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from service_helpers import request, scrape

from loadgen.workload import build_workload
from spin.v1 import generation_pb2_grpc

REQUESTS = 64
NEW_TOKENS = 48
DRAFTERS = ("draft-code", "draft-prose")
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="the parent-death signal is Linux's"),
              pytest.mark.timing]  # restarts and stops within deadlines: `make test-busy`


@dataclass
class Served:
    """A running ``spin serve`` and what it printed."""

    proc: subprocess.Popen
    endpoint: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    """role -> pid (updated from the restart lines)"""
    metrics: dict[str, int] = field(default_factory=dict)
    """role -> metrics port"""
    events: list[str] = field(default_factory=list)
    """What it printed to stderr."""

    def watch(self) -> None:
        for line in self.proc.stderr:
            self.events.append(line.rstrip())
            if m := re.match(r"(\S+) restarted \(pid (\d+)", line):
                self.pids[m.group(1)] = int(m.group(2))

    def restarted(self, role: str, old_pid: int, timeout_s: float = 60.0) -> int:
        """The new pid of ``role`` once it was restarted."""
        end = time.monotonic() + timeout_s
        while self.pids.get(role) == old_pid:
            assert self.proc.poll() is None, "\n".join(self.events[-20:])
            assert time.monotonic() < end, f"{role} not restarted: " + "\n".join(self.events[-20:])
            time.sleep(0.1)
        return self.pids[role]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("serve")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spin", "serve", "--port", "0", "--log-dir", str(log_dir),
         "--drafters", ",".join(DRAFTERS), "--verifier-outage", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    s = Served(proc)
    try:
        for line in proc.stdout:
            if m := re.match(r"SPIN serving on (\S+)", line):
                s.endpoint = m.group(1)
            elif m := re.match(r"\s+(\S+)\s+127\.0\.0\.1:\d+\s+(?:metrics :(\d+)\s+)?pid (\d+)",
                               line):
                s.pids[m.group(1)] = int(m.group(3))
                if m.group(2):
                    s.metrics[m.group(1)] = int(m.group(2))
            elif line.startswith("try:"):
                break
        assert s.endpoint and "verifier" in s.pids, proc.stderr.read()
        threading.Thread(target=s.watch, daemon=True).start()
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


PROMPTS = [r.prompt for r in build_workload(REQUESTS, seed=7)]


async def _load(endpoint: str, mode: str, on_tokens=None, max_tokens: int = NEW_TOKENS
                ) -> list[list[int] | grpc.StatusCode]:
    """Every prompt at once: each request's tokens, or the status it failed with."""
    streamed = 0

    async def one(stub, prompt: str) -> list[int] | grpc.StatusCode:
        nonlocal streamed
        ids: list[int] = []
        try:
            async for msg in stub.Generate(request(prompt, max_tokens=max_tokens, mode=mode,
                                                   ignore_eos=True), timeout=300):
                ids += msg.token_ids
                streamed += len(msg.token_ids)
                if on_tokens is not None:
                    on_tokens(streamed)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return ids

    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return await asyncio.gather(*(one(stub, p) for p in PROMPTS))


@pytest.fixture(scope="module")
def reference(served: Served) -> list[list[int]]:
    outputs = asyncio.run(_load(served.endpoint, "off"))
    assert all(isinstance(o, list) and len(o) == NEW_TOKENS for o in outputs), outputs
    return outputs


def _kill_under_load(served: Served, reference: list[list[int]], role: str) -> None:
    old = served.pids[role]
    killed: list[float] = []

    def on_tokens(streamed: int) -> None:
        if not killed and streamed >= REQUESTS * NEW_TOKENS // 4:
            os.kill(old, signal.SIGKILL)
            killed.append(time.monotonic())

    t0 = time.monotonic()
    outputs = asyncio.run(_load(served.endpoint, "auto", on_tokens))
    wall = time.monotonic() - t0
    assert killed, "the load finished before the kill"
    new = served.restarted(role, old)
    failed = [o for o in outputs if not isinstance(o, list)]
    mismatches = sum(o != ref for o, ref in zip(outputs, reference) if isinstance(o, list))
    print(f"\nkill -9 {role} under {REQUESTS} concurrent requests: {len(failed)} failed "
          f"{sorted({str(f) for f in failed})}, {mismatches} lossless mismatches, load "
          f"{wall:.1f} s, {role} back as pid {new}")
    assert failed == []
    assert mismatches == 0
    os.kill(new, 0)  # alive


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_killing_a_drafter_fails_nothing(served: Served, reference: list[list[int]],
                                         drafter: str) -> None:
    _kill_under_load(served, reference, f"drafter-{drafter}")


def test_killing_the_verifier_fails_nothing(served: Served, reference: list[list[int]]) -> None:
    _kill_under_load(served, reference, "verifier")


def test_killing_redis_fails_nothing_and_keeps_the_statistics(
        served: Served, reference: list[list[int]]) -> None:
    router = served.metrics["router"]
    _kill_under_load(served, reference, "redis-server")
    before = scrape(router).get("spin:stats_store_errors_total", 0.0)
    # the restarted redis-server answers the router again (its statistics flushed)
    asyncio.run(_load(served.endpoint, "auto", max_tokens=8))
    time.sleep(1.5)
    assert scrape(router).get("spin:stats_store_errors_total", 0.0) == before
    assert scrape(router).get("spin:stats_steps_lost_total", 0.0) == 0.0


def _held(served: Served) -> dict[str, float]:
    """Requests held anywhere: the router's running and waiting ones, each service's sequences
    and KV cache use."""
    out = {}
    for role, port in served.metrics.items():
        samples = scrape(port)
        for name, value in samples.items():
            if name.startswith(("spin:service_sequences", "spin:kv_cache_usage_perc",
                                "spin:num_requests_running", "spin:num_requests_waiting")):
                out[f"{role} {name}"] = value
    return out


def test_a_thousand_cancellations_leave_nothing_held(served: Served) -> None:
    async def cancel_after_first(stub, prompt: str) -> bool:
        call = stub.Generate(request(prompt, max_tokens=200, ignore_eos=True), timeout=120)
        async for _ in call:
            call.cancel()
            return True
        return False

    async def run() -> int:
        async with grpc.aio.insecure_channel(served.endpoint) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            done = 0
            for start in range(0, 1000, 100):
                results = await asyncio.gather(
                    *(cancel_after_first(stub, PROMPTS[i % len(PROMPTS)])
                      for i in range(start, start + 100)), return_exceptions=True)
                done += sum(r is True for r in results)
            return done

    t0 = time.monotonic()
    cancelled = asyncio.run(run())
    end = time.monotonic() + 30
    while (held := {k: v for k, v in _held(served).items() if v}) and time.monotonic() < end:
        time.sleep(0.5)
    print(f"\n{cancelled} of 1000 streams cancelled after their first message in "
          f"{time.monotonic() - t0:.1f} s; held afterwards: {held or 'nothing'}")
    assert cancelled == 1000
    assert held == {}
    services = {k for k in _held(served) if "service_sequences" in k}
    assert len(services) == 1 + len(DRAFTERS)  # every service reported (and holds none)


def test_overload_is_refused_and_the_rest_served(served: Served) -> None:
    async def run() -> list[grpc.StatusCode]:
        async def one(stub, i: int) -> grpc.StatusCode:
            try:
                async for _ in stub.Generate(request(PROMPTS[i % len(PROMPTS)], max_tokens=6,
                                                     ignore_eos=True), timeout=300):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        async with grpc.aio.insecure_channel(served.endpoint) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(one(stub, i) for i in range(600)))

    codes = asyncio.run(run())
    counts = {c.name: codes.count(c) for c in set(codes)}
    print(f"\n600 requests at once (batch 32, queue 256): {counts}")
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert counts.get("RESOURCE_EXHAUSTED", 0) > 0 and counts.get("OK", 0) >= 256


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kill_9_of_spin_serve_leaves_no_process(served: Served) -> None:
    family = _descendants(served.proc.pid)
    assert len(family) >= 2 + len(DRAFTERS) + 1  # verifier, drafters, router, redis-server
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait(10)
    end = time.monotonic() + 5
    while (left := [p for p in family if _alive(p)]) and time.monotonic() < end:
        time.sleep(0.1)
    print(f"\nkill -9 spin serve: {len(family)} processes under it, {len(left)} left after "
          f"{5 - max(0.0, end - time.monotonic()):.1f} s")
    assert left == []
