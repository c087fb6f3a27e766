"""``spin zoo report``: the family's measured acceptance table and per-token forward costs.

For every drafter (each draft model and prompt lookup) and every domain: greedy mean accepted draft
tokens per verification step at k=4 against the target, (a) on the target's own greedy
continuations of held-out prompts — what speculative decoding sees at serving time — and (b) on
held-out human text. Mean accepted length tau = 1 + mean accepted (the bonus token included).
Beside it, how repetitive the target's greedy continuations are next to the human text after the
same prompts (``repetition.py``: distinct-token share, share of tokens in exact loops).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from .acceptance import PROMPT_LOOKUP, human_window_acceptance, teacher_forced_argmax, walk_steps
from .corpus import heldout_prompts
from .distill import greedy_continue
from .repetition import compare_with_human
from .repetition import markdown as repetition_markdown
from .specs import DOMAINS, FAMILY_DIR

README_BEGIN, README_END = "<!-- zoo-report:begin -->", "<!-- zoo-report:end -->"


@dataclass
class ReportConfig:
    """What the report measures."""

    family_dir: Path = FAMILY_DIR
    """Directory holding ``target/``, the ``draft-*/`` models and ``heldout_prompts.jsonl``."""
    prompts_per_domain: int = 16
    """Held-out prompts per domain (the committed file has 48)."""
    k: int = 4
    """Speculation length of every step."""
    prompt_tokens: int = 96
    """Prompts are cut to their last ``prompt_tokens`` tokens (equal lengths batch without padding)."""
    new_tokens: int = 128
    """Length of the target's greedy continuation (shorter where it emits EOS)."""
    window_stride: int = 24
    """Human-text mode: one context window every ``window_stride`` tokens of the reference text."""
    timing_runs: int = 40
    """Per-token forward timing: median over this many single-token decodes at context 128."""


def load_model(path: Path) -> PreTrainedModel:
    """A family model from its local directory, as fp32 (faster than bf16 on CPU), eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def family_members(family_dir: Path) -> list[str]:
    """Draft model directory names of a family, sorted."""
    return sorted(p.name for p in family_dir.iterdir()
                  if p.is_dir() and p.name.startswith("draft-") and (p / "config.json").exists())


@torch.inference_mode()
def forward_ms(model: PreTrainedModel, runs: int, context: int = 128) -> float:
    """Median wall time of one single-token forward with a KV cache of ``context`` tokens (batch 1)."""
    cache = DynamicCache()
    model(input_ids=torch.zeros(1, context, dtype=torch.long), past_key_values=cache, use_cache=True)
    token = torch.zeros(1, 1, dtype=torch.long)
    times = []
    for i in range(runs + 5):
        start = time.perf_counter()
        model(input_ids=token, past_key_values=cache, use_cache=True)
        if i >= 5:
            times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times) * 1e3


def run_report(cfg: ReportConfig) -> dict:
    tok = AutoTokenizer.from_pretrained(cfg.family_dir / "target")
    target = load_model(cfg.family_dir / "target")
    drafts = {name: load_model(cfg.family_dir / name) for name in family_members(cfg.family_dir)}
    drafters = [*drafts, PROMPT_LOOKUP]
    own: dict[str, dict[str, float]] = {d: {} for d in drafters}
    human: dict[str, dict[str, float]] = {d: {} for d in drafters}
    skipped = 0
    generated: dict[str, list[list[int]]] = {}  # per domain: the target's output, up to EOS
    references: dict[str, list[list[int]]] = {}  # per domain: the human text after each prompt
    for domain in tqdm(DOMAINS, desc="report", unit="domain"):
        prompt_ids, windows, refs = [], [], []
        for r in heldout_prompts(cfg.family_dir, (domain,)):
            ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            if len(ids) < cfg.prompt_tokens:
                skipped += 1
                continue
            prompt_ids.append(ids[-cfg.prompt_tokens:])
            full = tok(r["prompt"] + r["reference"], add_special_tokens=False)["input_ids"]
            refs.append(full[len(ids):])
            for c in range(len(ids), len(full), cfg.window_stride):
                windows.append(full[c - cfg.prompt_tokens:c])
            if len(prompt_ids) == cfg.prompts_per_domain:
                break
        if not prompt_ids:
            raise ValueError(f"no {domain} prompt has {cfg.prompt_tokens} tokens")
        prompts = torch.tensor(prompt_ids, dtype=torch.long)  # [N, P]
        seqs = torch.cat([prompts, greedy_continue(target, prompts, cfg.new_tokens)], dim=1)
        t_arg = teacher_forced_argmax(target, seqs).tolist()
        lengths = [_until_eos(s, cfg.prompt_tokens, tok.eos_token_id) for s in seqs.tolist()]
        generated[domain] = [[t for t in s[cfg.prompt_tokens:n] if t != tok.eos_token_id]
                             for s, n in zip(seqs.tolist(), lengths, strict=True)]
        references[domain] = refs
        win = torch.tensor(windows, dtype=torch.long)  # [W, P]
        for name in drafters:
            d_arg = teacher_forced_argmax(drafts[name], seqs).tolist() if name in drafts else None
            steps = []
            for i, seq in enumerate(seqs.tolist()):
                n = lengths[i]
                steps += walk_steps(seq[:n], t_arg[i][:n], cfg.prompt_tokens, cfg.k,
                                    d_arg[i][:n] if d_arg is not None else None)
            own[name][domain] = round(sum(steps) / len(steps), 3)
            acc = human_window_acceptance(target, drafts.get(name), win, cfg.k)
            human[name][domain] = round(sum(acc) / len(acc), 3)
    timings = {"target": round(forward_ms(target, cfg.timing_runs), 3)}
    for name, model in drafts.items():
        timings[name] = round(forward_ms(model, cfg.timing_runs), 3)
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in [("target", target), *drafts.items()]}
    losses = {n: json.loads((cfg.family_dir / n / "training.json").read_text())["final_heldout_loss"]
              for n in params if (cfg.family_dir / n / "training.json").exists()}
    return {
        "k": cfg.k, "prompts_per_domain": cfg.prompts_per_domain, "skipped_prompts": skipped,
        "new_tokens": cfg.new_tokens, "prompt_tokens": cfg.prompt_tokens,
        "definition": "mean accepted draft tokens per verification step (greedy); tau = 1 + this",
        "target_continuation": own, "human_text": human, "forward_ms": timings,
        "parameters": params, "heldout_loss": losses, "criteria": criteria(own, timings),
        "repetition": compare_with_human(generated, references),
    }


def _until_eos(seq: list[int], prompt_len: int, eos: int) -> int:
    """Length of prompt + continuation up to and including the first generated EOS."""
    for j in range(prompt_len, len(seq)):
        if seq[j] == eos:
            return j + 1
    return len(seq)


def criteria(own: dict[str, dict[str, float]], timings: dict[str, float]) -> dict:
    """The family's acceptance bars, computed from the table."""
    best = {d: max(own, key=lambda n: own[n][d]) for d in DOMAINS}
    gaps = {}
    for d in DOMAINS:
        rivals = {best[e] for e in DOMAINS if best[e] != best[d]}
        if rivals:
            rival = max(rivals, key=lambda n: own[n][d])
            gaps[d] = {"best": best[d], "rival": rival,
                       "ratio": round(own[best[d]][d] / max(own[rival][d], 1e-9), 3)}
    draft_ms = {n: ms for n, ms in timings.items() if n != "target"}
    smallest, largest = min(draft_ms, key=draft_ms.get), max(draft_ms, key=draft_ms.get)
    return {
        "best_by_domain": best, "selection_gaps": gaps,
        "domains_with_20pct_gap": sum(1 for g in gaps.values() if g["ratio"] >= 1.2),
        "best_code_accepted": max(v["code"] for v in own.values()),
        "target_over_smallest_draft_cost": round(timings["target"] / draft_ms[smallest], 2),
        "smallest_over_largest_draft_cost": round(draft_ms[smallest] / draft_ms[largest], 3),
    }


def markdown(report: dict) -> str:
    """The acceptance table as Markdown (for the family README)."""
    head = ("| drafter | params | forward ms | " + " | ".join(DOMAINS) + " | "
            + " | ".join(f"{d} (human)" for d in DOMAINS) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(DOMAINS))]
    for name, row in report["target_continuation"].items():
        params = report["parameters"].get(name)
        ms = report["forward_ms"].get(name)
        cells = [name, f"{params / 1e6:.2f}M" if params else "-", f"{ms:.2f}" if ms else "-"]
        cells += [f"{row[d]:.2f}" for d in DOMAINS]
        cells += [f"{report['human_text'][name][d]:.2f}" for d in DOMAINS]
        lines.append("| " + " | ".join(cells) + " |")
    t = report["parameters"]["target"] / 1e6
    lines.append(f"| target (verifier) | {t:.2f}M | {report['forward_ms']['target']:.2f} |"
                 + " |" * (2 * len(DOMAINS)))
    if report.get("heldout_loss"):
        lines += ["", "| model | " + " | ".join(f"held-out loss {d}" for d in DOMAINS) + " |",
                  "|" + "---|" * (1 + len(DOMAINS))]
        for name, loss in report["heldout_loss"].items():
            lines.append(f"| {name} | " + " | ".join(f"{loss[d]:.3f}" for d in DOMAINS) + " |")
    c = report["criteria"]
    lines += ["", f"k = {report['k']}, greedy; {report['definition']}. "
              f"{report['prompts_per_domain']} held-out prompts per domain, {report['prompt_tokens']}-token "
              f"prompts, {report['new_tokens']} new tokens. Forward: one token, KV cache of 128, batch 1, fp32.",
              "", f"Best drafter by domain: {c['best_by_domain']}; selection gaps: {c['selection_gaps']}; "
              f"target / smallest draft cost {c['target_over_smallest_draft_cost']}x; smallest / largest "
              f"draft cost {c['smallest_over_largest_draft_cost']}."]
    if "repetition" in report:
        lines += ["", repetition_markdown(report["repetition"])]
    return "\n".join(lines)


def update_readme(path: Path, table: str) -> None:
    """Replace the report section of a README (between the zoo-report markers)."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{path} has no {README_BEGIN} ... {README_END} section")
    pattern = re.compile(re.escape(README_BEGIN) + ".*?" + re.escape(README_END), re.S)
    path.write_text(pattern.sub(lambda _: f"{README_BEGIN}\n{table}\n{README_END}", text))
