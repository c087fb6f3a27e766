"""``spin serve``: the whole system on one machine, as child processes on loopback ports.

``Embedded`` starts a ``redis-server`` for acceptance statistics (or, without the binary, keeps
them in the router's process, with a warning), the verifier with the demo target, one drafter
per demo draft model (or inside the verifier: ``colocate``), and the router, waits for each to
report ready, and stops them router first, so in-flight requests drain (``cli/serve.py`` prints
the endpoint, stops on Ctrl-C or SIGTERM). Logs: ``build/serve/<role>.log``; a child that exits
is started again on its ports, and none outlives ``spin serve`` (``supervisor.py``).

The router gets its ``RouterConfig`` whole, as the JSON file ``build/serve/router.json``
(``spin router --config``: ``router/config.py`` writes and reads it, so no flag list is kept
here); the verifier and the drafters get their few model and service flags (``runner_argv``,
``server_argv``: the exact inverses of their parsers in ``cli/flags.py``, which the tests check).

Tracing: the children inherit the environment, so ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the other
``OTEL_*`` variables) turn it on in every process, except ``OTEL_SERVICE_NAME``: one name for all
would merge them, so each child names itself (``spin-router``, ``spin-verifier``,
``spin-drafter-<name>``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from .cpus import available_cpus, format_cpus, split
from .engine.eagle import ARCHITECTURE as EAGLE3
from .engine.memory import resolve_device
from .engine.model_runner import RunnerConfig
from .engine.quant import Quantization, resolve as resolve_quantize
from .router.config import RouterConfig, from_json, to_json
from .rpc.serving import ServerConfig
from .supervisor import Child, RestartPolicy, die_with_parent
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
    heads: dict[str, str] | None = None
    """EAGLE-3 draft heads the verifier serves (drafting inside it), name -> checkpoint
    directory; None: the family's (``family_heads``), or none with a ``target`` of one's own
    (a head belongs to the target it was trained for)."""
    colocate: tuple[str, ...] = ()
    """Draft models served ('all': every one) loaded inside the verifier instead of as services:
    each drafts after the verdict, in the verifier's call (``engine/colocated.py``)."""
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
    takes them (whole, in ``log_dir/router.json``). ``serve`` fills in ``verifier``
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
    drafts on CPU, the same output; only on the CPU in float32), or 'auto' (int8 where the
    drafters run on the CPU in float32 and this torch has the kernels, else none). The cost
    model is measured again when its file was measured with other drafter weights."""
    step_times: Literal["auto", "measure", "off"] = "auto"
    """What each service does with its step times at start (``spin verifier --step-times``):
    'auto' loads them from the cache of an earlier start or measures them (tens of seconds per
    service on a CPU), 'measure' always measures, 'off' reports none (the router then needs a
    cost model file, or plans k from its batch-size table: enough for ``policy="fixed"``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every child (e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT``), over this
    process's."""
    tls_cert: str | None = None
    """The router's TLS certificate chain (PEM), for gRPC and HTTP; None: plaintext."""
    tls_key: str | None = None
    """Its private key (PEM)."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """When ``serve`` restarts a child that exited (``supervisor.py``)."""


VERIFIER_GPU_SHARE = 0.75
"""On one GPU shared by every service, the verifier's share of ``--gpu-memory-utilization``;
the drafters split the rest equally."""


def service_runner(runner: RunnerConfig, kv_cache_memory: int | None, gpu_share: float,
                   quantize: str = "none") -> RunnerConfig:
    """``runner`` for one service on the shared machine: its own KV cache budget and weights,
    and ``gpu_share`` of ``gpu_memory_utilization`` (to 4 decimals, as ``plan`` plans it)."""
    return replace(runner, kv_cache_memory=kv_cache_memory, quantize=quantize,
                   gpu_memory_utilization=float(f"{runner.gpu_memory_utilization * gpu_share:.4f}"))


def drafter_quantization(cfg: ServeConfig, device: torch.device | None = None) -> Quantization:
    """The drafters' weights: ``drafter_quantize`` resolved for their ``device`` (default: what
    ``runner.device`` is on this machine) and ``runner.dtype`` (``quant.resolve``: 'auto' is
    int8 only on the CPU in float32). ValueError naming the flags for an 'int8' that cannot run
    there, so that ``spin serve`` refuses it before any child starts."""
    if device is None:
        device = resolve_device(cfg.runner.device)
    try:
        return resolve_quantize(cfg.drafter_quantize, device, cfg.runner.dtype)
    except ValueError:
        where = "" if str(device) == cfg.runner.device else f" (here {device})"
        raise ValueError(
            f"--drafter-quantize {cfg.drafter_quantize} needs --device cpu and --dtype float32 "
            f"(or auto): int8 weights run on the CPU in float32 only, and these drafters would "
            f"run with --device {cfg.runner.device}{where} --dtype {cfg.runner.dtype}; use "
            f"--drafter-quantize auto (int8 only where it can run) or none") from None


def runner_argv(runner: RunnerConfig) -> list[str]:
    """``runner`` as the flags ``cli.flags.runner_config`` reads back (``--quantize`` only when
    it is not 'none': a drafter's parser has it, the others do not)."""
    argv = ["--device", runner.device, "--dtype", runner.dtype,
            "--gpu-memory-utilization", repr(runner.gpu_memory_utilization),
            "--max-seqs", str(runner.max_seqs), "--block-size", str(runner.block_size)]
    if runner.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(runner.kv_cache_memory)]
    if runner.max_model_len is not None:
        argv += ["--max-model-len", str(runner.max_model_len)]
    if runner.quantize != "none":
        argv += ["--quantize", runner.quantize]
    argv += ["--cuda-graphs" if runner.cuda_graphs else "--no-cuda-graphs",
             "--compile" if runner.compile else "--no-compile", "--attention", runner.attention,
             "--prefix-caching" if runner.prefix_caching else "--no-prefix-caching"]
    return argv


def server_argv(server: ServerConfig, cpus: list[int] | None = None) -> list[str]:
    """``server`` (and the cores ``cpus``, None = all) as the flags ``cli.flags.service_flags``
    parses (``cli.flags.server_config`` reads them back)."""
    argv = ["--host", server.host, "--port", str(server.port), "--grace", repr(server.grace_s)]
    if server.metrics_port is not None:
        argv += ["--metrics-port", str(server.metrics_port)]
    if cpus is not None:
        argv += ["--cpus", format_cpus(cpus)]
    if server.tls_cert:
        argv += ["--tls-cert", server.tls_cert, "--tls-key", server.tls_key or ""]
    return argv


def models(cfg: ServeConfig) -> tuple[str, dict[str, str]]:
    """The target's checkpoint and the draft models (name -> checkpoint) ``cfg`` serves."""
    target = cfg.target or str(cfg.family_dir / "target")
    if cfg.drafter_models is not None:
        return target, dict(cfg.drafter_models)
    names = cfg.drafters if cfg.drafters is not None else family_members(cfg.family_dir)
    return target, {n: str(cfg.family_dir / n) for n in names}


def colocated_names(cfg: ServeConfig) -> list[str]:
    """The draft models loaded inside the verifier; ValueError naming one not served."""
    served = list(models(cfg)[1])
    if unknown := sorted(set(cfg.colocate) - set(served) - {"all"}):
        raise ValueError(f"--colocate {', '.join(unknown)}: not a draft model served here "
                         f"({', '.join(served) or 'none'})")
    return served if "all" in cfg.colocate else list(dict.fromkeys(cfg.colocate))


def family_heads(family_dir: Path) -> dict[str, str]:
    """The EAGLE-3 heads of a family: its directories whose config names that architecture."""
    out = {}
    for p in sorted(family_dir.iterdir()) if family_dir.is_dir() else ():
        cfg = p / "config.json"
        if cfg.is_file() and EAGLE3 in json.loads(cfg.read_text()).get("architectures", ()):
            out[p.name] = str(p)
    return out


def served_heads(cfg: ServeConfig) -> dict[str, str]:
    """The draft heads ``cfg`` serves, name -> checkpoint directory."""
    if cfg.heads is not None:
        return dict(cfg.heads)
    return family_heads(cfg.family_dir) if cfg.target is None else {}


def head_argv(cfg: ServeConfig) -> list[str]:
    """The verifier's ``--head`` flags."""
    return [a for name, path in served_heads(cfg).items() for a in ("--head", f"{name}={path}")]


def spin_argv(*args: str) -> list[str]:
    """The command line of ``spin ARGS`` in a child process (this interpreter)."""
    return [sys.executable, "-m", "spin", *args]


class Embedded:
    """The running children (a context manager; also used by the tests and benchmarks)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.redis = None
        self.router: Child | None = None
        self.timeout_s = 180.0
        """How long each child may take to say it serves."""
        self._router_env: dict[str, str] = {}

    @property
    def endpoint(self) -> str:
        return f"{self.cfg.host}:{self.router.port}"

    @property
    def router_config_path(self) -> Path:
        """The router's whole configuration (``spin router --config``)."""
        return self.cfg.log_dir / "router.json"

    def child(self, role: str, name: str) -> Child:
        """The child of ``role`` named ``name`` (the verifier: ``child("verifier", "verifier")``)."""
        return next(c for c in self.children
                    if c.role == f"{role}-{name}" or c.role == role == name)

    def start(self, timeout_s: float = 180.0) -> Embedded:
        """Start redis-server, the verifier and drafters, then the router; each waited for.
        ValueError (before anything starts) for drafters that cannot run or are not served."""
        cfg, self.timeout_s = self.cfg, timeout_s
        quantize = drafter_quantization(cfg)
        colocated_names(cfg)
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        # PASSIVE: an idle OpenMP pool sleeps instead of spinning. The processes take turns on
        # the same cores (draft, then verify), and a spinning pool would steal them from the one
        # computing (measured: single stream 151 vs 120 tokens/s on 2 cores). GOMP_SPINCOUNT: it
        # spins a little first, so a forward's next operator finds its threads awake (`spin
        # bench services` 0.87-0.88x in process against 0.71-0.76x sleeping at once; 3,000:
        # 0.84x; 30,000: 0.81-0.85x; each service computes on one ``torch_worker`` thread).
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                   GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", "10000"))
        env.pop("OTEL_SERVICE_NAME", None)  # each child's default names its role
        env.update(cfg.env)
        try:
            redis_url = self._start_redis()
            side_cpus, verifier_cpus = (None, None) if cfg.cpus == "shared" \
                else split(available_cpus())
            target = self._start_models(env, quantize, side_cpus, verifier_cpus)
            self._start_router(env, target, redis_url, side_cpus)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_models(self, env: dict[str, str], quantize: str, side_cpus: list[int] | None,
                      verifier_cpus: list[int] | None) -> str:
        """Start the verifier and the drafters and wait until they serve; the target's
        checkpoint."""
        cfg = self.cfg
        target, drafter_models = models(cfg)
        colocate = [a for n in colocated_names(cfg)
                    for a in ("--colocate", f"{n}={drafter_models.pop(n)}")]
        threads = len(verifier_cpus) if verifier_cpus is not None else cfg.threads
        share = (VERIFIER_GPU_SHARE, (1 - VERIFIER_GPU_SHARE) / max(1, len(drafter_models)))
        loopback = ServerConfig(port=0, metrics_port=0)
        verifier = service_runner(cfg.runner, cfg.runner.kv_cache_memory, share[0])
        self.children.append(Child("verifier", spin_argv(
            "verifier", "--model", target, "--threads", str(threads), *head_argv(cfg),
            *colocate, *(("--colocate-quantize", quantize) if colocate else ()),
            "--step-times", cfg.step_times,
            *server_argv(loopback, verifier_cpus), *runner_argv(verifier)), cfg.log_dir, env))
        drafter = service_runner(cfg.runner, cfg.drafter_kv_cache_memory, share[1], quantize)
        for name, model in drafter_models.items():
            self.children.append(Child(f"drafter-{name}", spin_argv(
                "drafter", "--model", model, "--name", name, "--threads",
                str(cfg.drafter_threads), "--step-times", cfg.step_times,
                *server_argv(loopback, side_cpus),
                *runner_argv(drafter)), cfg.log_dir, env))
        for c in self.children:
            c.wait_ready(self.timeout_s)
        return target

    def _start_router(self, env: dict[str, str], target: str, redis_url: str | None,
                      side_cpus: list[int] | None) -> None:
        """Write the router's config file, start it over the running services, wait for it,
        then write its HTTP port into the file (a restart keeps the port)."""
        cfg = self.cfg
        http_port = cfg.http_port if cfg.http_port is not None else (8000 if cfg.port else 0)
        router = replace(
            cfg.router, verifier=f"127.0.0.1:{self.children[0].port}", api_key=None,
            http_port=None if cfg.router.http_port is None else http_port,
            tokenizer=cfg.router.tokenizer or target,
            drafters={c.role.removeprefix("drafter-"): f"127.0.0.1:{c.port}"
                      for c in self.children[1:]},
            redis_url=redis_url or cfg.router.redis_url,
            stats_spill=cfg.router.stats_spill or str(cfg.log_dir / "stats-pending.json"))
        if router.scheduler.suffix_share and not router.redis_url:
            raise RuntimeError("--suffix-share shares through Redis, and no redis-server binary "
                               "was found (install redis-server)")
        self.router_config_path.write_text(to_json(router))
        server = ServerConfig(host=cfg.host, port=cfg.port, metrics_port=cfg.metrics_port,
                              tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        self._router_env = dict(env)  # the key goes in the environment, never in a file
        if cfg.router.api_key:
            self._router_env["SPIN_API_KEY"] = cfg.router.api_key
        self.router = self._router_child("router", self.router_config_path,
                                         server_argv(server, side_cpus))
        if router.http_port is not None and self.router.http_port != router.http_port:
            self.router_config_path.write_text(to_json(replace(
                router, http_port=self.router.http_port)))

    def add_router(self, role: str = "router-2",
                   edit: Callable[[RouterConfig], RouterConfig] | None = None) -> Child:
        """Another router replica over the running services and Redis, as a cluster runs
        several (free ports, no HTTP API, a spill file of its own; ``edit``: changes to the
        first router's config): stopped with the rest."""
        cfg = replace(from_json(self.router_config_path.read_text()), http_port=None,
                      stats_spill=str(self.cfg.log_dir / f"{role}-stats-pending.json"))
        path = self.cfg.log_dir / f"{role}.json"
        path.write_text(to_json(edit(cfg) if edit is not None else cfg))
        return self._router_child(role, path, server_argv(ServerConfig(self.cfg.host, 0, 0)))

    def _router_child(self, role: str, config: Path, server: list[str]) -> Child:
        child = Child(role, spin_argv("router", "--config", str(config), *server),
                      self.cfg.log_dir, self._router_env)
        self.children.append(child)  # stopped with the rest, started or not
        child.wait_ready(self.timeout_s)
        return child

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
        """The routers first, one by one (their requests drain), then the services all at once,
        each exiting on its own (one after another, their exits added up)."""
        routers = [c for c in self.children if c.role.startswith("router")]
        for c in routers:
            c.stop(grace_s)
        services = [c for c in self.children if c not in routers]
        for c in services:
            c.terminate()
        for c in services:
            c.stop(grace_s)
        self.children = []
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Embedded:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

