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

With ``share`` (``spin bench suffix --share``) both deployments run suffix decoding and a second
router over the same services and Redis, as a cluster's router replicas: **with** shares the
routers' texts through Redis (``--suffix-share``, ``stats/suffix_share.py``), **without** does
not. Each group's original goes to the first router, its edits to the second, so *without*'s
second router drafts an edit only from the group's earlier edits it served itself, *with*'s from
the original the other router served too. After each original on *with*, the bench waits until
the second router has received it (its metrics) and reports how long that took from the
request's end: the run measures drafting from shared texts, the waits how soon they arrive.

Reported: tokens per second of each (all tokens over the summed end-to-end seconds), with /
without overall and per pass, the median per-request ratio of end-to-end seconds
(without / with), both against off, suffix decoding's share of the accepted tokens, and the
outputs that differ from off's (lossless: must be 0), overall and for the originals (edit 0:
nothing earlier to draft from) apart from the edits.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from loadgen.datasets import read_jsonl
from loadgen.edit import EditConfig, edit_rows, in_order
from loadgen.workload import build_workload

from ..engine.suffix_decoding import SUFFIX_DECODING
from ..router.config import RouterConfig, SchedulerConfig
from ..serve import Embedded, ServeConfig
from ..supervisor import Child
from ..zoo.specs import FAMILY_DIR
from .policy_config import PolicyBenchConfig, run_requests
from .scrape import scrape

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
    share: bool = False
    """Compare two routers sharing suffix decoding's texts through Redis (*with*) against two
    that do not (*without*), originals sent to the first, edits to the second (module doc)."""


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


def _deployment(cfg: SuffixBenchConfig, suffix: bool, share: bool = False) -> Embedded:
    router = RouterConfig(policy="learned", policy_config=cfg.policy_config,
                          scheduler=SchedulerConfig(suffix_decoding=suffix, suffix_share=share))
    return Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                                log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-suffix-"))))


def _deployments(cfg: SuffixBenchConfig) -> tuple[Embedded, Embedded, Embedded]:
    """*with*, *without* and off's deployments (not started)."""
    if cfg.share:
        return _deployment(cfg, True, True), _deployment(cfg, True), _deployment(cfg, False)
    return _deployment(cfg, True), _deployment(cfg, False), _deployment(cfg, False)


def _received(router: Child) -> float:
    return scrape(router.metrics_port).get('spin:suffix_share_texts_total{event="received"}', 0)


def _arrival(router: Child, texts: float, timeout_s: float = 60.0) -> float:
    """Seconds until ``router`` has received ``texts`` texts from the other router."""
    start = time.monotonic()
    while _received(router) < texts:
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{router.role} did not receive the other router's texts in "
                               f"{timeout_s:.0f} s (see its log, {router.log_path})")
        time.sleep(0.01)
    return time.monotonic() - start


def run_suffix(cfg: SuffixBenchConfig, progress: bool = True) -> dict:
    """Run the comparison; the report (module doc) as a dict."""
    rows = _rows(cfg)
    reqs = in_order(rows)
    groups = sorted({r.get("group", i) for i, r in enumerate(rows)})
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              seed=cfg.seed)
    per: list[dict] = []
    ew, eo, ef = _deployments(cfg)
    with ew, eo, ef:
        # where each mode's originals (edit 0) and edits go: one router, or the second for edits
        second = {m: e.add_router() for m, e in (("with", ew), ("without", eo))} if cfg.share \
            else {}
        ends = {m: (e.endpoint, f"127.0.0.1:{second[m].port}" if m in second else e.endpoint)
                for m, e in (("with", ew), ("without", eo), ("off", ef))}
        for end in {x for pair in ends.values() for x in pair}:  # the first steps' loading
            run_requests(end, build_workload(1, seed=cfg.seed, family_dir=cfg.family_dir),
                         "off", 0, bench, "warm-up", progress=False)
        published = 1.0 if cfg.share else 0.0  # the first router's warm-up text
        waits: list[float] = []
        for i, (w, row) in enumerate(tqdm(list(zip(reqs, rows)), desc="edit requests",
                                          unit="req", disable=not progress)):
            rnd = groups.index(row.get("group", i)) // cfg.groups
            edit = row.get("edit", 0)
            order = ["with", "without"]
            one: dict = {"group": row.get("group", i), "edit": edit, "pass": rnd}
            for mode in (order if i % 2 == 0 else order[::-1]) + ["off"]:
                (res,), _ = run_requests(ends[mode][bool(edit)], [w],
                                         "off" if mode == "off" else "auto", 0, bench, mode,
                                         progress=False)
                used = res.speculation.drafters.get(SUFFIX_DECODING)
                one[mode] = {"e2e_s": res.e2e_s, "tokens": res.token_ids,
                             "steps": res.speculation.steps,
                             "accepted": res.speculation.accepted_tokens,
                             "suffix_accepted": used.accepted_tokens if used else 0}
                if mode == "with" and cfg.share and not edit:  # until the other router has it
                    published += 1
                    waits.append(_arrival(second["with"], published))
            per.append(one)
    report = _report(cfg, per)
    if cfg.share:
        report["share_wait_s"] = {"median": statistics.median(waits) if waits else None,
                                  "max": max(waits, default=None)}
    return report


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
                   "policy_config": cfg.policy_config, "requests": len(per),
                   "share": cfg.share},
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
    share = r["config"].get("share")
    what = ("two routers sharing suffix decoding's texts" if share else "with suffix decoding")
    waits = r.get("share_wait_s") or {}
    return "\n".join([
        f"tokens/s: {what} {t['with']:.1f}, without {t['without']:.1f}, "
        f"off {t['off']:.1f} ({r['config']['requests']} requests, single stream, greedy)",
        *([f"an original reached the second router {waits['median']:.3f} s after its end "
           f"(median; at most {waits['max']:.3f} s)"] if waits.get("max") is not None else []),
        f"with / without: {r['with_over_without']:.3f}x (passes: "
        + ", ".join(f"{x:.3f}" for x in r["with_over_without_by_pass"])
        + f"); edits {edits}, originals {firsts}; median per-request "
        f"{r['median_request_ratio']:.3f}x",
        f"against off: with {r['with_over_off']:.3f}x, without {r['without_over_off']:.3f}x; "
        f"tau with {r['tau']['with']:.2f}, without {r['tau']['without']:.2f}; suffix decoding "
        f"accepted {100 * r['suffix_share_of_accepted']:.0f}% of the tokens accepted with it",
        f"greedy outputs that differ from off: {r['greedy_mismatches']}"])
