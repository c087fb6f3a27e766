"""``spin bench services``: the same generation in process and through the gRPC services.

Single stream, greedy, one drafter and k, held-out prompts, ``new_tokens`` each (EOS ignored). Per
prompt, alternately: the in-process engine (``SpecEngine``) and the embedded services
(``spin serve``'s processes), with speculation on and off. Reported: tokens/s of each, the ratio
services / in-process, and the router's per-step time split from its own metrics, diffed over the
runs with speculation on and off separately: step, waiting for drafts, waiting for verification,
and the step time not spent computing inside the drafter or verifier (RPC round trips,
serialisation, the router's bookkeeping) as the per-step RPC overhead. With speculation off a
router step is one verifier call of ``SchedulerConfig.plain_steps`` plain forwards (the
services' default), the in-process engine's one forward.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from tqdm import tqdm
from transformers import AutoTokenizer

from ..engine.drafter import ModelDrafter, PromptLookupDrafter
from ..engine.engine import GenerationRequest, SpecEngine, StepTimes
from ..engine.model_runner import RunnerConfig
from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..engine.quant import Quantization
from ..engine.verifier import Verifier
from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig, drafter_quantization
from ..v1 import generation_pb2, generation_pb2_grpc
from ..zoo.corpus import heldout_prompts
from ..zoo.report import family_members
from ..zoo.specs import FAMILY_DIR
from .scrape import scrape


@dataclass
class ServicesBenchConfig:
    """What the services benchmark runs."""

    family_dir: Path = FAMILY_DIR
    drafter: str | None = None
    """Drafter used on both sides (a model drafter: its RPCs are what is measured); None: the
    family's first draft model, by name."""
    k: int = 4
    new_tokens: int = 128
    prompts: int = 6
    """Held-out code prompts (cut to their last 96 tokens)."""
    domain: str = "code"
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Device, dtype and KV cache of both sides: the in-process engine's runners (with
    ``max_seqs`` 2) and the services (each drafter gets the same KV cache budget)."""
    start_timeout_s: float = 180.0
    """How long each service may take to start."""
    colocate: bool = False
    """The services' drafter inside the verifier (``spin serve --colocate``): one call a
    step, the drafting inside the verifier's compute."""


def _stream(stub, prompt: tuple[int, ...], cfg: ServicesBenchConfig, spec: bool) -> tuple[list[int], float]:
    mode = (generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_DRAFTER,
                                       drafter=cfg.drafter, k=cfg.k) if spec else
            generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_OFF))
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=cfg.new_tokens,
                                         ignore_eos=True, speculation=mode)
    start = time.perf_counter()
    ids = [t for msg in stub.Generate(req, timeout=600) for t in msg.token_ids]
    return ids, time.perf_counter() - start


STEP_HISTOGRAMS = ("spin:step_seconds", "spin:step_rpc_overhead_seconds",
                   "spin:step_draft_seconds", "spin:step_verify_seconds")


def _router_times(port: int, names: tuple[str, ...] = STEP_HISTOGRAMS) -> dict[str, float]:
    """``_sum`` and ``_count`` of the router's histograms ``names``, from its metrics endpoint."""
    values = scrape(port)
    return {name + suffix: values[name + suffix] for name in names
            for suffix in ("_sum", "_count") if name + suffix in values}


def prompt_ids(cfg: ServicesBenchConfig) -> list[tuple[int, ...]]:
    """The first ``cfg.prompts`` held-out prompts of the domain with 96 tokens or more, cut to
    their last 96."""
    tok = AutoTokenizer.from_pretrained(cfg.family_dir / "target")
    prompts = []
    for row in heldout_prompts(cfg.family_dir, (cfg.domain,)):
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) >= 96:
            prompts.append(tuple(ids[-96:]))
        if len(prompts) == cfg.prompts:
            break
    return prompts


def _engine(cfg: ServicesBenchConfig, quantize: Quantization = "none") -> SpecEngine:
    """The in-process side: the target and the drafter in this process, the drafter's weights
    ``quantize``d (the services' drafters' weights)."""
    fam, runner = cfg.family_dir, replace(cfg.runner, max_seqs=2)
    drafter = (PromptLookupDrafter() if cfg.drafter == PROMPT_LOOKUP
               else ModelDrafter(cfg.drafter,
                                 replace(runner, quantize=quantize).load(fam / cfg.drafter)))
    verifier = Verifier(runner.load(fam / "target"))
    for r in [verifier.runner] + ([drafter.runner] if isinstance(drafter, ModelDrafter) else []):
        r.capture_graphs()  # as the services do at start (CUDA; none on the CPU)
    return SpecEngine(verifier, {cfg.drafter: drafter})


def _service_times(emb: Embedded) -> dict[str, float]:
    """Each service's ``spin:service_batch_seconds`` sum, by role (its compute, summed)."""
    out: dict[str, float] = {}
    for child in emb.children:
        if child.metrics_port and child is not emb.router:
            for key, value in scrape(child.metrics_port).items():
                if key.startswith("spin:service_batch_seconds_sum{"):
                    role = "draft" if 'role="drafter"' in key else "verify"
                    out[role] = out.get(role, 0.0) + value
    return out


def _compare(emb: Embedded, engine: SpecEngine, prompts: list[tuple[int, ...]],
             cfg: ServicesBenchConfig) -> dict:
    """Every prompt in process and through the services, speculation on and off: the seconds
    of each, per-prompt ratios, tokens and steps, the router's histograms and the services'
    compute diffed per kind, the in-process engine's draft and verify seconds (speculation on)."""
    out: dict = {"secs": {"inproc_on": 0.0, "inproc_off": 0.0, "rpc_on": 0.0, "rpc_off": 0.0},
                 "per_prompt_ratio": [], "lossless": True, "tokens": 0, "steps": 0,
                 "diff": {"on": {}, "off": {}}, "engine_on": StepTimes()}
    secs, diff, engine_on = out["secs"], out["diff"], out["engine_on"]
    with grpc.insecure_channel(emb.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        _stream(stub, prompts[0][:8], cfg, True)  # warm-up: connections, first forwards
        engine.generate([GenerationRequest("warm", prompts[0][:8], 8, drafter=cfg.drafter, k=cfg.k)])
        port = emb.router.metrics_port

        def measured(kind: str, fn):
            before = {**_router_times(port), **_service_times(emb)}
            result = fn()
            after = {**_router_times(port), **_service_times(emb)}
            for key, value in after.items():
                diff[kind][key] = diff[kind].get(key, 0.0) + value - before.get(key, 0.0)
            return result

        for i, p in enumerate(tqdm(prompts, desc="bench services", unit="prompt")):
            t, times = time.perf_counter(), replace(engine.times)
            (res,) = engine.generate([GenerationRequest(f"p{i}", p, cfg.new_tokens,
                                                        drafter=cfg.drafter, k=cfg.k,
                                                        stop_at_eos=False)])
            t_in = time.perf_counter() - t
            engine_on.steps += engine.times.steps - times.steps
            engine_on.draft_s += engine.times.draft_s - times.draft_s
            engine_on.verify_s += engine.times.verify_s - times.verify_s
            ids, t_rpc = measured("on", lambda: _stream(stub, p, cfg, True))
            t = time.perf_counter()
            (alone,) = engine.generate([GenerationRequest(f"q{i}", p, cfg.new_tokens,
                                                          stop_at_eos=False)])
            secs["inproc_off"] += time.perf_counter() - t
            off_ids, t_off = measured("off", lambda: _stream(stub, p, cfg, False))
            secs["inproc_on"] += t_in
            secs["rpc_on"] += t_rpc
            secs["rpc_off"] += t_off
            out["per_prompt_ratio"].append(t_in / t_rpc)
            out["lossless"] &= ids == res.tokens == alone.tokens == off_ids
            out["tokens"] += len(res.tokens)
            out["steps"] += res.steps
    return out


def run_services_bench(cfg: ServicesBenchConfig) -> dict:
    """The engine in process against the services (and, with ``cfg.colocate``, against the
    services with the drafter inside the verifier, a second deployment: ``"colocated"``)."""
    if cfg.drafter is None:
        cfg = replace(cfg, drafter=family_members(cfg.family_dir)[0])
    prompts = prompt_ids(cfg)
    report = _deployment(cfg, prompts, colocate=False)
    if cfg.colocate:
        report["colocated"] = _deployment(cfg, prompts, colocate=True)
    return report


def _deployment(cfg: ServicesBenchConfig, prompts: list[tuple[int, ...]], colocate: bool
                ) -> dict:
    """One deployment of the services against the engine in process, prompt by prompt."""
    log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-services-"))
    names = [] if cfg.drafter == PROMPT_LOOKUP else [cfg.drafter]
    # the services serve what the engine in process holds: this drafter with the same weights,
    # no draft head (a head makes every verification keep three layers' inputs)
    serve = ServeConfig(family_dir=cfg.family_dir, port=0, drafters=names, redis=False,
                        heads={}, log_dir=log_dir, router=RouterConfig(policy="fixed"),
                        runner=cfg.runner, drafter_kv_cache_memory=cfg.runner.kv_cache_memory,
                        colocate=tuple(names) if colocate else ())
    quantize = drafter_quantization(serve)
    engine = _engine(cfg, quantize)
    emb = Embedded(serve)
    emb.start(cfg.start_timeout_s)
    try:
        got = _compare(emb, engine, prompts, cfg)
    finally:
        emb.stop()
    return _report(cfg, got, len(prompts), quantize, bool(serve.colocate))


def _report(cfg: ServicesBenchConfig, got: dict, prompts: int, quantize: Quantization,
            colocated: bool) -> dict:
    secs, diff, tokens, steps = got["secs"], got["diff"], got["tokens"], got["steps"]
    engine_on: StepTimes = got["engine_on"]
    per_prompt_ratio, lossless = got["per_prompt_ratio"], got["lossless"]
    rate = {k: tokens / v for k, v in secs.items()}

    def split(d: dict[str, float]) -> dict[str, float]:
        n = d.get("spin:step_seconds_count", 0.0) or 1.0
        return {"steps": int(n),
                "step": 1e3 * d.get("spin:step_seconds_sum", 0.0) / n,
                "draft_wait": 1e3 * d.get("spin:step_draft_seconds_sum", 0.0) / n,
                "verify_wait": 1e3 * d.get("spin:step_verify_seconds_sum", 0.0) / n,
                "rpc_overhead": 1e3 * d.get("spin:step_rpc_overhead_seconds_sum", 0.0) / n,
                "draft_compute": 1e3 * d.get("draft", 0.0) / n,
                "verify_compute": 1e3 * d.get("verify", 0.0) / n}

    return {
        "drafter": cfg.drafter, "k": cfg.k, "prompts": prompts, "new_tokens": cfg.new_tokens,
        "drafter_in_verifier": colocated,
        "lossless": lossless,
        "tok_s": rate,
        "ratio_services_vs_inprocess": rate["rpc_on"] / rate["inproc_on"],
        "ratio_services_vs_inprocess_off": rate["rpc_off"] / rate["inproc_off"],
        "ratio_median_per_prompt": statistics.median(per_prompt_ratio),
        "tau": tokens / steps,
        "inprocess_step_ms": 1e3 * secs["inproc_on"] / steps,
        "drafter_weights": quantize,
        "inprocess_split_ms": {"steps": engine_on.steps,
                               "draft": 1e3 * engine_on.draft_s / max(engine_on.steps, 1),
                               "verify": 1e3 * engine_on.verify_s / max(engine_on.steps, 1)},
        "router_step_ms": split(diff["on"]),
        "router_step_ms_off": split(diff["off"]),
    }


def summary(r: dict) -> str:
    """The report of ``run_services_bench`` as ``spin bench services`` prints it."""
    t, on, inproc = r["tok_s"], r["router_step_ms"], r["inprocess_split_ms"]
    where = "inside the verifier" if r["drafter_in_verifier"] else "a service of its own"
    lines = [f"{r['drafter']} k={r['k']} ({where}), {r['prompts']} prompts x "
             f"{r['new_tokens']} tokens, tau {r['tau']:.2f}",
             f"speculation on : in process {t['inproc_on']:7.1f} tok/s | services "
             f"{t['rpc_on']:7.1f} tok/s = {r['ratio_services_vs_inprocess']:.2f}x "
             f"(median per prompt {r['ratio_median_per_prompt']:.2f}x)",
             f"speculation off: in process {t['inproc_off']:7.1f} tok/s | services "
             f"{t['rpc_off']:7.1f} tok/s = {r['ratio_services_vs_inprocess_off']:.2f}x"]
    for label, st in (("on", on), ("off", r["router_step_ms_off"])):
        lines.append(f"router step, speculation {label:3s} (mean of {st['steps']}): "
                     f"{st['step']:.2f} ms = draft wait {st['draft_wait']:.2f} + verify wait "
                     f"{st['verify_wait']:.2f} (+ bookkeeping); RPC overhead "
                     f"{st['rpc_overhead']:.2f} ms per step")
    lines.append(f"with speculation, per step: in process {r['inprocess_step_ms']:.2f} ms (draft "
                 f"{inproc['draft']:.2f} + verify {inproc['verify']:.2f}); services "
                 f"{on['step']:.2f} ms (draft {on['draft_compute']:.2f} + verify "
                 f"{on['verify_compute']:.2f} computing, "
                 f"{on['step'] - on['draft_compute'] - on['verify_compute']:.2f} in RPCs and the "
                 f"router); drafter weights {r['drafter_weights']}; lossless: {r['lossless']}")
    if "colocated" in r:
        lines += ["", summary(r["colocated"])]
    return "\n".join(lines)
