"""``spin bench services``: the same generation in process and through the gRPC services.

Single stream, greedy, one drafter and k, held-out prompts, ``new_tokens`` each (EOS ignored). Per
prompt, alternately: the in-process engine (``SpecEngine``) and the embedded services
(``spin serve``'s processes), with speculation on and off. Reported: tokens/s of each, the ratio
services / in-process, and the router's per-step time split from its own metrics, diffed over the
runs with speculation on and off separately: step, waiting for drafts, waiting for verification,
and the step time not spent computing inside the drafter or verifier (RPC round trips,
serialisation, the router's bookkeeping) as the per-step RPC overhead.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from tqdm import tqdm
from transformers import AutoTokenizer

from ..engine.drafter import ModelDrafter, PromptLookupDrafter
from ..engine.engine import GenerationRequest, SpecEngine
from ..engine.model_runner import ModelRunner
from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..engine.verifier import Verifier
from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig
from ..v1 import generation_pb2, generation_pb2_grpc
from ..zoo.corpus import heldout_prompts
from ..zoo.report import family_members
from ..zoo.specs import FAMILY_DIR


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
    from urllib.request import urlopen

    body = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        for name in names:
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix + " "):
                    out[name + suffix] = float(line.split()[1])
    return out


def run_services_bench(cfg: ServicesBenchConfig) -> dict:
    fam = cfg.family_dir
    if cfg.drafter is None:
        cfg = replace(cfg, drafter=family_members(fam)[0])
    tok = AutoTokenizer.from_pretrained(fam / "target")
    prompts = []
    for row in heldout_prompts(fam, (cfg.domain,)):
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) >= 96:
            prompts.append(tuple(ids[-96:]))
        if len(prompts) == cfg.prompts:
            break
    drafter = (PromptLookupDrafter() if cfg.drafter == PROMPT_LOOKUP
               else ModelDrafter(cfg.drafter, ModelRunner(fam / cfg.drafter, max_seqs=2)))
    engine = SpecEngine(Verifier(ModelRunner(fam / "target", max_seqs=2)), {cfg.drafter: drafter})
    log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-services-"))
    names = [] if cfg.drafter == PROMPT_LOOKUP else [cfg.drafter]
    secs = {"inproc_on": 0.0, "inproc_off": 0.0, "rpc_on": 0.0, "rpc_off": 0.0}
    per_prompt_ratio = []
    lossless = True
    tokens = steps = 0
    with Embedded(ServeConfig(family_dir=fam, port=0, drafters=names, redis=False,
                              log_dir=log_dir, router=RouterConfig(policy="fixed"))) as emb, \
            grpc.insecure_channel(emb.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        _stream(stub, prompts[0][:8], cfg, True)  # warm-up: connections, first forwards
        engine.generate([GenerationRequest("warm", prompts[0][:8], 8, drafter=cfg.drafter, k=cfg.k)])
        port = emb.router.metrics_port
        diff = {"on": {}, "off": {}}

        def measured(kind: str, fn):
            before = _router_times(port)
            out = fn()
            after = _router_times(port)
            for key, value in after.items():
                diff[kind][key] = diff[kind].get(key, 0.0) + value - before.get(key, 0.0)
            return out

        for i, p in enumerate(tqdm(prompts, desc="bench services", unit="prompt")):
            t = time.perf_counter()
            (res,) = engine.generate([GenerationRequest(f"p{i}", p, cfg.new_tokens,
                                                        drafter=cfg.drafter, k=cfg.k,
                                                        stop_at_eos=False)])
            t_in = time.perf_counter() - t
            ids, t_rpc = measured("on", lambda: _stream(stub, p, cfg, True))
            t = time.perf_counter()
            (alone,) = engine.generate([GenerationRequest(f"q{i}", p, cfg.new_tokens,
                                                          stop_at_eos=False)])
            secs["inproc_off"] += time.perf_counter() - t
            off_ids, t_off = measured("off", lambda: _stream(stub, p, cfg, False))
            secs["inproc_on"] += t_in
            secs["rpc_on"] += t_rpc
            secs["rpc_off"] += t_off
            per_prompt_ratio.append(t_in / t_rpc)
            lossless &= ids == res.tokens == alone.tokens == off_ids
            tokens += len(res.tokens)
            steps += res.steps
    rate = {k: tokens / v for k, v in secs.items()}

    def split(d: dict[str, float]) -> dict[str, float]:
        n = d.get("spin:step_seconds_count", 0.0) or 1.0
        return {"steps": int(n),
                "step": 1e3 * d.get("spin:step_seconds_sum", 0.0) / n,
                "draft_wait": 1e3 * d.get("spin:step_draft_seconds_sum", 0.0) / n,
                "verify_wait": 1e3 * d.get("spin:step_verify_seconds_sum", 0.0) / n,
                "rpc_overhead": 1e3 * d.get("spin:step_rpc_overhead_seconds_sum", 0.0) / n}

    return {
        "drafter": cfg.drafter, "k": cfg.k, "prompts": len(prompts), "new_tokens": cfg.new_tokens,
        "lossless": lossless,
        "tok_s": rate,
        "ratio_services_vs_inprocess": rate["rpc_on"] / rate["inproc_on"],
        "ratio_services_vs_inprocess_off": rate["rpc_off"] / rate["inproc_off"],
        "ratio_median_per_prompt": statistics.median(per_prompt_ratio),
        "tau": tokens / steps,
        "inprocess_step_ms": 1e3 * secs["inproc_on"] / steps,
        "router_step_ms": split(diff["on"]),
        "router_step_ms_off": split(diff["off"]),
    }
