"""``spin bench prediction``: Predicted Outputs (a request's ``prediction``) on the code-edit
workload, against the same requests without a prediction and with speculation off, side by
side in one run.

Three ``spin serve`` deployments of the demo family, configured alike (the default pool, suffix
decoding and prefix caching included): **prediction** gets each request with a prediction,
**auto** the same request without one, **off** the same request with speculation off (the
reference: outputs must equal it, greedy). Each deployment sees each prompt once, so neither the
prefix cache nor the suffix store has timed a request before. Which of *prediction* and *auto*
goes first alternates from request to request (both see the same moment's machine).

The workload (``loadgen/edit.py`` restricted to ``domain``, by default code from the evaluation
half of ``benchmarks/datasets/unseen-long.jsonl``): a *group* is a file, then ``edits`` versions
of it with ``words`` words replaced, each prompt asking to repeat its version with the change;
a group's requests go in order, single stream. The prediction (``source``):

- ``file``: the file as its group started (edit 0's text), what a client asking an
  instruction-following model to rewrite a file sends (OpenAI's use of ``prediction``). The demo
  target is a small completion model that does not repeat a text it is shown (it continues it),
  so here this measures what a prediction that the output does not follow costs.
- ``previous-output``: the output this deployment gave for the group's previous version (edit 0
  has none and goes without): a client that asks again after a small change predicts the answer
  it had, the file as the model last wrote it. *auto*'s suffix store holds that output too (its
  own, for the same prompt), so *prediction* / *auto* is what a prediction adds beyond suffix
  decoding.

Each temperature is a cell with groups of its own. Reported per cell: tokens per second of each
(all tokens over the summed end-to-end seconds), prediction / auto and both against off, over all
requests and over those that carried a prediction; the median per-request speed-up over off of
those; τ (tokens per verification step); the prediction drafter's share of the accepted tokens;
the usage's accepted and rejected prediction tokens; greedy outputs that differ from off's.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from loadgen.datasets import read_jsonl
from loadgen.edit import EditConfig, edit_rows
from loadgen.workload import build_workload

from ..engine.prediction import PREDICTION
from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig
from ..zoo.specs import FAMILY_DIR
from . import stream

MODES = ("prediction", "auto", "off")
"""Auto with the request's prediction, auto without it, speculation off."""

Source = Literal["previous-output", "file"]


@dataclass
class PredictionBenchConfig:
    """What the comparison runs."""

    family_dir: Path = FAMILY_DIR
    """The model family the three deployments serve."""
    dataset: Path | None = None
    """An edit workload file (``python -m loadgen.edit``; rows with ``group`` and ``edit``);
    None: built here from ``benchmarks/datasets/unseen-long.jsonl``'s ``split`` and
    ``domain``."""
    split: str = "evaluation"
    """The source texts' half when the workload is built here."""
    domain: str = "code"
    """The source texts' domain when the workload is built here."""
    groups: int = 6
    """Groups (a file and its edits) per cell."""
    edits: int = 2
    """Edits per file when the workload is built here."""
    words: int = 3
    """Words replaced per edit when the workload is built here."""
    new_tokens: int = 128
    """max_tokens per request."""
    temperatures: tuple[float, ...] = (0.0, 0.8)
    """One cell per temperature (0: greedy)."""
    source: Source = "previous-output"
    """What a request predicts (module doc)."""
    seed: int = 0
    """Seed of sampled requests (request i: seed + i) and of the edits."""
    policy_config: dict = field(default_factory=dict)
    """Overrides of the learned policy's settings, on every deployment."""


def _groups(cfg: PredictionBenchConfig) -> list[list[dict]]:
    """``groups`` whole groups per cell, each in order."""
    want = cfg.groups * len(cfg.temperatures)
    rows = read_jsonl(cfg.dataset) if cfg.dataset is not None else edit_rows(
        EditConfig(groups=want, edits=cfg.edits, words=cfg.words, split=cfg.split,
                   domain=cfg.domain, seed=cfg.seed))
    order: dict[int, list[dict]] = {}
    for i, r in enumerate(rows):
        order.setdefault(r.get("group", i), []).append(r)
    if len(order) < want:
        raise ValueError(f"the workload has {len(order)} groups; {len(cfg.temperatures)} cells "
                         f"of {cfg.groups} want {want}")
    return list(order.values())[:want]


def text_of(row: dict) -> str:
    """The version a row asks to repeat (``text``, else its prompt past the instruction)."""
    return row.get("text") or row["prompt"].split("\n\n", 1)[-1]


def _deployment(cfg: PredictionBenchConfig) -> Embedded:
    router = RouterConfig(policy="learned", policy_config=cfg.policy_config)
    return Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                                log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-prediction-"))))


def _measure(res: dict) -> dict:
    return {"tokens": res["tokens"], "e2e_s": res["e2e_s"], "steps": res["steps"],
            "accepted": res["accepted"], "prediction_accepted": res["drafters"].get(PREDICTION, 0),
            "accepted_prediction_tokens": res["usage"].accepted_prediction_tokens,
            "rejected_prediction_tokens": res["usage"].rejected_prediction_tokens}


def run_prediction(cfg: PredictionBenchConfig, progress: bool = True) -> dict:
    """Run the comparison; the report (module doc) as a dict."""
    groups = _groups(cfg)
    per: list[dict] = []
    bar = tqdm(total=sum(map(len, groups)), desc="edit requests", unit="req",
               disable=not progress)
    with _deployment(cfg) as ep, _deployment(cfg) as ea, _deployment(cfg) as eo:
        warm = build_workload(1, seed=cfg.seed, family_dir=cfg.family_dir)[0].prompt
        for emb in (ep, ea, eo):  # the models' first steps (not a text of the workload)
            stream.generate(emb.endpoint, stream.request(warm, "auto", 0.0, 0, cfg.new_tokens))
        for g, group in enumerate(groups):
            temp = cfg.temperatures[g // cfg.groups]
            previous: str | None = None
            for row in group:
                pred = text_of(group[0]) if cfg.source == "file" else previous
                one: dict = {"temperature": temp, "group": row.get("group", g),
                             "edit": row.get("edit", 0), "predicted": pred is not None}
                seed = cfg.seed + len(per)
                order = [("prediction", ep, "auto"), ("auto", ea, "auto")]
                for name, emb, mode in (order if len(per) % 2 == 0 else order[::-1]) + [
                        ("off", eo, "off")]:
                    req = stream.request(row["prompt"], mode, temp, seed, cfg.new_tokens)
                    if name == "prediction" and pred:
                        req.prediction = pred
                    res = stream.generate(emb.endpoint, req)
                    one[name] = _measure(res)
                    if name == "prediction":
                        previous = res["text"]
                per.append(one)
                bar.update()
    bar.close()
    return _report(cfg, per)


def _rate(reqs: list[dict], mode: str) -> float:
    return sum(len(r[mode]["tokens"]) for r in reqs) / sum(r[mode]["e2e_s"] for r in reqs)


def _ratios(reqs: list[dict]) -> dict:
    rates = {m: _rate(reqs, m) for m in MODES}
    return {"tokens_per_s": rates, "prediction_over_off": rates["prediction"] / rates["off"],
            "auto_over_off": rates["auto"] / rates["off"],
            "prediction_over_auto": rates["prediction"] / rates["auto"]}


def _cell(temp: float, reqs: list[dict]) -> dict:
    predicted = [r for r in reqs if r["predicted"]]
    accepted = sum(r["prediction"]["accepted"] for r in reqs)
    return {
        "temperature": temp, "requests": len(reqs), "predicted": len(predicted), **_ratios(reqs),
        "predicted_only": _ratios(predicted) if predicted else None,
        "median_request_speedup_over_off": statistics.median(
            r["off"]["e2e_s"] / r["prediction"]["e2e_s"] for r in predicted) if predicted else None,
        "tau": {m: sum(len(r[m]["tokens"]) for r in reqs) / max(1, sum(r[m]["steps"]
                                                                       for r in reqs))
                for m in MODES},
        "prediction_share_of_accepted": (sum(r["prediction"]["prediction_accepted"]
                                             for r in reqs) / accepted if accepted else 0.0),
        "accepted_prediction_tokens": sum(r["prediction"]["accepted_prediction_tokens"]
                                          for r in reqs),
        "rejected_prediction_tokens": sum(r["prediction"]["rejected_prediction_tokens"]
                                          for r in reqs),
        "greedy_mismatches": (sum(r[m]["tokens"] != r["off"]["tokens"] for r in reqs
                                  for m in ("prediction", "auto")) if temp == 0 else None)}


def _report(cfg: PredictionBenchConfig, per: list[dict]) -> dict:
    temps = list(dict.fromkeys(r["temperature"] for r in per))
    return {"config": {"source": cfg.source, "groups": cfg.groups, "edits": cfg.edits,
                       "words": cfg.words, "new_tokens": cfg.new_tokens, "split": cfg.split,
                       "domain": cfg.domain, "temperatures": list(cfg.temperatures),
                       "dataset": str(cfg.dataset) if cfg.dataset else None, "seed": cfg.seed,
                       "policy_config": cfg.policy_config, "requests": len(per)},
            "cells": [_cell(t, [r for r in per if r["temperature"] == t]) for t in temps],
            "requests": [{k: v if k not in MODES else {x: y for x, y in v.items()
                                                       if x != "tokens"}
                          for k, v in r.items()} for r in per]}


def summary(report: dict) -> str:
    """The comparison as a table."""
    c = report["config"]
    lines = [f"Predicted Outputs ({c['source']}), {c['requests']} {c['domain']}-edit requests, "
             "single stream; tokens/s with the prediction / without / off",
             "temp  pred  without    off  pred/off  without/off  pred/without  "
             "predicted-only pred/off  median  tau(pred/without)  pred%acc  "
             "accepted/rejected  greedy diffs"]
    for x in report["cells"]:
        t, po = x["tokens_per_s"], x["predicted_only"]
        lines.append(
            f"{x['temperature']:4.1f}  {t['prediction']:4.1f}  {t['auto']:7.1f}  {t['off']:5.1f}"
            f"  {x['prediction_over_off']:8.3f}  {x['auto_over_off']:11.3f}  "
            f"{x['prediction_over_auto']:12.3f}  "
            + (f"{po['prediction_over_off']:23.3f}  {x['median_request_speedup_over_off']:6.3f}"
               if po else f"{'-':>23}  {'-':>6}")
            + f"  {x['tau']['prediction']:8.2f}/{x['tau']['auto']:<8.2f}  "
            f"{100 * x['prediction_share_of_accepted']:8.0f}  "
            f"{x['accepted_prediction_tokens']:>8}/{x['rejected_prediction_tokens']:<8}  "
            f"{x['greedy_mismatches'] if x['greedy_mismatches'] is not None else '-'}")
    return "\n".join(lines)
