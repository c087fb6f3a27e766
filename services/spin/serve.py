"""``spin serve``: the whole system on one machine, as child processes on loopback ports.

Starts a ``redis-server`` for acceptance statistics (or, without the binary, keeps them in the
router's process, with a warning), the verifier with the demo target, one drafter per demo draft
model, and the router, waits for each to report ready, prints the endpoint, and on Ctrl-C (or
SIGTERM) stops them router first, so in-flight requests drain. Each child's log goes to
``build/serve/<role>.log``. A child that exits is started again on its ports, and no child
outlives ``spin serve`` (``supervisor.py``).

Tracing: the children inherit the environment, so ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the other
``OTEL_*`` variables) turn it on in every process, except ``OTEL_SERVICE_NAME``: one name for all
would merge them, so each child names itself (``spin-router``, ``spin-verifier``,
``spin-drafter-<name>``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from .cli.flags import runner_argv, server_argv
from .cli.services import router_argv
from .cpus import available_cpus, split
from .engine.memory import resolve_device
from .engine.model_runner import RunnerConfig
from .engine.quant import resolve as resolve_quantize
from .router.config import RouterConfig
from .rpc.serving import ServerConfig
from .supervisor import RestartPolicy, Supervisor, die_with_parent, tail
from .zoo.report import family_members
from .zoo.specs import BUILD_DIR, FAMILY_DIR

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """The embedded deployment."""

    family_dir: Path = FAMILY_DIR
    """Model family: ``target`` plus draft models, each a checkpoint directory (the default
    models)."""
    target: str | None = None
    """The target's checkpoint: a directory or a Hugging Face name (found in the local cache);
    None: the family's ``target``."""
    drafter_models: dict[str, str] | None = None
    """Draft models, name -> checkpoint (directory or name); None: the family's draft models
    (``drafters`` picks some of them)."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """The verifier's device, dtype, KV cache budget, max model length and requests
    (``spin verifier``'s model flags); the drafters get the same device, dtype and lengths."""
    drafter_kv_cache_memory: int | None = None
    """Each drafter's KV cache budget (bytes; None: the default of its device)."""
    host: str = "127.0.0.1"
    """Interface the router listens on."""
    port: int = 50051
    """The router's gRPC port."""
    http_port: int | None = None
    """The router's OpenAI-compatible HTTP port (0: a free one); None: 8000, or a free one when
    ``port`` is 0. ``router.http_port`` None turns the HTTP API off."""
    metrics_port: int = 0
    """The router's Prometheus port (0 = a free one, printed)."""
    drafters: list[str] | None = None
    """Draft models to start (default: every draft model in the family)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router's policy, default drafter and k, batching and cost model, as ``spin router``
    takes them (``cli.services.router_argv`` passes them on). ``serve`` fills in ``verifier``
    and ``drafters`` with the services it starts, ``tokenizer`` when '' with the target's,
    ``redis_url`` when it starts a redis-server. Without a ``cost_model`` file the router fits
    its cost model from the step times the services measure on themselves at start
    (``rpc/step_times.py``)."""
    redis: bool = True
    """Start a redis-server for statistics when the binary exists."""
    log_dir: Path = field(default_factory=lambda: BUILD_DIR.parent / "serve")
    threads: int = 2
    """Torch threads of the verifier (with ``cpus="split"``: one per core of its own)."""
    drafter_threads: int = 1
    """Torch threads per drafter (small models gain little from more, and on a small machine
    their idle thread pools would compete with the verifier's)."""
    cpus: Literal["shared", "split"] = "shared"
    """Cores of the services: 'shared' (every process may run on every core), or 'split'
    (``cpus.split``: the drafters and the router pinned to a quarter of the cores, at least one,
    the verifier to the rest). Split suits ``micro_batches=2`` on a CPU-only machine, where one
    micro-batch is drafted while the other is verified: on shared cores a drafter displaces one
    of the verifier's threads and every operator waits for it."""
    drafter_quantize: str = "auto"
    """Weights of the draft models: 'none' (as loaded), 'int8' (``engine/quant.py``: faster
    drafts on CPU, the same output), or 'auto' (int8 where this torch has the kernels). The cost
    model is measured again when its file was measured with other drafter weights."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every child (e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT``), over this
    process's."""
    tls_cert: str | None = None
    """The router's TLS certificate chain (PEM), for gRPC and HTTP; None: plaintext."""
    tls_key: str | None = None
    """Its private key (PEM)."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """When ``serve`` restarts a child that exited (``supervisor.py``)."""


class Child:
    """A service process whose first stdout line ``<role> ready grpc_port=P metrics_port=M``
    says it is serving; killed by the kernel if this process dies (``supervisor.py``)."""

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

    @property
    def ready(self) -> bool:
        """It said it is serving."""
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode} while starting;"
                                   f" its log ({self.log_path}) ends:\n{tail(self.log_path)}")
            if time.monotonic() > end:
                raise RuntimeError(f"{self.role} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def restart(self) -> Child:
        """The same service started again on the ports it had (its clients find it where they
        left it), its log appended to."""
        self.stop(0)
        argv = _with_flag(_with_flag(self.argv, "--port", str(self.port)), "--metrics-port",
                          str(self.metrics_port))
        if self.http_port:
            argv = _with_flag(argv, "--http-port", str(self.http_port))
        child = Child(self.role, argv, self.log_dir, self.env, append=True)
        child.port, child.metrics_port, child.http_port = (self.port, self.metrics_port,
                                                           self.http_port)
        return child

    def stop(self, grace_s: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the flag appended)."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def _spin(*args: str) -> list[str]:
    return [sys.executable, "-m", "spin", *args]


VERIFIER_GPU_SHARE = 0.75
"""On one GPU shared by every service, the verifier's share of ``--gpu-memory-utilization``;
the drafters split the rest equally."""


def service_runner(runner: RunnerConfig, kv_cache_memory: int | None, gpu_share: float,
                   quantize: str = "none") -> RunnerConfig:
    """``runner`` for one service on the shared machine: its own KV cache budget and weights,
    and ``gpu_share`` of ``gpu_memory_utilization`` (to 4 decimals, as ``plan`` plans it)."""
    return replace(runner, kv_cache_memory=kv_cache_memory, quantize=quantize,
                   gpu_memory_utilization=float(f"{runner.gpu_memory_utilization * gpu_share:.4f}"))


def drafter_quantization(cfg: ServeConfig) -> str:
    """The drafters' weights: ``drafter_quantize`` resolved, int8 only where they run on the
    CPU (the runner refuses int8 elsewhere)."""
    if cfg.runner.device != "cpu" and resolve_device(cfg.runner.device).type != "cpu":
        return "none"
    return resolve_quantize(cfg.drafter_quantize)


def models(cfg: ServeConfig) -> tuple[str, dict[str, str]]:
    """The target's checkpoint and the draft models (name -> checkpoint) ``cfg`` serves."""
    target = cfg.target or str(cfg.family_dir / "target")
    if cfg.drafter_models is not None:
        return target, dict(cfg.drafter_models)
    names = cfg.drafters if cfg.drafters is not None else family_members(cfg.family_dir)
    return target, {n: str(cfg.family_dir / n) for n in names}


class Embedded:
    """The running children (a context manager; also used by the tests and benchmarks)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.redis = None
        self.router: Child | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.cfg.host}:{self.router.port}"

    def child(self, role: str, name: str) -> Child:
        return next(c for c in self.children if c.role == f"{role}-{name}" or c.role == role == name)

    def start(self, timeout_s: float = 180.0) -> Embedded:
        cfg = self.cfg
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        # PASSIVE: an idle OpenMP pool sleeps instead of spinning. The processes take turns on
        # the same cores (draft, then verify), and a spinning pool would steal them from the one
        # computing (measured: single stream 151 vs 120 tokens/s on 2 cores).
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        env.pop("OTEL_SERVICE_NAME", None)  # each child's default names its role
        env.update(cfg.env)
        redis_url = self._start_redis()
        try:
            target, drafter_models = models(cfg)
            quantize = drafter_quantization(cfg)
            verifier_threads, side_cpus, verifier_cpus = cfg.threads, None, None
            if cfg.cpus == "split":
                side_cpus, verifier_cpus = split(available_cpus())
                verifier_threads = len(verifier_cpus)
            share = (VERIFIER_GPU_SHARE, (1 - VERIFIER_GPU_SHARE) / max(1, len(drafter_models)))
            loopback = ServerConfig(port=0, metrics_port=0)
            verifier = service_runner(cfg.runner, cfg.runner.kv_cache_memory, share[0])
            self.children.append(Child("verifier", _spin(
                "verifier", "--model", target, "--threads", str(verifier_threads),
                *server_argv(loopback, verifier_cpus), *runner_argv(verifier)), cfg.log_dir, env))
            drafter = service_runner(cfg.runner, cfg.drafter_kv_cache_memory, share[1], quantize)
            for name, model in drafter_models.items():
                self.children.append(Child(f"drafter-{name}", _spin(
                    "drafter", "--model", model, "--name", name, "--threads",
                    str(cfg.drafter_threads), *server_argv(loopback, side_cpus),
                    *runner_argv(drafter)), cfg.log_dir, env))
            for c in self.children:
                c.wait_ready(timeout_s)
            http_port = cfg.http_port if cfg.http_port is not None else (8000 if cfg.port else 0)
            router = replace(
                cfg.router, verifier=f"127.0.0.1:{self.children[0].port}", api_key=None,
                http_port=None if cfg.router.http_port is None else http_port,
                tokenizer=cfg.router.tokenizer or target,
                drafters={c.role.removeprefix("drafter-"): f"127.0.0.1:{c.port}"
                          for c in self.children[1:]},
                redis_url=redis_url or cfg.router.redis_url,
                stats_spill=cfg.router.stats_spill or str(cfg.log_dir / "stats-pending.json"))
            server = ServerConfig(host=cfg.host, port=cfg.port, metrics_port=cfg.metrics_port,
                                  tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
            router_env = dict(env)  # the key goes in the environment, never on a command line
            if cfg.router.api_key:
                router_env["SPIN_API_KEY"] = cfg.router.api_key
            self.router = Child("router", _spin("router", *router_argv(router),
                                                *server_argv(server, side_cpus)), cfg.log_dir,
                                router_env)
            self.router.wait_ready(timeout_s)
            self.children.append(self.router)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> str | None:
        """Start a redis-server for the statistics (``cfg.redis``, when the binary exists): its
        URL, else None."""
        if not self.cfg.redis:
            return None
        from .stats.redis_server import RedisServer, find_redis_server

        if not find_redis_server():
            print("warning: no redis-server binary found; acceptance statistics stay in the "
                  "router's memory (install redis-server to share them)", file=sys.stderr)
            return None
        self.redis = RedisServer(data_dir=self.cfg.log_dir / "redis",
                                 preexec_fn=die_with_parent())
        self.redis.start()
        return self.redis.url

    def stop(self, grace_s: float = 30.0) -> None:
        for c in sorted(self.children, key=lambda c: c.role != "router"):  # router first: drain
            c.stop(grace_s)
        self.children = []
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Embedded:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(cfg: ServeConfig) -> int:
    """Start everything, print the endpoint, wait for Ctrl-C or SIGTERM."""
    stop = threading.Event()
    emb = Embedded(cfg)

    def on_signal(*_) -> None:  # installed for SIGINT too: it may arrive ignored (nohup, &)
        started = stop.is_set() or emb.router is not None
        stop.set()
        if not started:
            raise KeyboardInterrupt  # abort a start in progress

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"starting the verifier, drafters and router (logs in {cfg.log_dir}) ...", flush=True)
    try:
        emb.start()
        print(f"SPIN serving on {emb.endpoint} (gRPC spin.v1.Generation); router metrics on "
              f"http://127.0.0.1:{emb.router.metrics_port}/metrics", flush=True)
        if emb.router.http_port:
            scheme = "https" if cfg.tls_cert else "http"
            print(f"OpenAI-compatible API on {scheme}://{cfg.host}:{emb.router.http_port}/v1 "
                  f"(POST /v1/completions, /v1/chat/completions; GET /v1/models)", flush=True)
        for c in emb.children:
            print(f"  {c.role:24s} 127.0.0.1:{c.port}  metrics :{c.metrics_port}  "
                  f"pid {c.proc.pid}", flush=True)
        if emb.redis is not None:
            print(f"  {'redis-server':24s} 127.0.0.1:{emb.redis.port}  pid {emb.redis.pid}",
                  flush=True)
        print(f'try: spin generate "def parse(path):" --endpoint {emb.endpoint}   (Ctrl-C stops)',
              flush=True)
        supervisor = Supervisor(emb, cfg.restart, out=lambda line: print(line, file=sys.stderr,
                                                                         flush=True))
        while not stop.wait(0.5):
            fatal = supervisor.check()
            if fatal:
                print(fatal, file=sys.stderr, flush=True)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        emb.stop()
    return 0
