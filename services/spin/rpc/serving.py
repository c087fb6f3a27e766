"""Scaffolding every SPIN gRPC process shares.

- ``grpc.health.v1`` health (overall and per service), SERVING once the model is loaded;
- server reflection, so ``grpcurl`` works without the .proto files;
- requests that do not parse answered INVALID_ARGUMENT (``decode.py``), for every service the
  process registers with ``decode.add_servicer`` and for health and reflection;
- Prometheus metrics over HTTP on their own port;
- OpenTelemetry tracing when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (``obs/tracing.py``): the
  gRPC instrumentation on the unary and server-streaming calls, spans exported in batches;
- graceful shutdown: on SIGTERM or SIGINT the process reports NOT_SERVING, stops accepting new
  calls, lets in-flight calls finish for up to ``grace_s`` seconds, runs its cleanup, then
  exports the spans still buffered.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import start_http_server

from ..obs import tracing
from .auth import ApiKeyInterceptor
from .decode import add_servicer

log = logging.getLogger(__name__)

# Messages up to 64 MiB: sampling requests ship dense draft distributions for big batches.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                   ("grpc.max_receive_message_length", 64 << 20)]


@dataclass
class ServerConfig:
    """Where a service listens and how it stops."""

    host: str = "127.0.0.1"
    """Interface of the gRPC port (0.0.0.0 in a container)."""
    port: int = 0
    """gRPC port; 0 picks a free one (printed at start)."""
    metrics_port: int | None = None
    """Prometheus HTTP port; None = no metrics endpoint, 0 = a free one."""
    grace_s: float = 30.0
    """How long in-flight calls may run after SIGTERM."""
    service_names: list[str] = field(default_factory=list)
    """Full names of the services registered (for health, reflection and tracing)."""
    trace_service: str = "spin"
    """OpenTelemetry ``service.name`` unless ``OTEL_SERVICE_NAME`` sets one (e.g. ``spin-router``);
    tracing is on iff ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set."""
    trace_redis: bool = False
    """Also trace Redis commands (the router's statistics store)."""
    tls_cert: str | None = None
    """PEM certificate chain: the port serves TLS (with ``tls_key``); None: plaintext."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    api_key: str | None = None
    """Calls to ``service_names`` need ``authorization: Bearer <api_key>`` (``auth.py``)."""


async def _set(servicer: health.aio.HealthServicer, name: str, status: int) -> None:
    out = servicer.set(name, status)
    if inspect.isawaitable(out):
        await out


@dataclass
class Hooks:
    """What a process does around its gRPC server's start and stop."""

    on_ready: Callable[[int, int | None], None] | None = None
    """Runs once it listens, with the gRPC and metrics ports."""
    before_ready: Callable[[], Awaitable[None]] | None = None
    """Runs after the server started, before ``on_ready`` (e.g. another listener)."""
    on_stop: Callable[[], None] | None = None
    """Runs as soon as a stop is asked for (e.g. another listener stops accepting)."""
    after_stop: Callable[[], Awaitable[None]] | None = None
    """Runs once in-flight calls have drained (or the grace period ended)."""


async def serve(cfg: ServerConfig, register: Callable[[grpc.aio.Server], None],
                on_ready: Callable[[int, int | None], None] | None = None,
                after_stop: Callable[[], Awaitable[None]] | None = None,
                hooks: Hooks | None = None) -> None:
    """Run a gRPC server until SIGTERM/SIGINT.

    ``register`` adds the servicers; ``on_ready(grpc_port, metrics_port)`` runs once it listens;
    ``after_stop`` runs once in-flight calls have drained (or the grace period ended); buffered
    spans are exported after it. ``hooks`` (instead of those two) adds the others.
    """
    hooks = hooks or Hooks(on_ready=on_ready, after_stop=after_stop)
    tracing.setup(cfg.trace_service, redis=cfg.trace_redis)
    try:
        await _serve(cfg, register, hooks)
    finally:
        tracing.shutdown()


async def _serve(cfg: ServerConfig, register: Callable[[grpc.aio.Server], None],
                 hooks: Hooks) -> None:
    interceptors = list(tracing.server_interceptors(cfg.service_names) or [])
    if cfg.api_key:
        interceptors.insert(0, ApiKeyInterceptor(cfg.api_key, cfg.service_names))
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
    register(server)
    health_servicer = health.aio.HealthServicer()
    # health and reflection, like the services, answer a request that does not parse
    # INVALID_ARGUMENT (rpc/decode.py), not UNKNOWN
    add_servicer(health_servicer, health_pb2.DESCRIPTOR.services_by_name["Health"], server)
    reflected = [*cfg.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    add_servicer(reflection.aio.ReflectionServicer(reflected),
                 reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"], server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert or cfg.tls_key:
        port = server.add_secure_port(address, server_credentials(cfg.tls_cert, cfg.tls_key))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    metrics_port = None
    if cfg.metrics_port is not None:
        httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.host)
        metrics_port = httpd.server_port
    await server.start()
    for name in ["", *cfg.service_names]:
        await _set(health_servicer, name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if hooks.before_ready:
        await hooks.before_ready()
    if hooks.on_ready:
        hooks.on_ready(port, metrics_port)
    await stop.wait()
    if hooks.on_stop:
        hooks.on_stop()
    log.info("stopping: draining in-flight calls for up to %.0f s", cfg.grace_s)
    for name in ["", *cfg.service_names]:
        await _set(health_servicer, name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(cfg.grace_s)
    if hooks.after_stop:
        await hooks.after_stop()
    log.info("stopped")


def announce(role: str, **more: Callable[[], object]) -> Callable[[int, int | None], None]:
    """An ``on_ready`` that prints the ports on one line (``spin serve`` parses it); ``more``:
    further ``name=value`` fields, their values asked for when it prints."""
    def ready(port: int, metrics_port: int | None) -> None:
        extra = "".join(f" {k}={v()}" for k, v in more.items())
        print(f"{role} ready grpc_port={port} metrics_port={metrics_port or 0}{extra}", flush=True)
    return ready


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; ValueError when one is missing or unreadable."""
    if not (cert and key):
        raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
    try:
        with open(cert, "rb") as c, open(key, "rb") as k:
            return grpc.ssl_server_credentials([(k.read(), c.read())])
    except OSError as e:
        raise ValueError(f"cannot read the TLS certificate or key: {e}") from None


def torch_worker(name: str) -> ThreadPoolExecutor:
    """The one thread a service runs torch on: its model loaded, its steps timed and every
    batch computed there, so the process keeps one OpenMP thread team. Another thread calling
    torch gets a team of its own, and with more OpenMP threads than cores libgomp spins at most
    100 times before a thread sleeps, whatever ``GOMP_SPINCOUNT`` says (its manual). Measured
    on 2 cores, a verifier service's 4-token chain step from a client alone: start-up on the
    main thread and batches on another 14.6-22.5 ms with or without ``GOMP_SPINCOUNT`` 10,000;
    all on this one thread with it, 11.7-12.1 ms (in process, 10-11 ms)."""
    return ThreadPoolExecutor(1, thread_name_prefix=name)
