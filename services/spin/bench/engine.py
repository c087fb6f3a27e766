"""``spin bench engine``: the engine against transformers, measured side by side in one run.

Greedy, held-out code and prose prompts of the demo family, ``new_tokens`` each, single stream
unless stated. Reported per domain: target alone through this engine, transformers ``generate()``,
transformers assisted generation with each draft (best kept), and this engine speculating with each
drafter at each k (best kept, with its tau = mean tokens per verification step). Then batch 1/4/16
throughput with speculation on and off, and the efficiency at each batch size: achieved tokens/s
over tau x (target verification steps per second), which is the share of the step time spent in
verification (``StepTimes.verify_share``, measured inside the same run, so machine noise between
separate measurements cannot skew it). ``lossless`` is true only if every speculative output
equalled target-alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from ..engine.drafter import ModelDrafter, PromptLookupDrafter
from ..engine.engine import GenerationRequest, SpecEngine, StepTimes
from ..engine.model_runner import ModelRunner
from ..engine.prompt_lookup import PROMPT_LOOKUP
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

    @property
    def batch_rounds(self) -> int:
        """Alternating off/on rounds per batch size."""
        return 1 if self.quick else 3


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
    drafters = {n: ModelDrafter(n, ModelRunner(fam / n, max_seqs=runner_slots)) for n in names}
    drafters[PROMPT_LOOKUP] = PromptLookupDrafter()
    engine = SpecEngine(Verifier(ModelRunner(fam / "target", max_seqs=runner_slots)), drafters)
    hf_target = load_model(fam / "target")
    hf_drafts = {n: load_model(fam / n) for n in names}
    prompts = {d: _prompts(tok, fam, d, cfg) for d in cfg.domains}
    lossless = True
    report: dict = {"domains": {}, "batch": {}, "new_tokens": cfg.new_tokens, "quick": cfg.quick}
    warm = prompts[cfg.domains[0]][0]
    engine.generate([GenerationRequest("warm-up", warm, 8, drafter=names[0], k=2)])
    hf_target.generate(torch.tensor([warm]), max_new_tokens=8, do_sample=False,
                       pad_token_id=tok.eos_token_id)
    configs: list[tuple] = [("alone",), ("hf",), *[("assisted", n) for n in names],
                            *[("spec", n, k) for n in drafters for k in ks]]
    bar = tqdm(total=len(cfg.domains) * cfg.prompts_per_domain * len(configs),
               desc="bench engine", unit="run")
    for domain, plist in prompts.items():
        # Prompts outside, configurations inside: a slow phase of a noisy machine then hits every
        # configuration alike instead of biasing whichever one it happened to fall on.
        secs = dict.fromkeys(configs, 0.0)
        steps = dict.fromkeys(configs, 0)
        verify_s = dict.fromkeys(configs, 0.0)
        n_tokens = 0
        for i, p in enumerate(plist):
            reference = None
            for c in configs:
                if c[0] in ("alone", "spec"):
                    engine.times = StepTimes()
                    drafter, k = (c[1], c[2]) if c[0] == "spec" else (None, 0)
                    (res,), t = _timed(lambda: engine.generate([GenerationRequest(
                        f"{domain}{i}", p, cfg.new_tokens, drafter=drafter, k=k)]))
                    if reference is None:
                        reference = res.tokens
                        n_tokens += len(reference)
                    lossless &= res.tokens == reference
                    steps[c] += res.steps
                    verify_s[c] += engine.times.verify_s
                else:
                    _, t = _timed(lambda: hf_target.generate(
                        torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        assistant_model=hf_drafts[c[1]] if c[0] == "assisted" else None,
                        do_sample=False, max_new_tokens=cfg.new_tokens,
                        min_new_tokens=cfg.new_tokens, pad_token_id=tok.eos_token_id))
                secs[c] += t
                bar.update()
        rate = {c: n_tokens / secs[c] for c in configs}
        assisted = {n: rate[("assisted", n)] for n in names}
        best_assist = max(assisted, key=assisted.get)
        spec = {(c[1], c[2]): (rate[c], n_tokens / steps[c], verify_s[c] / secs[c])
                for c in configs if c[0] == "spec"}
        (bn, bk) = max(spec, key=lambda key: spec[key][0])
        row = {"target_alone_tok_s": rate[("alone",)], "hf_generate_tok_s": rate[("hf",)],
               "hf_assisted_best_tok_s": assisted[best_assist],
               "hf_assisted_best_draft": best_assist, "hf_assisted_by_draft": assisted,
               "spec_best_tok_s": spec[(bn, bk)][0], "spec_best_drafter": bn, "spec_best_k": bk,
               "tau": spec[(bn, bk)][1],
               "spec_by_drafter": {n: dict(zip(("tok_s", "k", "tau", "efficiency"),
                                               (*spec[key][:1], key[1], *spec[key][1:])))
                                   for n in drafters
                                   for key in [max(((n, k) for k in ks), key=lambda x: spec[x][0])]}}
        report["domains"][domain] = row
    bar.close()
    # Batches mix the domains; with speculation on, each request drafts with its domain's best
    # single-stream configuration, so one batch mixes drafters and k.
    mixed = [(d, p) for d, plist in prompts.items() for p in plist]
    for b in cfg.batches:  # at least 4 requests per measurement, in batches of b
        reqs = [mixed[i % len(mixed)] for i in range(max(b, 4))]
        chunks = [reqs[i:i + b] for i in range(0, len(reqs), b)]

        def run(spec: bool) -> list:
            out = []
            for chunk in chunks:
                out += engine.generate([GenerationRequest(
                    f"b{i}", p, cfg.new_tokens,
                    drafter=report["domains"][d]["spec_best_drafter"] if spec else None,
                    k=report["domains"][d]["spec_best_k"] if spec else 0)
                    for i, (d, p) in enumerate(chunk)])
            return out

        t_off = t_on = on_verify_s = 0.0
        for _ in range(cfg.batch_rounds):  # off and on alternate, for the same reason as above
            off, t = _timed(lambda: run(False))
            t_off += t
            engine.times = StepTimes()
            on, t = _timed(lambda: run(True))
            t_on += t
            on_verify_s += engine.times.verify_s
            lossless &= [r.tokens for r in on] == [r.tokens for r in off]
        total = sum(len(r.tokens) for r in off) * cfg.batch_rounds
        report["batch"][str(b)] = {"spec_off_tok_s": total / t_off, "spec_on_tok_s": total / t_on,
                                   "tau": total / cfg.batch_rounds / sum(r.steps for r in on),
                                   "efficiency": on_verify_s / t_on}
    report["efficiency_b1"] = report["batch"]["1"]["efficiency"] if "1" in report["batch"] else None
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
