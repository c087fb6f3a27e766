"""``spin bench engine``: the engine against transformers, measured side by side in one run.

Greedy, held-out code and prose prompts of the demo family, ``new_tokens`` each, single stream
unless stated. Reported per domain: target alone through this engine, transformers ``generate()``,
transformers assisted generation with each draft (best kept), and this engine speculating with each
drafter at each k (best kept, with its tau = mean tokens per verification step). Then batch 1/4/16
throughput with speculation on and off, and the efficiency at batch 1: achieved tokens/s over
tau x (target verification steps per second), i.e. the share of the step time that is the target's
own forward. ``lossless`` is true only if every speculative output equalled target-alone.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from ..engine.drafter import ModelDrafter, PromptLookupDrafter
from ..engine.engine import GenerationRequest, SpecEngine
from ..engine.model_runner import ForwardItem, ModelRunner
from ..engine.verifier import Verifier
from ..zoo.corpus import heldout_prompts
from ..zoo.report import family_members, load_model
from ..zoo.specs import FAMILY_DIR


@dataclass
class EngineBenchConfig:
    """What the engine benchmark runs."""

    family_dir: Path = FAMILY_DIR
    """The demo family."""
    quick: bool = False
    """Fewer prompts and k values (at most 4 minutes on 2 cores)."""
    new_tokens: int = 128
    """Tokens generated per request."""
    prompt_tokens: int = 96
    """Prompts are cut to their last ``prompt_tokens`` tokens."""
    domains: tuple[str, ...] = ("code", "prose")
    """Domains measured single-stream."""
    ks: tuple[int, ...] = field(default=(1, 2, 3, 4, 5, 6, 7, 8))
    """Speculation lengths tried per drafter (``--quick``: 2, 4, 6)."""
    batches: tuple[int, ...] = (1, 4, 16)
    """Batch sizes of the on/off throughput comparison."""

    @property
    def prompts_per_domain(self) -> int:
        return 2 if self.quick else 6


def _timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_engine_bench(cfg: EngineBenchConfig) -> dict:
    torch.manual_seed(0)
    ks = (2, 4, 6) if cfg.quick else cfg.ks
    fam = cfg.family_dir
    tok = AutoTokenizer.from_pretrained(fam / "target")
    names = family_members(fam)
    runner_slots = max(cfg.batches)
    drafters = {n: ModelDrafter(n, ModelRunner(fam / n, num_slots=runner_slots)) for n in names}
    drafters["prompt-lookup"] = PromptLookupDrafter()
    engine = SpecEngine(Verifier(ModelRunner(fam / "target", num_slots=runner_slots)), drafters)
    hf_target = load_model(fam / "target")
    hf_drafts = {n: load_model(fam / n) for n in names}
    prompts = {d: _prompts(tok, fam, d, cfg) for d in cfg.domains}
    lossless = True
    report: dict = {"domains": {}, "batch": {}, "new_tokens": cfg.new_tokens, "quick": cfg.quick}
    bar = tqdm(total=len(cfg.domains) * (2 + len(names) + len(drafters) * len(ks)),
               desc="bench engine", unit="run")
    for domain, plist in prompts.items():
        reqs = lambda drafter=None, k=0: [  # noqa: E731
            GenerationRequest(f"{domain}{i}", p, cfg.new_tokens, drafter=drafter, k=k)
            for i, p in enumerate(plist)]
        alone, t_alone = _serial(engine, reqs())
        bar.update()
        reference = [r.tokens for r in alone]
        n_tokens = sum(len(t) for t in reference)
        row = {"target_alone_tok_s": n_tokens / t_alone}
        _, t_hf = _timed(lambda: [hf_target.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False, max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
            pad_token_id=tok.eos_token_id) for p in plist])
        row["hf_generate_tok_s"] = n_tokens / t_hf
        bar.update()
        assisted = {}
        for n, draft in hf_drafts.items():
            _, t = _timed(lambda: [hf_target.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                assistant_model=draft, do_sample=False, max_new_tokens=cfg.new_tokens,
                min_new_tokens=cfg.new_tokens, pad_token_id=tok.eos_token_id) for p in plist])
            assisted[n] = n_tokens / t
            bar.update()
        best_assist = max(assisted, key=assisted.get)
        row |= {"hf_assisted_best_tok_s": assisted[best_assist], "hf_assisted_best_draft": best_assist}
        spec = {}
        for n in drafters:
            for k in ks:
                results, t = _serial(engine, reqs(n, k))
                lossless &= [r.tokens for r in results] == reference
                steps = sum(r.steps for r in results)
                spec[(n, k)] = (n_tokens / t, n_tokens / steps)
                bar.update()
        (bn, bk) = max(spec, key=lambda key: spec[key][0])
        row |= {"spec_best_tok_s": spec[(bn, bk)][0], "spec_best_drafter": bn, "spec_best_k": bk,
                "tau": spec[(bn, bk)][1],
                "spec_by_drafter": {n: max((spec[(n, k)][0], k) for k in ks) for n in drafters}}
        report["domains"][domain] = row
    bar.close()
    best = max(report["domains"].values(), key=lambda r: r["spec_best_tok_s"])
    mixed = [p for plist in prompts.values() for p in plist]
    for b in cfg.batches:
        batch = [mixed[i % len(mixed)] for i in range(b)]
        off, t_off = _timed(lambda: engine.generate(
            [GenerationRequest(f"b{i}", p, cfg.new_tokens) for i, p in enumerate(batch)]))
        on, t_on = _timed(lambda: engine.generate(
            [GenerationRequest(f"b{i}", p, cfg.new_tokens, drafter=best["spec_best_drafter"],
                               k=best["spec_best_k"]) for i, p in enumerate(batch)]))
        lossless &= [r.tokens for r in on] == [r.tokens for r in off]
        total = sum(len(r.tokens) for r in off)
        report["batch"][str(b)] = {"spec_off_tok_s": total / t_off, "spec_on_tok_s": total / t_on}
    code = report["domains"][cfg.domains[0]]
    verify_rate = _verify_steps_per_s(engine.verifier.runner, prompts[cfg.domains[0]][0],
                                      code["spec_best_k"])
    report["efficiency_b1"] = code["spec_best_tok_s"] / (code["tau"] * verify_rate)
    report["verify_steps_per_s_b1"] = verify_rate
    report["lossless"] = lossless
    return report


def _prompts(tok, fam: Path, domain: str, cfg: EngineBenchConfig) -> list[tuple[int, ...]]:
    out = []
    for row in heldout_prompts(fam, (domain,)):
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) >= cfg.prompt_tokens:
            out.append(tuple(ids[-cfg.prompt_tokens:]))
        if len(out) == cfg.prompts_per_domain:
            return out
    raise ValueError(f"not enough {domain} prompts of {cfg.prompt_tokens} tokens")


def _serial(engine: SpecEngine, reqs: list[GenerationRequest]):
    """Single stream: one request after another; (results, total seconds)."""
    results, total = [], 0.0
    for r in reqs:
        (res,), t = _timed(lambda: engine.generate([r]))
        results.append(res)
        total += t
    return results, total


@torch.inference_mode()
def _verify_steps_per_s(runner: ModelRunner, prompt: tuple[int, ...], k: int) -> float:
    """Target forwards per second scoring k + 1 tokens after the prompt (batch 1, median of 20)."""
    slot = runner.cache.admit("verify-rate")
    try:
        runner.forward([ForwardItem(slot, prompt)])
        runner.cache.commit(slot, len(prompt))
        times = []
        for _ in range(25):
            _, t = _timed(lambda: runner.forward([ForwardItem(slot, tuple(range(1, k + 2)))]))
            times.append(t)
        return 1.0 / statistics.median(times[5:])
    finally:
        runner.cache.free(slot)
