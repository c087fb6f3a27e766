"""A local ``redis-server`` child process: for tests, benchmarks and single-host deployments.

``RedisServer`` starts ``redis-server`` on a loopback port, waits until it answers PING and stops
it with SIGTERM (SIGKILL after 5 s). Without a ``data_dir`` persistence is off (``--save ''
--appendonly no``): data lives only as long as the process, and ``restart()`` keeps the port but
not the contents, which is what the catch-up tests of the stats store need (a Redis that goes
away and comes back). With a ``data_dir`` (``spin serve``) every write is appended to an
append-only file there (``--appendonly yes``, fsync every second), so a redis-server killed and
restarted has the statistics it had.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
_LOG_TAIL_CHARS = 2000


def find_redis_server() -> str | None:
    """The path of ``redis-server`` on PATH, or None when it is not installed."""
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and ask the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _resolve_binary(binary: str | None) -> str:
    if binary is None:
        found = find_redis_server()
        if found is None:
            raise FileNotFoundError(
                "redis-server not found on PATH: install Redis (e.g. `apt-get install redis-server`) "
                "or pass binary=/path/to/redis-server"
            )
        return found
    found = shutil.which(binary) if os.sep not in binary else None
    if found is not None:
        return found
    path = Path(binary)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"redis-server binary {binary!r} does not exist or is not executable")
    return str(path)


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(self, port: int | None = None, binary: str | None = None,
                 data_dir: Path | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        """``port`` None picks a free port at the first start; ``binary`` None looks up PATH;
        ``data_dir``: where the data persists across restarts (None: nowhere);
        ``preexec_fn``: run in the child before ``exec`` (``supervisor.die_with_parent``).

        Raises FileNotFoundError at once when there is no usable binary.
        """
        self.binary: str = _resolve_binary(binary)
        self.data_dir = data_dir
        self._preexec_fn = preexec_fn
        self._requested_port = port
        self._port: int | None = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    # ------------------------------------------------------------------ properties
    @property
    def port(self) -> int:
        """The TCP port (fixed after the first start, kept by restart())."""
        if self._port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:{port}/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (tests freeze it with SIGSTOP to fake a hung Redis)."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        """Where the server's stdout/stderr go (inside a private temporary directory)."""
        return None if self._workdir is None else self._workdir / "redis.log"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RedisServer:
        """Start the server and wait (up to 10 s) until it answers PING; a no-op when running."""
        if self.running:
            return self
        # An auto-picked port may be taken between free_port() and the bind: try a few.
        attempts = 3 if self._requested_port is None and self._port is None else 1
        for attempt in range(attempts):
            port = self._port if self._port is not None else free_port()
            try:
                self._spawn(port)
                self._port = port
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                logger.info("redis-server did not start on port %d, trying another port", port)
        raise AssertionError("unreachable")

    def _spawn(self, port: int) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="spin-redis-"))
        log_path = self._workdir / "redis.log"
        cmd = [
            self.binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.data_dir is None:
            cmd += ["--appendonly", "no", "--dir", str(self._workdir)]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            cmd += ["--appendonly", "yes", "--appendfsync", "everysec",
                    "--dir", str(self.data_dir.resolve())]
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                preexec_fn=self._preexec_fn,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(
            host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=0.2, socket_timeout=0.2,
        )  # fmt: skip
        try:
            while True:
                if self._proc.poll() is not None:
                    code, tail = self._proc.returncode, self._tail(log_path)
                    self._cleanup()
                    raise RuntimeError(f"redis-server exited with code {code} on port {port}:\n{tail}")
                try:
                    if client.ping():
                        logger.debug("redis-server pid %d ready on port %d", self._proc.pid, port)
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    tail = self._tail(log_path)
                    self._terminate()
                    self._cleanup()
                    raise RuntimeError(
                        f"redis-server on port {port} did not answer PING within {START_TIMEOUT_S:.0f} s:\n"
                        f"{tail}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    @staticmethod
    def _tail(log_path: Path) -> str:
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-_LOG_TAIL_CHARS:] or "(empty log)"

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("redis-server pid %d ignored SIGTERM, killing it", proc.pid)
                proc.kill()
                proc.wait()
        self._proc = None

    def _cleanup(self) -> None:
        self._proc = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) and remove its directory; idempotent."""
        self._terminate()
        self._cleanup()

    def restart(self) -> RedisServer:
        """Stop and start again on the same port (the contents are lost without a
        ``data_dir``)."""
        port = self.port
        self.stop()
        self._port = port
        self._spawn(port)
        return self

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self._port}, {state})"
