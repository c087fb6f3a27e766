"""``spin bench structured``: structured output with the grammar drafter in the pool against
without it, on the schema workload (``loadgen/schemas.py``), side by side in one run.

Two ``spin serve`` deployments of the demo family, the same in all but one setting: **with**
uses the grammar's forced tokens (the default: drafted where the grammar allows one
continuation, appended unverified where it allows one token), **without** does not
(``SchedulerConfig.grammar_drafts``); both constrain every request to its schema. Each
cell (a concurrency x a temperature) sends its own requests (none seen before: suffix decoding
would draft a request sent again from its first output, and a prompt sent again would be
prefilled from the prefix cache) to *with* and *without* (which goes first alternates from cell
to cell, so both see the same machine), then with speculation off to a third deployment like
*without*, the constrained reference: each deployment sees each prompt once. All three are
warmed on the tuning split's texts. A concurrency of c keeps c requests in flight (a closed
loop); its tokens per second are all tokens over the wall seconds of the whole set.

Reported per cell: tokens per second of each, with / without and both against off, the grammar
drafter's share of the accepted tokens, how many outputs parse and follow their schema
(``jsonschema``; an output cut by ``max_tokens`` does not), greedy outputs that differ from off's
(lossless: must be 0); overall: the router's seconds computing the grammar's rows and cut
drafts against its step seconds (``spin:grammar_seconds`` / ``spin:step_seconds``), and the
share of its tokens the grammar forced (appended unverified: ``spin:grammar_forced_tokens`` /
``spin:generation_tokens``), the *with* router's metrics over the whole run.
"""

from __future__ import annotations

import concurrent.futures
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
from tqdm import tqdm

from loadgen.datasets import read_jsonl
from loadgen.schemas import SchemaConfig, schema_rows

from ..engine.model_free import GRAMMAR
from ..router.config import RouterConfig, SchedulerConfig
from ..serve import Embedded, ServeConfig
from ..v1 import generation_pb2
from ..zoo.specs import FAMILY_DIR
from . import stream
from .scrape import scrape

MODES = ("with", "without", "off")
"""Auto with the grammar drafter, auto without it, speculation off (a deployment of its own)."""


@dataclass
class StructuredBenchConfig:
    """What the comparison runs."""

    family_dir: Path = FAMILY_DIR
    """The model family both deployments serve."""
    dataset: Path | None = None
    """A schema workload file (``python -m loadgen.schemas``; rows with ``prompt`` and
    ``schema``); None: built here from ``benchmarks/datasets/unseen-long.jsonl``'s ``split``."""
    split: str = "evaluation"
    """The source texts' half when the workload is built here."""
    requests: int = 16
    """Requests per cell."""
    concurrency: tuple[int, ...] = (1, 16)
    """Requests in flight per cell."""
    temperatures: tuple[float, ...] = (0.0, 0.8)
    """Sampling temperature per cell (0: greedy)."""
    new_tokens: int = 160
    """max_tokens per request."""
    seed: int = 0
    """Seed of sampled requests (request i: seed + i)."""
    policy_config: dict = field(default_factory=dict)
    """Overrides of the learned policy's settings, on both deployments."""


def _deployment(cfg: StructuredBenchConfig, grammar: bool) -> Embedded:
    router = RouterConfig(policy="learned", policy_config=cfg.policy_config,
                          scheduler=SchedulerConfig(grammar_drafts=grammar))
    return Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                                log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-structured-"))))


def _one(endpoint: str, row: dict, mode: str, temperature: float, seed: int,
         new_tokens: int) -> dict:
    """One request: its tokens, text, seconds and the grammar drafter's accepted tokens."""
    req = stream.request(row["prompt"], mode, temperature, seed, new_tokens)
    req.grammar.CopyFrom(generation_pb2.Grammar(kind="json_schema",
                                                source=json.dumps(row["schema"])))
    res = stream.generate(endpoint, req)
    return {"tokens": res["tokens"], "text": res["text"], "e2e_s": res["e2e_s"],
            "accepted": res["accepted"], "grammar_accepted": res["drafters"].get(GRAMMAR, 0),
            "valid": _valid(res["text"], row["schema"])}


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _run(endpoint: str, rows: list[dict], mode: str, temperature: float,
         cfg: StructuredBenchConfig, concurrency: int) -> tuple[list[dict], float]:
    """Every row through ``endpoint``, ``concurrency`` at once: results and wall seconds."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(lambda ir: _one(endpoint, ir[1], mode, temperature,
                                            cfg.seed + ir[0], cfg.new_tokens),
                            enumerate(rows)))
    return out, time.perf_counter() - start


def _grammar_share(metrics_port: int) -> dict:
    """The router's grammar seconds and step seconds so far (its /metrics)."""
    values = scrape(metrics_port)
    return {name: values[name] for name in (
        "spin:grammar_seconds_total", "spin:step_seconds_sum", "spin:grammar_steps_total",
        "spin:grammar_forced_tokens_total", "spin:generation_tokens_total") if name in values}


def run_structured(cfg: StructuredBenchConfig, progress: bool = True) -> dict:
    """Run the comparison; the report (module doc) as a dict."""
    cells = [(c, t) for c in cfg.concurrency for t in cfg.temperatures]
    want = cfg.requests * len(cells)
    if cfg.dataset is not None:
        rows = read_jsonl(cfg.dataset)[:want]
    else:
        rows = schema_rows(SchemaConfig(requests=want, split=cfg.split))
    if len(rows) < want:
        raise ValueError(f"the workload has {len(rows)} requests; {len(cells)} cells of "
                         f"{cfg.requests} want {want}")
    warm = schema_rows(SchemaConfig(requests=2, split="tuning"))
    per: list[dict] = []
    with (_deployment(cfg, True) as ew, _deployment(cfg, False) as eo,
          _deployment(cfg, False) as ef):
        for emb in (ew, eo, ef):  # the models' first steps and the schemas' compilation
            _run(emb.endpoint, warm, "auto", 0.0, cfg, 2)
        before = _grammar_share(ew.router.metrics_port)
        for i, (conc, temp) in enumerate(tqdm(cells, desc="cells", unit="cell",
                                              disable=not progress)):
            order = [("with", ew, "auto"), ("without", eo, "auto")]
            cell: dict = {"concurrency": conc, "temperature": temp}
            mine = rows[i * cfg.requests:(i + 1) * cfg.requests]  # unseen by suffix decoding
            for name, emb, mode in (order if i % 2 == 0 else order[::-1]) + [("off", ef, "off")]:
                res, wall = _run(emb.endpoint, mine, mode, temp, cfg, conc)
                cell[name] = {"tokens_per_s": sum(len(r["tokens"]) for r in res) / wall,
                              "valid": sum(r["valid"] for r in res),
                              "accepted": sum(r["accepted"] for r in res),
                              "grammar_accepted": sum(r["grammar_accepted"] for r in res),
                              "outputs": [r["tokens"] for r in res]}
            per.append(cell)
        after = _grammar_share(ew.router.metrics_port)
    return _report(cfg, per, cfg.requests, before, after)


def _report(cfg: StructuredBenchConfig, per: list[dict], n: int, before: dict,
            after: dict) -> dict:
    cells = []
    for c in per:
        off = c["off"]["outputs"]
        cells.append({
            "concurrency": c["concurrency"], "temperature": c["temperature"],
            "tokens_per_s": {m: c[m]["tokens_per_s"] for m in MODES},
            "with_over_without": c["with"]["tokens_per_s"] / c["without"]["tokens_per_s"],
            "with_over_off": c["with"]["tokens_per_s"] / c["off"]["tokens_per_s"],
            "without_over_off": c["without"]["tokens_per_s"] / c["off"]["tokens_per_s"],
            "valid": {m: c[m]["valid"] for m in MODES},
            "grammar_share_of_accepted": (c["with"]["grammar_accepted"] / c["with"]["accepted"]
                                          if c["with"]["accepted"] else 0.0),
            "greedy_mismatches": (sum(a != b for m in ("with", "without")
                                      for a, b in zip(c[m]["outputs"], off))
                                  if c["temperature"] == 0 else None)})
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    grammar_s, step_s = grew("spin:grammar_seconds_total"), grew("spin:step_seconds_sum")
    generated = grew("spin:generation_tokens_total")
    return {"config": {"requests": n, "concurrency": list(cfg.concurrency),
                       "temperatures": list(cfg.temperatures), "new_tokens": cfg.new_tokens,
                       "split": cfg.split, "dataset": str(cfg.dataset) if cfg.dataset else None,
                       "seed": cfg.seed, "policy_config": cfg.policy_config},
            "cells": cells,
            "grammar_share_of_step": grammar_s / step_s if step_s else None,
            "grammar_ms_per_request_step": 1e3 * grammar_s / max(1.0, grew(
                "spin:grammar_steps_total")),
            "forced_share_of_tokens": (grew("spin:grammar_forced_tokens_total") / generated
                                       if generated else None)}


def summary(report: dict) -> str:
    """The comparison as a table."""
    lines = [f"{report['config']['requests']} schema requests per cell; tokens/s with the "
             "grammar drafter / without / off",
             "conc  temp   with  without    off  with/without  with/off  without/off  "
             "grammar%acc  valid(w/wo/off)  greedy diffs"]
    for c in report["cells"]:
        t, v = c["tokens_per_s"], c["valid"]
        lines.append(f"{c['concurrency']:4d}  {c['temperature']:4.1f}  {t['with']:5.1f}  "
                     f"{t['without']:7.1f}  {t['off']:5.1f}  {c['with_over_without']:12.3f}  "
                     f"{c['with_over_off']:8.3f}  {c['without_over_off']:11.3f}  "
                     f"{100 * c['grammar_share_of_accepted']:11.0f}  "
                     f"{v['with']:>4}/{v['without']}/{v['off']:<8}  "
                     f"{c['greedy_mismatches'] if c['greedy_mismatches'] is not None else '-'}")
    share, forced = report["grammar_share_of_step"], report.get("forced_share_of_tokens")
    lines.append(f"grammar rows and cut drafts: {100 * share:.2f}% of the router's step time, "
                 f"{report['grammar_ms_per_request_step']:.3f} ms per request-step"
                 if share is not None else "grammar share: no steps")
    if forced is not None:
        lines.append(f"tokens the grammar forced (appended unverified, with): {100 * forced:.0f}%")
    return "\n".join(lines)
