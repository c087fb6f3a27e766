"""``spin serve``'s children kept alive, and never left behind.

**Children.** A ``Child`` is one service process whose first stdout line ``<role> ready
grpc_port=P metrics_port=M [http_port=H]`` says it is serving (``rpc/serving.py`` prints it);
its stderr and other output go to ``<log_dir>/<role>.log``.

**Restarts.** ``Supervisor.check`` (called every half second by ``serve``) finds a child that
exited (a drafter, the verifier, the router, or the redis-server) and starts it again on the same
ports after a back-off: ``RestartPolicy.backoff_s``, doubled for each restart of that child within
``window_s``, at most ``max_backoff_s``. A child restarted more than ``max_restarts`` times within
``window_s`` ends ``spin serve`` with its log's tail: something is wrong that restarting will not
fix. The router keeps every request's whole context, so a restarted drafter costs its requests
a step without speculation and a restarted verifier one prefill each, within the router's
``verifier_outage_s``: no request fails and the output is unchanged.

**Parent death.** Every child is started with Linux's parent-death signal (``PR_SET_PDEATHSIG``
= SIGKILL): when ``spin serve`` dies, whatever killed it (SIGKILL, the OOM killer), the kernel
kills its children. The signal is bound to the thread that started the child, so children are
started and restarted from the thread that runs ``serve`` (or the ``Embedded``'s owner). On
other systems there is no such signal; ``spin serve`` then stops its children only when it
exits normally.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .stats.redis_server import RedisServer

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has the child killed (SIGKILL) when this
    process dies; None where the kernel has no parent-death signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


class Child:
    """A service process (module docstring); killed by the kernel if this process dies."""

    def __init__(self, role: str, argv: list[str], log_dir: Path, env: dict[str, str] | None,
                 append: bool = False) -> None:
        self.role = role
        self.argv = argv
        self.env = env
        self.log_dir = log_dir
        self.log_path = log_dir / f"{role}.log"
        self._log = open(self.log_path, "a" if append else "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, start_new_session=True,
                                     preexec_fn=die_with_parent())
        self._terminated = False
        self.port = 0
        self.metrics_port = 0
        self.http_port = 0
        """The router's HTTP API port (0: none)."""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if " ready grpc_port=" in line and not self._ready.is_set():
                fields = dict(kv.split("=") for kv in line.split() if "=" in kv)
                self.port, self.metrics_port = int(fields["grpc_port"]), int(fields["metrics_port"])
                self.http_port = int(fields.get("http_port", 0))
                self._ready.set()
            else:
                self._log.write(line)
                self._log.flush()

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode} while starting;"
                                   f" its log ({self.log_path}) ends:\n{tail(self.log_path)}")
            if time.monotonic() > end:
                raise RuntimeError(f"{self.role} not ready after {timeout_s:.0f} s; see "
                                   f"{self.log_path}")

    def restart(self) -> Child:
        """The same service started again on the ports it had (its clients find it where they
        left it), its log appended to. ``--port`` and ``--metrics-port`` are set to them, and
        ``--http-port`` where the command line has one (``spin serve``'s router has its HTTP
        port in its config file instead)."""
        self.stop(0)
        argv = with_flag(with_flag(self.argv, "--port", str(self.port)), "--metrics-port",
                         str(self.metrics_port))
        if self.http_port and "--http-port" in argv:
            argv = with_flag(argv, "--http-port", str(self.http_port))
        child = Child(self.role, argv, self.log_dir, self.env, append=True)
        child.port, child.metrics_port, child.http_port = (self.port, self.metrics_port,
                                                           self.http_port)
        return child

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM, once: it drains, then exits); ``stop`` waits for it."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the flag appended)."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


class Deployment(Protocol):
    """What a ``Supervisor`` watches (``serve.Embedded``): the children, the router among them,
    and the redis-server, if any."""

    children: list[Child]
    """Every service process; restarted ones replace their predecessors here."""
    router: Child | None
    """The router (one of ``children``), replaced here too when restarted."""
    redis: RedisServer | None
    """The statistics' redis-server, restarted in place."""


@dataclass
class RestartPolicy:
    """When ``spin serve`` restarts a child that exited."""

    max_restarts: int = 5
    """Restarts of one child within ``window_s`` before ``spin serve`` gives up (0: never
    restart; the first exit of the router or the verifier ends ``spin serve``)."""
    window_s: float = 300.0
    """The window over which restarts are counted."""
    backoff_s: float = 1.0
    """The wait before a child's first restart in the window; doubled for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""


@dataclass
class _Record:
    """One child's restarts."""

    exits: deque[float] = field(default_factory=deque)
    """Monotonic times of its exits within the window."""
    due: float | None = None
    """When the pending restart starts (None: none pending)."""
    restarts: int = 0
    """Restarts since ``spin serve`` started."""


class Supervisor:
    """Restarts ``emb``'s children (and its redis-server) as ``policy`` says; see the module
    docstring. ``out`` receives one line per event (``spin serve`` prints them)."""

    def __init__(self, emb: Deployment, policy: RestartPolicy | None = None,
                 out: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emb = emb
        self.policy = policy or RestartPolicy()
        self.out = out or (lambda line: log.warning("%s", line))
        self.clock = clock
        self.records: dict[str, _Record] = {}

    def check(self) -> str | None:
        """Restart what is due; a message when a child exceeded its restarts (or may not be
        restarted) and ``spin serve`` must end, else None."""
        for i, child in enumerate(list(self.emb.children)):
            code = child.proc.poll()
            if code is None:
                continue
            fatal = self._exited(child.role, f"exited with {_describe(code)}", child.log_path)
            if fatal:
                return fatal
            rec = self.records[child.role]
            if rec.due is not None and self.clock() >= rec.due:
                rec.due, rec.restarts = None, rec.restarts + 1
                new = child.restart()
                self.emb.children[i] = new
                if child is self.emb.router:
                    self.emb.router = new
                self.out(f"{child.role} restarted (pid {new.proc.pid}, restart {rec.restarts})")
        redis = self.emb.redis
        if redis is not None and not redis.running:
            fatal = self._exited("redis-server", "exited", redis.log_path)
            if fatal:
                return fatal
            rec = self.records["redis-server"]
            if rec.due is not None and self.clock() >= rec.due:
                rec.due, rec.restarts = None, rec.restarts + 1
                try:
                    redis.restart()
                except RuntimeError as e:
                    self.out(f"redis-server did not start again: {e}")
                else:
                    self.out(f"redis-server restarted (pid {redis.pid}, restart {rec.restarts})"
                             f" on port {redis.port}, its data from {redis.data_dir}")
        return None

    def _exited(self, role: str, how: str, log_path: Path | None) -> str | None:
        """Note an exit of ``role`` once (a restart scheduled); a message if it is fatal."""
        rec = self.records.setdefault(role, _Record())
        if rec.due is not None:
            return None  # already noted, its restart pending
        now = self.clock()
        rec.exits.append(now)
        while rec.exits and now - rec.exits[0] > self.policy.window_s:
            rec.exits.popleft()
        last = tail(log_path)
        if len(rec.exits) > self.policy.max_restarts:
            return (f"{role} {how} ({len(rec.exits)} exits within {self.policy.window_s:.0f} s; "
                    f"at most {self.policy.max_restarts} restarts); stopping. Its log "
                    f"({log_path}) ends:\n{last}")
        delay = min(self.policy.backoff_s * 2 ** (len(rec.exits) - 1), self.policy.max_backoff_s)
        rec.due = now + delay
        self.out(f"{role} {how}; restarting it in {delay:.0f} s. Its log ({log_path}) ends:\n"
                 f"{last}")
        return None


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def tail(path: Path | None, lines: int = 15) -> str:
    """The last ``lines`` lines of a log ("(no log)" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except (OSError, AttributeError):
        return "(no log)"
