"""``spin router``: the client-facing ``spin.v1.Generation`` service over the scheduler.

Validates each request (INVALID_ARGUMENT with a message for anything malformed: ``validation.py``,
and ``rpc/decode.py`` for bytes that do not even parse), admits it into a bounded queue
(RESOURCE_EXHAUSTED beyond it), and streams its tokens as the scheduler accepts them: the
scheduler's plain stream events (``streaming.py``) become ``GenerateResponse`` messages here, and
a ``RequestError`` the call's status. A client that cancels or runs past its deadline frees
the request's caches in every service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from transformers import AutoTokenizer

from ..engine.translate import Translator
from ..engine.vocab import TokenizerId, identify, incompatibility
from ..obs import metrics
from ..policy.base import FixedPolicy, Policy
from ..timing.cost_model import CostModel
from ..rpc.convert import logprobs_to_proto
from ..rpc.decode import add_servicer
from ..rpc.serving import Hooks, ServerConfig, announce, serve
from ..v1 import generation_pb2, generation_pb2_grpc
from .admission import KVBudget
from .clients import ServiceDown
from .config import RouterConfig
from .cost import ReplicaCosts
from .discovery import Endpoints, KubernetesDiscovery
from .frontend import STATUS, Frontend, RequestFailed
from .pool import ReplicaPool
from .scheduler import Scheduler
from .services import DrafterClients, VerifierClient
from .streaming import Chunk

FINISH = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP}
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
"""The service this module serves."""
log = logging.getLogger(__name__)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """``spin.v1.Generation`` over the router's ``Frontend``: register it with ``add_servicer``
    (``rpc/decode.py``), so that a request that does not even parse is answered
    INVALID_ARGUMENT too."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        """Stream one request's tokens (module docstring)."""
        try:
            req = self.frontend.submit(request)
        except RequestFailed as e:
            await context.abort(STATUS[e.code], e.message)
        async with contextlib.aclosing(self.frontend.events(req)) as events:
            try:
                async for chunk in events:
                    yield response(chunk)
            except RequestFailed as e:
                await context.abort(STATUS[e.code], e.message)


def response(c: Chunk) -> generation_pb2.GenerateResponse:
    """The message a client receives for a stream event."""
    st = c.step
    msg = generation_pb2.GenerateResponse(
        request_id=c.request_id, token_ids=c.token_ids, text=c.text,
        step=generation_pb2.StepInfo(
            drafter=st.drafter, k=st.k, draft_tokens=st.draft_tokens,
            accepted_tokens=st.accepted_tokens, step_seconds=st.step_seconds,
            predicted_step_seconds=st.predicted_step_seconds, batch_size=st.batch_size))
    if c.logprobs is not None:
        logprobs_to_proto(c.logprobs, msg.logprobs)
    if c.finish is not None:
        msg.finish_reason = FINISH[c.finish]
    if c.usage is not None:
        msg.usage.prompt_tokens = c.usage.prompt_tokens
        msg.usage.completion_tokens = c.usage.completion_tokens
    if c.speculation is not None:
        s, spec = msg.speculation, c.speculation
        s.steps, s.steps_without_speculation = spec.steps, spec.steps_without_speculation
        s.draft_tokens, s.accepted_tokens, s.tau = spec.draft_tokens, spec.accepted_tokens, spec.tau
        for d in spec.drafters:
            s.drafters.add(drafter=d.drafter, steps=d.steps, draft_tokens=d.draft_tokens,
                           accepted_tokens=d.accepted_tokens)
    return msg


def _policy(cfg: RouterConfig, store, cost: CostModel | None) -> Policy:
    if cfg.policy == "fixed":
        return FixedPolicy(cfg.default_drafter, cfg.default_k)
    from ..policy.goodput import ControllerConfig
    from ..policy.learned import LearnedPolicy, learned_config

    if cost is None:
        log.warning("no cost model: k comes from the batch-size table until one is fitted")
    pipelined = cfg.scheduler.micro_batches > 1  # step time = max(draft, verify), not the sum
    cfg_ = learned_config(cfg.policy_config, controller=ControllerConfig(pipelined=pipelined))
    return LearnedPolicy(cfg_, cost=cost, population=store.population)


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


def _tokenizer_id(info) -> TokenizerId | None:
    """The tokenizer a drafter or verifier reported, or None (it has none)."""
    if not info.tokenizer_fingerprint:
        return None
    return TokenizerId(info.tokenizer, info.tokenizer_size, info.tokenizer_fingerprint)


async def _check_drafter(name: str, pool: ReplicaPool, target: tuple[TokenizerId, int],
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
    draft = _tokenizer_id(d)
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


async def _main(cfg: RouterConfig, server_cfg: ServerConfig, policy: Policy | None,
                tokenizer) -> None:
    from ..stats import open_stats_store

    verifier = ReplicaPool("target", "verifier", [cfg.verifier] if cfg.verifier else [])
    drafters = {name: ReplicaPool(name, "drafter", [addr]) for name, addr in cfg.drafters.items()}
    rejected: set[str] = set()
    checks: set[asyncio.Task] = set()
    vocab: list[tuple[TokenizerId, int]] = []  # the target's tokenizer and rows, once known
    translators: dict[str, Translator] = {}  # drafters with another tokenizer the router reads
    costs = ReplicaCosts(cfg.cost_model, cfg.rpc_overhead_s)

    def check(name: str, pool: ReplicaPool) -> None:
        task = asyncio.create_task(_check_drafter(name, pool, vocab[0], drafters, rejected,
                                                  tokenizer, translators, costs))
        checks.add(task)
        task.add_done_callback(checks.discard)

    def on_endpoints(eps: Endpoints) -> None:
        verifier.set_addresses(eps.verifier)
        for name in sorted(set(drafters) | set(eps.drafters)):
            if name in rejected:
                continue
            if name not in drafters:
                drafters[name] = ReplicaPool(name, "drafter")
                if vocab:
                    check(name, drafters[name])
            drafters[name].set_addresses(eps.drafters.get(name, set()))

    discovery = None
    if cfg.kubernetes is not None:
        discovery = KubernetesDiscovery(cfg.kubernetes, on_endpoints)
        log.info("discovering replicas in namespace %s with %s", discovery.namespace,
                 cfg.kubernetes.label_selector)
        discovery.start()
    info = await _wait_for_verifier(verifier)
    target_tokenizer = identify(tokenizer)
    served = _tokenizer_id(info)
    if served is not None and served.fingerprint != target_tokenizer.fingerprint:
        log.warning("the router's tokenizer %s is not the verifier's %s: prompts are tokenized "
                    "and outputs decoded with the router's", target_tokenizer.describe(),
                    served.describe())
    vocab.append((target_tokenizer, info.vocab_size))
    costs.verifier(info)
    log.info("target %s (%s on %s, %s): %d KV blocks of %d tokens, max model len %d",
             info.name, info.model_path, info.device or "?", info.dtype or "?", info.num_blocks,
             info.block_size, info.max_context)
    for name, pool in list(drafters.items()):
        check(name, pool)
    sched_cfg = cfg.scheduler
    sched_cfg.max_batch = min(sched_cfg.max_batch, info.max_requests)
    store = (open_stats_store(cfg.redis_url, on_error=lambda _: metrics.STATS_STORE_ERRORS.inc(),
                              spill_path=cfg.stats_spill, on_lost=metrics.STATS_STEPS_LOST.inc)
             if cfg.redis_url else open_stats_store(None))
    if policy is None:
        policy = _policy(cfg, store, costs.model())
    costs.on_model = policy.set_cost_model
    scheduler = Scheduler(sched_cfg, VerifierClient(verifier), DrafterClients(drafters), policy,
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          tokenizer.eos_token_id, store,
                          KVBudget(info.block_size, info.num_blocks, info.num_blocks),
                          translators)
    frontend = Frontend(scheduler, tokenizer, info.max_context, info.vocab_size)
    service = GenerationService(frontend)
    loop_task = asyncio.create_task(scheduler.run())

    async def after_stop() -> None:  # server.stop() let in-flight streams finish first
        if discovery is not None:
            discovery.stop()
        scheduler.stop()
        await loop_task
        store.close()
        for c in [verifier, *drafters.values()]:
            await c.close()

    http = _http_server(cfg, server_cfg, frontend, info.name, verifier)
    http_port = [0]

    async def start_http() -> None:
        if http is not None:
            http_port[0] = await http.start()
            log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if
                     server_cfg.tls_cert else "http", server_cfg.host, http_port[0])

    async def stop_all() -> None:
        if http is not None:
            await http.stopped()  # its running responses finish before the scheduler stops
        await after_stop()

    server_cfg.service_names = [GENERATION.full_name]
    server_cfg.trace_service, server_cfg.trace_redis = "spin-router", True
    server_cfg.api_key = cfg.api_key
    await serve(server_cfg, lambda s: add_servicer(service, GENERATION, s),
                hooks=Hooks(on_ready=announce("router", http_port=lambda: http_port[0]),
                            before_ready=start_http, after_stop=stop_all,
                            on_stop=http.begin_stop if http is not None else None))


def _http_server(cfg: RouterConfig, server_cfg: ServerConfig, frontend: Frontend, target: str,
                 verifier: ReplicaPool):
    """The OpenAI-compatible API's server (not started), or None without one."""
    if cfg.http_port is None:
        return None
    from ..openai_api.app import create_app
    from ..openai_api.chat import ChatTemplate
    from ..openai_api.server import HttpConfig, HttpServer

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


def run(cfg: RouterConfig, server_cfg: ServerConfig, policy: Policy | None = None) -> None:
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    except (OSError, ValueError) as e:
        raise SystemExit(f"no tokenizer at {cfg.tokenizer}: {e}") from None
    asyncio.run(_main(cfg, server_cfg, policy, tokenizer))
