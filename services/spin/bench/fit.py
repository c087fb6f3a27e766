"""``spin bench fit``: how well cheap signals pick the draft model that fits a request.

For each held-out prompt of the family's **tuning** split (``spin bench policy`` times the
evaluation split): the target's greedy output (``new_tokens``), and for every
draft model its greedy agreement (the fraction of tokens it predicts from the tokens before them)
on the target's output (what its acceptance rate is, with greedy decoding), on the prompt's last
``prompt_positions`` tokens (the learned policy's prompt fit, ``policy/prompt_fit.py``), and on the
first ``early_positions`` output tokens (what scoring the output after a few steps sees). Reported:
how often each signal's best drafter is the output's best ("hits"), the mean acceptance lost by
following it, and each drafter's mean acceptance over all requests vs over those it fits best
(by prompt): the population prior vs the prompt-fit seed.

The signal ``prompt_record`` is what the router's prompt fit does (``PromptFit``): each drafter's
record on the earlier requests it fitted, less ``fit_deficit_weight`` times how far its prompt
agreement is behind the best, ranked by the goodput the cost model predicts for that (when there
is a cost model). The requests are taken in a fixed shuffled order (a mixed workload) and the
record is built as they go, from each fitted drafter's acceptance on the output. With a cost
model, every signal also reports the mean goodput lost: 1 - the goodput predicted for its pick at
its acceptance on the output over the best drafter's (one request alone, the best k).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..timing.cost_model import CostModel
from ..policy.goodput import SpecLengthController
from ..policy.learned_config import LearnedPolicyConfig
from ..policy.prompt_fit import PromptFit
from ..zoo.corpus import heldout_prompts
from ..zoo.report import family_members
from ..zoo.specs import FAMILY_DIR

SIGNALS = ("prompt", "early_output")
RECORD_SIGNAL = "prompt_record"


@dataclass
class FitBenchConfig:
    """What the prompt-fit benchmark measures."""

    family_dir: Path = FAMILY_DIR
    """The model family (target and draft models)."""
    prompts: int = 0
    """Tuning-split prompts to use, spread over the domains (0 = all)."""
    new_tokens: int = 64
    """Greedy output tokens of the target per prompt."""
    prompt_positions: int = 512
    """Prompt tail scored (as the router scores it at a request's first step)."""
    early_positions: int = 5
    """Output tokens the early-output signal sees."""
    threads: int = 2
    """Torch threads."""
    policy: LearnedPolicyConfig = field(default_factory=LearnedPolicyConfig)
    """Whose prompt-fit margins the replayed signals follow."""
    cost_model: Path | None = None
    """Step-time model (``spin profile``) that ranks by goodput and measures goodput lost; None
    = by acceptance only."""


def _agreement(logits: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> float:
    """Fraction of ids[lo:hi] equal to the argmax of the logits row before each."""
    # logits: [L, V], ids: [L]
    if hi <= lo:
        return 0.0
    return (logits[lo - 1:hi - 1].argmax(-1) == ids[lo:hi]).float().mean().item()


@torch.inference_mode()
def run_fit_bench(cfg: FitBenchConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    tok = AutoTokenizer.from_pretrained(cfg.family_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(cfg.family_dir / "target").eval()
    names = family_members(cfg.family_dir)
    if len(names) < 2:
        raise ValueError(f"{cfg.family_dir} has {len(names)} draft models: nothing to rank")
    drafters = {n: AutoModelForCausalLM.from_pretrained(cfg.family_dir / n).eval() for n in names}
    rows = heldout_prompts(cfg.family_dir, split="tuning")
    if cfg.prompts:
        step = max(1, len(rows) // cfg.prompts)
        rows = rows[::step][:cfg.prompts]
    per_request = []
    for row in tqdm(rows, desc="prompts", unit="prompt"):
        ids = tok(row["prompt"], return_tensors="pt").input_ids                   # [1, P]
        p = ids.shape[1]
        full = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=cfg.new_tokens, pad_token_id=tok.eos_token_id)[0]
        n = full.shape[0]
        rec: dict = {"domain": row["domain"], "prompt_tokens": p, "output_tokens": n - p,
                     "drafters": {}}
        for name, model in drafters.items():
            logits = model(full[None]).logits[0]                                   # [n, V]
            rec["drafters"][name] = {
                "output": _agreement(logits, full, p, n),
                "prompt": _agreement(logits, full, max(1, p - cfg.prompt_positions), p),
                "early_output": _agreement(logits, full, p, min(n, p + cfg.early_positions))}
        per_request.append(rec)
    cost = CostModel.load(cfg.cost_model) if cfg.cost_model is not None else None
    return summarize(per_request, names, cfg.policy, cost)


class _Goodput:
    """Predicted goodput of one request alone at the best k, as the router's prompt fit ranks
    (``SpecLengthController.solo_goodput``); the rate itself without a cost model."""

    def __init__(self, cost: CostModel | None) -> None:
        self.controller = SpecLengthController(cost) if cost is not None else None

    def __call__(self, rec: dict, drafter: str, rate: float) -> float:
        g = (self.controller.solo_goodput("fit", drafter, min(1.0, max(0.0, rate)),
                                          rec.get("prompt_tokens", 0))
             if self.controller is not None else None)
        return rate if g is None else g

    def lost(self, rec: dict, drafter: str, rate: float) -> float | None:
        """1 - goodput at ``rate`` with ``drafter`` over the output's best drafter's; None
        without a cost model."""
        if self.controller is None:
            return None
        best = max(self(rec, n, v["output"]) for n, v in rec["drafters"].items())
        return 1.0 - self(rec, drafter, rate) / best if best > 0 else 0.0


def summarize(per_request: list[dict], names: list[str],
              policy: LearnedPolicyConfig | None = None, cost: CostModel | None = None) -> dict:
    """Hits and acceptance (and, with a cost model, goodput) lost per signal, and acceptance over
    all vs best-fit requests."""
    report: dict = {"prompts": len(per_request), "signals": {}, "acceptance": {}}
    goodput = _Goodput(cost)
    for signal in SIGNALS:
        hits, lost, g_lost = 0, [], []
        for rec in per_request:
            d = rec["drafters"]
            best = max(names, key=lambda n: d[n]["output"])
            pick = max(names, key=lambda n: d[n][signal])
            hits += best == pick
            lost.append(d[best]["output"] - d[pick]["output"])
            g_lost.append(goodput.lost(rec, pick, d[pick]["output"]))
        report["signals"][signal] = _outcome(hits, lost, g_lost)
    policy = policy or LearnedPolicyConfig()
    report["signals"][RECORD_SIGNAL] = _with_record(per_request, names, policy, goodput)
    for name in names:
        fitted = [rec["drafters"][name]["output"] for rec in per_request
                  if max(names, key=lambda n: rec["drafters"][n]["prompt"]) == name]
        report["acceptance"][name] = {
            "all": statistics.mean(rec["drafters"][name]["output"] for rec in per_request),
            "best_fit": statistics.mean(fitted) if fitted else None,
            "best_fit_requests": len(fitted)}
    report["deficit_weight"] = deficit_weight(per_request, names, policy, goodput)
    report["per_request"] = per_request
    return report


DEFICIT_WEIGHTS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0)
"""``PromptFit.deficit_weight`` values the replay compares."""


def deficit_weight(per_request: list[dict], names: list[str], policy: LearnedPolicyConfig,
                   goodput: _Goodput, within: float = 0.15) -> dict:
    """Where ``PromptFit.deficit_weight`` comes from: the slope (least squares through the
    origin) of how much output acceptance a drafter has below the best-fitting one's, against
    how far its prompt agreement is behind (drafters less than ``within`` behind, not the best
    itself), and the prompt-record replay (``_with_record``) at each of ``DEFICIT_WEIGHTS``."""
    xs, ys = [], []
    for rec in per_request:
        d = rec["drafters"]
        top = max(names, key=lambda n: d[n]["prompt"])
        for n in names:
            gap = d[top]["prompt"] - d[n]["prompt"]
            if n != top and 0 < gap < within:
                xs.append(gap)
                ys.append(d[top]["output"] - d[n]["output"])
    sxx = sum(x * x for x in xs)
    replay = {f"{w:g}": _with_record(per_request, names,
                                     replace(policy, fit_deficit_weight=w), goodput)
              for w in DEFICIT_WEIGHTS}
    return {"slope": sum(x * y for x, y in zip(xs, ys)) / sxx if sxx > 0 else None,
            "points": len(xs), "within": within, "replay": replay}


def _outcome(hits: int, lost: list[float], goodput_lost: list[float | None]) -> dict:
    out = {"hits": hits, "mean_acceptance_lost": statistics.mean(lost)}
    if goodput_lost and None not in goodput_lost:
        out["mean_goodput_lost"] = statistics.mean(goodput_lost)  # type: ignore[arg-type]
    return out


def _with_record(per_request: list[dict], names: list[str], policy: LearnedPolicyConfig,
                 goodput: _Goodput, seed: int = 0, positions: int = 10_000) -> dict:
    """Hits and acceptance (goodput) lost of ``PromptFit``'s choice, the requests in a shuffled
    order; each fitted request adds its output tokens at the fitted drafter's agreement to the
    record."""
    by_id = {str(i): rec for i, rec in enumerate(per_request)}
    value = goodput if policy.fit_by_goodput else (lambda rec, n, rate: rate)
    fit = PromptFit(margin=policy.fit_margin, rank_margin=policy.fit_rank_margin,
                    deficit_weight=policy.fit_deficit_weight,
                    value=lambda rid, n, rate: value(by_id[rid], n, rate),
                    prune_after=policy.fit_prune_after, explore_every=policy.fit_explore_every)
    order = list(range(len(per_request)))
    random.Random(seed).shuffle(order)
    hits, lost, g_lost, scorers = 0, [], [], 0
    for i in order:
        rec = per_request[i]
        d = rec["drafters"]
        rid = str(i)
        for n in fit.worth_scoring(names):
            fit.observe_prompt(rid, n, round(d[n]["prompt"] * positions), positions)
            scorers += 1
        cur = fit.fitting(rid)[0]
        size = rec["output_tokens"]
        fit.record(rid, cur, size * d[cur]["output"], size * (1 - d[cur]["output"]))
        best = max(names, key=lambda n: d[n]["output"])
        hits += best == cur
        lost.append(d[best]["output"] - d[cur]["output"])
        g_lost.append(goodput.lost(rec, cur, d[cur]["output"]))
        fit.release(rid)
    return {**_outcome(hits, lost, g_lost), "scorers_per_prompt": scorers / max(1, len(order))}
