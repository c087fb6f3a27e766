"""``spin serve``'s supervisor: children restarted on their ports after a back-off, a limit that
ends it, and children killed by the kernel with their parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spin.supervisor import Child
from spin.supervisor import RestartPolicy, Supervisor, die_with_parent

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

SERVICE = """
import sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1]) or 41000 + len(args)
metrics = int(args[args.index("--metrics-port") + 1]) or 42000
print("started with", " ".join(args), file=sys.stderr, flush=True)
print(f"fake ready grpc_port={port} metrics_port={metrics}", flush=True)
time.sleep(120)
"""


class Deployment:
    """What the supervisor watches of an ``Embedded``."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.router = None
        self.redis = None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _exit_seen(child: Child) -> None:
    child.proc.wait(10)


def test_a_dead_child_is_restarted_on_its_ports_after_a_growing_back_off(tmp_path: Path) -> None:
    child = Child("fake", [sys.executable, "-c", SERVICE, "--port", "0", "--metrics-port", "0"],
                  tmp_path, None)
    child.wait_ready(30)
    port, metrics = child.port, child.metrics_port
    emb, clock, lines = Deployment([child]), Clock(), []
    sup = Supervisor(emb, RestartPolicy(max_restarts=2, backoff_s=1.0), lines.append, clock)
    try:
        assert sup.check() is None and lines == []  # alive: nothing to do
        child.proc.send_signal(signal.SIGKILL)
        _exit_seen(child)
        assert sup.check() is None
        assert lines[-1].startswith("fake exited with signal SIGKILL; restarting it in 1 s")
        assert "started with --port 0" in lines[-1]  # the log's tail comes with it
        assert sup.check() is None and emb.children[0] is child  # not before the back-off
        clock.now += 1.0
        assert sup.check() is None
        new = emb.children[0]
        assert new is not child and lines[-1] == f"fake restarted (pid {new.proc.pid}, restart 1)"
        new.wait_ready(30)
        assert (new.port, new.metrics_port) == (port, metrics)
        assert new.argv[-4:] == ["--port", str(port), "--metrics-port", str(metrics)]
        assert "started with --port 0" in new.log_path.read_text()  # appended, not replaced

        new.proc.send_signal(signal.SIGKILL)
        _exit_seen(new)
        sup.check()
        assert "restarting it in 2 s" in lines[-1]  # the second exit in the window waits longer
        clock.now += 2.0
        sup.check()
        third = emb.children[0]
        third.wait_ready(30)
        third.proc.send_signal(signal.SIGKILL)
        _exit_seen(third)
        fatal = sup.check()
        assert fatal is not None and "(3 exits within 300 s; at most 2 restarts)" in fatal
    finally:
        for c in emb.children:
            c.stop(5)


def test_exits_outside_the_window_are_forgotten(tmp_path: Path) -> None:
    child = Child("fake", [sys.executable, "-c", SERVICE, "--port", "0", "--metrics-port", "0"],
                  tmp_path, None)
    emb, clock, lines = Deployment([child]), Clock(), []
    sup = Supervisor(emb, RestartPolicy(max_restarts=1, window_s=60.0), lines.append, clock)
    try:
        for _ in range(3):  # one exit a window: never more than the limit
            emb.children[0].wait_ready(30)
            emb.children[0].proc.send_signal(signal.SIGKILL)
            _exit_seen(emb.children[0])
            assert sup.check() is None
            assert "restarting it in 1 s" in lines[-1]
            clock.now += 61.0
            assert sup.check() is None
    finally:
        for c in emb.children:
            c.stop(5)


def test_no_restarts_ends_at_the_first_exit(tmp_path: Path) -> None:
    child = Child("fake", [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path, None)
    child.proc.wait(30)
    sup = Supervisor(Deployment([child]), RestartPolicy(max_restarts=0), lambda _: None)
    fatal = sup.check()
    assert fatal is not None and fatal.startswith("fake exited with code 3")


PARENT = """
import subprocess, sys, time
from spin.supervisor import die_with_parent

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_child_dies_with_its_parent_whatever_killed_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    end = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_die_with_parent_is_a_preexec_function_on_linux() -> None:
    fn = die_with_parent()
    assert (fn is not None) == sys.platform.startswith("linux")
