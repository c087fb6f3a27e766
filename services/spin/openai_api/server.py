"""The HTTP API's server: uvicorn on the event loop the router's gRPC server runs on.

Started before the router says it is ready (its port goes on the ready line: ``http_port=P``);
on SIGTERM it stops accepting at once and lets running responses finish (``grace_s``) while the
gRPC server drains, before the scheduler stops. The process's signals stay the gRPC server's
(``rpc/serving.py``): uvicorn installs no handlers of its own here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import uvicorn

log = logging.getLogger(__name__)


@dataclass
class HttpConfig:
    """Where the HTTP API listens."""

    host: str = "127.0.0.1"
    port: int = 8000
    """0: a free port (reported on the ready line)."""
    tls_cert: str | None = None
    """PEM certificate chain: HTTPS when set (with ``tls_key``)."""
    tls_key: str | None = None
    grace_s: float = 30.0
    """How long running responses may go on after SIGTERM."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gRPC server owns the process's signals
        yield


class HttpServer:
    """uvicorn serving ``app`` as a task of the running loop."""

    def __init__(self, app, cfg: HttpConfig) -> None:
        self.cfg = cfg
        self.server = _Server(uvicorn.Config(
            app, host=cfg.host, port=cfg.port, ssl_certfile=cfg.tls_cert,
            ssl_keyfile=cfg.tls_key, log_level="warning", lifespan="off",
            timeout_graceful_shutdown=max(1, int(cfg.grace_s)), access_log=False))
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listen; the port. OSError when it cannot (the port is taken)."""
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                try:
                    self.task.result()
                except BaseException as e:  # uvicorn exits (SystemExit) when it cannot bind
                    raise OSError(f"the HTTP API cannot listen on {self.cfg.host}:"
                                  f"{self.cfg.port}") from e
                raise OSError(f"the HTTP API stopped while starting on {self.cfg.port}")
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def begin_stop(self) -> None:
        """Stop accepting; running responses go on for up to ``grace_s``."""
        self.server.should_exit = True

    async def stopped(self) -> None:
        """Wait for ``begin_stop`` to take effect: for the running responses, not for idle
        keep-alive connections (a TLS one would hold the stop for asyncio's 30 s TLS shutdown
        timeout)."""
        if self.task is None:
            return
        self.begin_stop()
        while not self.task.done():
            if not self.server.server_state.tasks:  # no response running: idle connections only
                self.server.force_exit = True
            await asyncio.sleep(0.05)
        with contextlib.suppress(Exception):
            await self.task
