"""``spin bench suffix``: auto with suffix decoding in the pool against auto without it, on the
edit workload (``loadgen/edit.py``), side by side in one run.

Two ``spin serve`` deployments of the demo family, the same in all but one setting: **with**
offers suffix decoding to the learned policy (the default), **without** does not
(``SchedulerConfig.suffix_decoding``). Each request of the edit workload goes, single stream and
greedy, to *with* and to *without* (the order swapped every other request, so both see the same
moment's machine), then, as the lossless reference, with speculation off to a third deployment
like *without* (off requests on *with* would fill its store with the very outputs it is about to
be timed on; on *without*, off would find the prompt *without* just prefilled in its prefix
cache, which flattered off in the runs recorded before 2026-11-27's third deployment). A
pass sends its own groups of the workload (a group: a text, then its edits, in order), so no
pass is drafted from an earlier pass's outputs of the same requests: a store that remembered the
timed requests themselves would measure repetition the workload does not have.

Reported: tokens per second of each (all tokens over the summed end-to-end seconds), with /
without overall and per pass, the median per-request ratio of end-to-end seconds
(without / with), both against off, suffix decoding's share of the accepted tokens, and the
outputs that differ from off's (lossless: must be 0), overall and for the originals (edit 0:
nothing earlier to draft from) apart from the edits.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from loadgen.datasets import read_jsonl
from loadgen.edit import EditConfig, edit_rows, in_order
from loadgen.workload import build_workload

from ..engine.suffix_decoding import SUFFIX_DECODING
from ..router.config import RouterConfig, SchedulerConfig
from ..serve import Embedded, ServeConfig
from ..zoo.specs import FAMILY_DIR
from .policy_config import PolicyBenchConfig, run_requests

MODES = ("with", "without", "off")
"""Auto with suffix decoding, auto without it, speculation off (a deployment of its own)."""


@dataclass
class SuffixBenchConfig:
    """What the comparison runs."""

    family_dir: Path = FAMILY_DIR
    """The model family both deployments serve."""
    dataset: Path | None = None
    """An edit workload file (``python -m loadgen.edit``; rows with ``group`` and ``edit``);
    None: built here from ``benchmarks/datasets/unseen-long.jsonl``'s ``split``."""
    split: str = "evaluation"
    """The source texts' half when the workload is built here."""
    groups: int = 6
    """Groups (a text and its edits) per pass."""
    rounds: int = 2
    """Passes, each over groups of its own."""
    edits: int = 2
    """Edits per text when the workload is built here."""
    words: int = 3
    """Words replaced per edit when the workload is built here."""
    new_tokens: int = 64
    """Tokens generated per request."""
    seed: int = 0
    policy_config: dict = field(default_factory=dict)
    """Overrides of the learned policy's settings, on both deployments."""


def _rows(cfg: SuffixBenchConfig) -> list[dict]:
    """The workload's rows: ``groups * rounds`` whole groups, in order."""
    if cfg.dataset is not None:
        rows = read_jsonl(cfg.dataset)
    else:
        rows = edit_rows(EditConfig(groups=cfg.groups * cfg.rounds, edits=cfg.edits,
                                    words=cfg.words, split=cfg.split, seed=cfg.seed))
    groups = sorted({r.get("group", i) for i, r in enumerate(rows)})[:cfg.groups * cfg.rounds]
    if len(groups) < cfg.groups * cfg.rounds:
        raise ValueError(f"the workload has {len(groups)} groups; {cfg.rounds} passes of "
                         f"{cfg.groups} want {cfg.groups * cfg.rounds}")
    keep = set(groups)
    return [r for i, r in enumerate(rows) if r.get("group", i) in keep]


def _deployment(cfg: SuffixBenchConfig, suffix: bool) -> Embedded:
    router = RouterConfig(policy="learned", policy_config=cfg.policy_config,
                          scheduler=SchedulerConfig(suffix_decoding=suffix))
    return Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                                log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-suffix-"))))


def run_suffix(cfg: SuffixBenchConfig, progress: bool = True) -> dict:
    """Run the comparison; the report (module doc) as a dict."""
    rows = _rows(cfg)
    reqs = in_order(rows)
    groups = sorted({r.get("group", i) for i, r in enumerate(rows)})
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              seed=cfg.seed)
    per: list[dict] = []
    with (_deployment(cfg, True) as ew, _deployment(cfg, False) as eo,
          _deployment(cfg, False) as ef):
        for emb in (ew, eo, ef):  # load the models' first steps (not a text of the workload)
            run_requests(emb.endpoint, build_workload(1, seed=cfg.seed,
                                                      family_dir=cfg.family_dir), "off", 0,
                         bench, "warm-up", progress=False)
        for i, (w, row) in enumerate(tqdm(list(zip(reqs, rows)), desc="edit requests",
                                          unit="req", disable=not progress)):
            rnd = groups.index(row.get("group", i)) // cfg.groups
            order = [("with", ew, "auto"), ("without", eo, "auto")]
            one: dict = {"group": row.get("group", i), "edit": row.get("edit", 0), "pass": rnd}
            for mode, emb, spec in (order if i % 2 == 0 else order[::-1]) + [("off", ef, "off")]:
                (res,), _ = run_requests(emb.endpoint, [w], spec, 0, bench, mode,
                                         progress=False)
                used = res.speculation.drafters.get(SUFFIX_DECODING)
                one[mode] = {"e2e_s": res.e2e_s, "tokens": res.token_ids,
                             "steps": res.speculation.steps,
                             "accepted": res.speculation.accepted_tokens,
                             "suffix_accepted": used.accepted_tokens if used else 0}
            per.append(one)
    return _report(cfg, per)


def _rate(reqs: list[dict], mode: str) -> float:
    return (sum(len(r[mode]["tokens"]) for r in reqs)
            / sum(r[mode]["e2e_s"] for r in reqs))


def _report(cfg: SuffixBenchConfig, per: list[dict]) -> dict:
    rates = {m: _rate(per, m) for m in MODES}
    passes = [[r for r in per if r["pass"] == p] for p in range(cfg.rounds)]
    edits = [r for r in per if r["edit"]]
    firsts = [r for r in per if not r["edit"]]
    mismatch = {m: sum(r[m]["tokens"] != r["off"]["tokens"] for r in per) for m in MODES}
    accepted = sum(r["with"]["accepted"] for r in per)
    return {
        "config": {"groups": cfg.groups, "rounds": cfg.rounds, "edits": cfg.edits,
                   "words": cfg.words, "new_tokens": cfg.new_tokens, "split": cfg.split,
                   "dataset": str(cfg.dataset) if cfg.dataset else None, "seed": cfg.seed,
                   "policy_config": cfg.policy_config, "requests": len(per)},
        "tokens_per_s": rates,
        "with_over_without": rates["with"] / rates["without"],
        "with_over_without_by_pass": [_rate(p, "with") / _rate(p, "without") for p in passes],
        "with_over_without_edits": (_rate(edits, "with") / _rate(edits, "without")
                                    if edits else None),
        "with_over_without_originals": (_rate(firsts, "with") / _rate(firsts, "without")
                                        if firsts else None),
        "median_request_ratio": statistics.median(
            r["without"]["e2e_s"] / r["with"]["e2e_s"] for r in per),
        "with_over_off": rates["with"] / rates["off"],
        "without_over_off": rates["without"] / rates["off"],
        "tau": {m: sum(len(r[m]["tokens"]) for r in per) / max(1, sum(r[m]["steps"] for r in per))
                for m in MODES},
        "suffix_share_of_accepted": (sum(r["with"]["suffix_accepted"] for r in per) / accepted
                                     if accepted else 0.0),
        "greedy_mismatches": mismatch["with"] + mismatch["without"],
        "requests": [{k: v if k not in MODES else {x: y for x, y in v.items() if x != "tokens"}
                      for k, v in r.items()} for r in per],
    }


def summary(report: dict) -> str:
    """The comparison in a few lines."""
    t, r = report["tokens_per_s"], report
    edits = f"{r['with_over_without_edits']:.3f}x" if r["with_over_without_edits"] else "-"
    firsts = (f"{r['with_over_without_originals']:.3f}x" if r["with_over_without_originals"]
              else "-")
    return "\n".join([
        f"tokens/s: with suffix decoding {t['with']:.1f}, without {t['without']:.1f}, "
        f"off {t['off']:.1f} ({r['config']['requests']} requests, single stream, greedy)",
        f"with / without: {r['with_over_without']:.3f}x (passes: "
        + ", ".join(f"{x:.3f}" for x in r["with_over_without_by_pass"])
        + f"); edits {edits}, originals {firsts}; median per-request "
        f"{r['median_request_ratio']:.3f}x",
        f"against off: with {r['with_over_off']:.3f}x, without {r['without_over_off']:.3f}x; "
        f"tau with {r['tau']['with']:.2f}, without {r['tau']['without']:.2f}; suffix decoding "
        f"accepted {100 * r['suffix_share_of_accepted']:.0f}% of the tokens accepted with it",
        f"greedy outputs that differ from off: {r['greedy_mismatches']}"])
