"""The ``spin router`` process: the composition root that builds the router and runs it.

It finds the replicas (static addresses or Kubernetes discovery), waits for a verifier, checks
every drafter's tokenizer against the target's (``engine/vocab.py``; one with another tokenizer
the router can read drafts through token translation, one it cannot is never used), fits the
cost model from what the replicas report (``router/cost.py``), then builds the scheduler, its
``Frontend``, the gRPC adapter (``router/server.py``) and the OpenAI-compatible HTTP adapter
(``openai_api/``), and serves both on one event loop until SIGTERM, when running streams finish
before the scheduler stops. Only this module knows every piece: the router package knows
neither adapter, and the adapters know only the ``Frontend``.
"""

from __future__ import annotations

import asyncio
import logging

from transformers import AutoTokenizer

from .engine.suffix_decoding import SuffixStore
from .engine.translate import Translator
from .engine.vocab import TokenizerId, identify, incompatibility
from .obs import metrics
from .openai_api.app import create_app
from .openai_api.chat import ChatTemplate
from .openai_api.server import HttpConfig, HttpServer
from .policy.base import FixedPolicy, Policy
from .router.admission import KVBudget
from .router.config import RouterConfig, SchedulerConfig, unknown_default_drafter
from .router.cost import ReplicaCosts
from .router.discovery import Endpoints, KubernetesDiscovery
from .router.frontend import Frontend
from .router.pool import ReplicaPool
from .router.prediction_proposer import PredictedOutputs
from .router.proposers import DraftHead, PromptLookup, Proposer, Proposers
from .router.structured import GrammarDrafts
from .router.suffix_proposer import SuffixDecoding
from .router.scheduler import Scheduler
from .router.server import GENERATION, GenerationService
from .router.clients import ServiceDown
from .router.services import DrafterClients, VerifierClient
from .rpc.decode import add_servicer
from .rpc.serving import Hooks, ServerConfig, announce, serve
from .stats import StatsStore, open_stats_store
from .stats.suffix_share import SuffixShare
from .timing.cost_model import CostModel

log = logging.getLogger(__name__)


def run(cfg: RouterConfig, server_cfg: ServerConfig, policy: Policy | None = None) -> None:
    """Serve the router until SIGTERM (``policy``: instead of the one ``cfg`` describes)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    except (OSError, ValueError) as e:
        raise SystemExit(f"no tokenizer at {cfg.tokenizer}: {e}") from None
    asyncio.run(_main(cfg, server_cfg, policy, tokenizer))


class Replicas:
    """The verifier and drafter replicas the router uses, kept up to date by discovery; every
    drafter checked before it is used (``check_drafter``)."""

    def __init__(self, cfg: RouterConfig, tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        """The target's tokenizer, as the router reads it."""
        self.verifier = ReplicaPool("target", "verifier", [cfg.verifier] if cfg.verifier else [])
        self.drafters = {name: ReplicaPool(name, "drafter", [addr])
                         for name, addr in cfg.drafters.items()}
        """Drafter name -> its replicas (a refused drafter is removed)."""
        self.rejected: set[str] = set()
        """Drafters that cannot draft for the target (never used)."""
        self.translators: dict[str, Translator] = {}
        """Drafters with another tokenizer that the router reads, by name."""
        self.costs = ReplicaCosts(cfg.cost_model, cfg.rpc_overhead_s)
        self.discovery: KubernetesDiscovery | None = None
        self._target: tuple[TokenizerId, int] | None = None  # tokenizer and rows, once known
        self._checks: set[asyncio.Task] = set()

    async def start(self):
        """Start discovery (if configured), wait for a verifier, check the drafters; the target's
        model info."""
        if self.cfg.kubernetes is not None:
            self.discovery = KubernetesDiscovery(self.cfg.kubernetes, self.on_endpoints)
            log.info("discovering replicas in namespace %s with %s", self.discovery.namespace,
                     self.cfg.kubernetes.label_selector)
            self.discovery.start()
        info = await _wait_for_verifier(self.verifier)
        target_tokenizer = identify(self.tokenizer)
        served = tokenizer_id(info)
        if served is not None and served.fingerprint != target_tokenizer.fingerprint:
            log.warning("the router's tokenizer %s is not the verifier's %s: prompts are "
                        "tokenized and outputs decoded with the router's",
                        target_tokenizer.describe(), served.describe())
        self._target = (target_tokenizer, info.vocab_size)
        self.costs.verifier(info)
        log.info("target %s (%s on %s, %s): %d KV blocks of %d tokens, max model len %d",
                 info.name, info.model_path, info.device or "?", info.dtype or "?",
                 info.num_blocks, info.block_size, info.max_context)
        for name, pool in list(self.drafters.items()):
            self._check(name, pool)
        return info

    def on_endpoints(self, eps: Endpoints) -> None:
        """Discovery's new picture: the pools' addresses; a new drafter is checked."""
        self.verifier.set_addresses(eps.verifier)
        for name in sorted(set(self.drafters) | set(eps.drafters)):
            if name in self.rejected:
                continue
            if name not in self.drafters:
                self.drafters[name] = ReplicaPool(name, "drafter")
                if self._target is not None:
                    self._check(name, self.drafters[name])
            self.drafters[name].set_addresses(eps.drafters.get(name, set()))

    def _check(self, name: str, pool: ReplicaPool) -> None:
        task = asyncio.create_task(check_drafter(
            name, pool, self._target, self.drafters, self.rejected, self.tokenizer,
            self.translators, self.costs))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def stop_discovery(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()

    async def close(self) -> None:
        """Close every pool (after ``stop_discovery``)."""
        for pool in [self.verifier, *self.drafters.values()]:
            await pool.close()


def local_proposers(cfg: SchedulerConfig,
                    share: SuffixShare | None = None) -> tuple[Proposer, ...]:
    """The router's model-free proposers that ``cfg`` offers: prompt lookup, suffix decoding
    (its store shared by every request of this router, and through ``share`` with the other
    routers), Predicted Outputs (requests with a prediction), the grammar's forced tokens
    (structured-output requests)."""
    return (((PromptLookup(),) if cfg.prompt_lookup else ())
            + ((SuffixDecoding(SuffixStore(cfg.suffix_store_tokens), share),)
               if cfg.suffix_decoding else ())
            + ((PredictedOutputs(),) if cfg.predicted_outputs else ())
            + ((GrammarDrafts(),) if cfg.grammar_drafts else ()))


async def _main(cfg: RouterConfig, server_cfg: ServerConfig, policy: Policy | None,
                tokenizer) -> None:
    replicas = Replicas(cfg, tokenizer)
    info = await replicas.start()
    sched_cfg = cfg.scheduler
    sched_cfg.max_batch = min(sched_cfg.max_batch, info.max_requests)
    store = _stats_store(cfg)
    if policy is None:
        policy = _policy(cfg, store, replicas.costs.model())
    replicas.costs.on_model = policy.set_cost_model
    if problem := unknown_default_drafter(cfg, list(info.heads)):
        raise SystemExit(f"spin router: {problem}")
    heads = tuple(DraftHead(n, lambda: replicas.verifier.available) for n in info.heads)
    if heads:
        log.info("the verifier serves draft heads %s", ", ".join(info.heads))
    share = _suffix_share(cfg, info)
    proposers = Proposers(DrafterClients(replicas.drafters), replicas.translators,
                          local_proposers(sched_cfg, share) + heads)
    scheduler = Scheduler(sched_cfg, VerifierClient(replicas.verifier), proposers, policy,
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          tokenizer.eos_token_id, store,
                          KVBudget(info.block_size, info.num_blocks, info.num_blocks))
    frontend = Frontend(scheduler, tokenizer, info.max_context, info.vocab_size)
    service = GenerationService(frontend)
    loop_task = asyncio.create_task(scheduler.run())
    http = _http_server(cfg, server_cfg, frontend, info.name, replicas.verifier)
    http_port = [0]

    async def start_http() -> None:
        if http is not None:
            http_port[0] = await http.start()
            log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if
                     server_cfg.tls_cert else "http", server_cfg.host, http_port[0])

    async def stop_all() -> None:  # server.stop() let in-flight gRPC streams finish first
        if http is not None:
            await http.stopped()  # its running responses finish before the scheduler stops
        replicas.stop_discovery()
        scheduler.stop()
        await loop_task
        store.close()
        if share is not None:
            share.close()
        await replicas.close()

    server_cfg.service_names = [GENERATION.full_name]
    server_cfg.trace_service, server_cfg.trace_redis = "spin-router", True
    server_cfg.api_key = cfg.api_key
    await serve(server_cfg, lambda s: add_servicer(service, GENERATION, s),
                hooks=Hooks(on_ready=announce("router", http_port=lambda: http_port[0]),
                            before_ready=start_http, after_stop=stop_all,
                            on_stop=http.begin_stop if http is not None else None))


def _stats_store(cfg: RouterConfig) -> StatsStore:
    """The acceptance statistics: Redis (errors and lost steps counted), else in process."""
    if not cfg.redis_url:
        return open_stats_store(None)
    return open_stats_store(cfg.redis_url, on_error=lambda _: metrics.STATS_STORE_ERRORS.inc(),
                            spill_path=cfg.stats_spill, on_lost=metrics.STATS_STEPS_LOST.inc)


def _suffix_share(cfg: RouterConfig, info) -> SuffixShare | None:
    """Suffix decoding's texts shared through Redis (``--suffix-share``), in a stream of the
    target's tokenizer (by its fingerprint, else its name and size), or None."""
    sched = cfg.scheduler
    if not (sched.suffix_share and cfg.redis_url):
        return None
    if not sched.suffix_decoding:
        log.warning("--suffix-share has nothing to share with --no-suffix-decoding")
        return None
    namespace = info.tokenizer_fingerprint or f"{info.tokenizer}:{info.tokenizer_size}"
    return SuffixShare(cfg.redis_url, namespace, max_entries=sched.suffix_share_entries,
                       seed_tokens=sched.suffix_store_tokens,
                       on_error=lambda _: metrics.SUFFIX_SHARE_ERRORS.inc(),
                       on_texts=lambda event, n: metrics.SUFFIX_SHARE_TEXTS.labels(event).inc(n))


def _policy(cfg: RouterConfig, store: StatsStore, cost: CostModel | None) -> Policy:
    if cfg.policy == "fixed":
        return FixedPolicy(cfg.default_drafter, cfg.default_k)
    from .policy.goodput import ControllerConfig
    from .policy.learned import LearnedPolicy, learned_config

    if cost is None:
        log.warning("no cost model: k comes from the batch-size table until one is fitted")
    pipelined = cfg.scheduler.micro_batches > 1  # step time = max(draft, verify), not the sum
    cfg_ = learned_config(cfg.policy_config, controller=ControllerConfig(pipelined=pipelined))
    return LearnedPolicy(cfg_, cost=cost, population=store.population)


def _http_server(cfg: RouterConfig, server_cfg: ServerConfig, frontend: Frontend, target: str,
                 verifier: ReplicaPool) -> HttpServer | None:
    """The OpenAI-compatible API's server (not started), or None without one."""
    if cfg.http_port is None:
        return None
    try:
        chat = ChatTemplate(frontend.tokenizer, cfg.chat_template)
    except OSError as e:
        raise SystemExit(f"cannot read --chat-template {cfg.chat_template}: {e}") from None
    if not chat.available:
        log.warning("the tokenizer has no chat template: /v1/chat/completions answers 400 "
                    "(--chat-template FILE adds one)")
    app = create_app(frontend, chat, cfg.served_model_name or target, cfg.api_key,
                     lambda: verifier.available)
    return HttpServer(app, HttpConfig(server_cfg.host, cfg.http_port, server_cfg.tls_cert,
                                      server_cfg.tls_key, server_cfg.grace_s))


async def _wait_for_verifier(verifier: ReplicaPool):
    """The target's model info, once some verifier replica answers (discovery may take a while)."""
    waited = 0.0
    while True:
        if verifier.replicas:
            try:
                return await verifier.info(timeout_s=120)
            except ServiceDown as e:
                log.warning("%s", e)
        if waited % 30 == 0:
            log.info("waiting for a verifier replica (%.0f s so far)", waited)
        await asyncio.sleep(2.0)
        waited += 2.0


def tokenizer_id(info) -> TokenizerId | None:
    """The tokenizer a drafter or verifier reported, or None (it has none)."""
    if not info.tokenizer_fingerprint:
        return None
    return TokenizerId(info.tokenizer, info.tokenizer_size, info.tokenizer_fingerprint)


async def check_drafter(name: str, pool: ReplicaPool, target: tuple[TokenizerId, int],
                        drafters: dict[str, ReplicaPool], rejected: set[str],
                        tokenizer=None, translators: dict[str, Translator] | None = None,
                        costs: ReplicaCosts | None = None) -> None:
    """A drafter must tokenize as the target does (same tokens, whatever its embedding padding:
    ``engine/vocab.py``), or have a tokenizer of its own that the router can load (from the
    ``model_path`` it reports): then it drafts through token translation (``tokenizer`` is the
    target's; the drafter's ``Translator`` goes into ``translators``). One that can do neither is
    never used, and the log says why. A drafter that is used reports its step times to
    ``costs``."""
    try:
        d = await pool.info(timeout_s=60)
    except ServiceDown as e:
        log.warning("drafter %s is not reachable yet (%s)", name, e)
        return
    metrics.DRAFTER_UP.labels(name).set(1)
    draft = tokenizer_id(d)
    why = incompatibility(target[0], target[1], draft, d.vocab_size)
    if why is not None and None not in (target[0], draft, tokenizer, translators):
        translator, problem = await asyncio.to_thread(_translator, tokenizer, d.model_path, draft)
        if translator is not None:
            translators[name] = translator
            log.warning("drafter %s (%s) drafts through token translation: %s; the router "
                        "re-tokenises its drafts into the target's tokens", name, d.model_path,
                        why)
            why = None
        else:
            why += f"; translation needs the drafter's tokenizer files on the router ({problem})"
    if why is not None:
        log.error("drafter %s (%s) cannot draft for the target: %s; not using it", name,
                  d.model_path, why)
        rejected.add(name)
        if drafters.get(name) is pool:
            del drafters[name]
            await pool.close()
    elif costs is not None:
        costs.drafter(name, d)


def _translator(tokenizer, path: str, draft: TokenizerId) -> tuple[Translator | None, str]:
    """A translator from the target's ``tokenizer`` to the drafter's, loaded from its checkpoint
    ``path`` as the router sees it (local files only: nothing is downloaded); (None, why not) when
    there is none there or it is not the tokenizer the drafter reported."""
    if not path:
        return None, "the drafter reported no checkpoint path"
    try:
        theirs = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        return None, f"none loads from {path}: {str(e).splitlines()[0] if str(e) else e!r}"
    seen = identify(theirs)
    if seen.fingerprint != draft.fingerprint:
        return None, f"{path} holds {seen.describe()} here, not the drafter's"
    return Translator(tokenizer, theirs), ""
