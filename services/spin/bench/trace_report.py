"""``spin bench trace FILE``: what a router's step trace says of speculation, kind by kind.

Reads a trace (``router/step_trace.py``: ``spin serve --step-trace FILE``, ``spin bench grid
--trace DIR``) and groups its steps by kind, as the learned policy's loss guard does: the batch
size's bit length, the decoding (greedy, sampled or mixed) and the step's mode: ``prefill`` (a
request's first step, which prefills its prompt: such a step's time is the prompts'), else
``speculating`` (a request drafted), ``plain`` (the policy planned it and no request drafted:
k = 0 chosen) or ``unplanned`` (no prediction: speculation off, or a client's own drafter and
k). Per kind: steps, output tokens per second of step (tokens over the steps' seconds), and how the
cost model's predictions compared with the measurements (mean predicted over measured seconds,
for the step, the verification and the slowest drafter's call). Per batch size and decoding,
the gain the controller predicted for its speculating steps (expected tokens per predicted
second, over the batch's tokens per predicted plain second) beside the gain measured (the
speculating steps' tokens per second over those of the steps of that size and decoding where no
request drafted, planned or not; prefill steps left out), where both sides ran.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from ..router.step_trace import read_trace


def _decoding(rec: dict) -> str:
    greedy = {bool(r[6]) for r in rec["requests"]}
    return "mixed" if len(greedy) > 1 else "greedy" if greedy == {True} else "sampled"


def kind(rec: dict) -> tuple[int, str, str]:
    """(bit length of the batch size, decoding, mode: prefill, speculating, plain or
    unplanned)."""
    spec = any(r[2] > 0 and r[1] is not None for r in rec["requests"])
    mode = ("prefill" if any(r[7] for r in rec["requests"] if len(r) > 7)
            else "speculating" if spec
            else "plain" if rec["predicted"] is not None else "unplanned")
    return max(1, rec["batch"]).bit_length(), _decoding(rec), mode


def _ratio(pred: list[float], meas: list[float]) -> float | None:
    pairs = [(p, m) for p, m in zip(pred, meas) if p is not None and m and m > 0]
    return statistics.mean(p / m for p, m in pairs) if pairs else None


def summarize(records: list[dict]) -> dict:
    """Per kind: steps, tokens/s, prediction ratios; per (bucket, decoding): predicted and
    measured gain of speculation. Records of an empty batch are left out."""
    groups: dict[tuple[int, str, str], list[dict]] = defaultdict(list)
    for rec in records:
        if rec["batch"] > 0:
            groups[kind(rec)].append(rec)
    kinds = []
    for (bucket, decoding, mode), recs in sorted(groups.items()):
        tokens = sum(r[5] for rec in recs for r in rec["requests"])
        seconds = sum(rec["step_s"] for rec in recs)
        pred = [rec["predicted"] for rec in recs]
        kinds.append({
            "batch": f"{1 << (bucket - 1)}-{(1 << bucket) - 1}", "bucket": bucket,
            "decoding": decoding, "mode": mode, "steps": len(recs),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "mean_step_s": seconds / len(recs),
            "predicted_over_measured": {
                "step": _ratio([p and p["step_s"] for p in pred], [r["step_s"] for r in recs]),
                "verify": _ratio([p and p["verify_s"] for p in pred],
                                 [r["verify_s"] for r in recs]),
                "draft": _ratio([p and max(p["draft_s"].values(), default=None) for p in pred],
                                [max(r["draft_s"].values(), default=0.0) for r in recs])}})
    return {"steps": sum(len(g) for g in groups.values()), "kinds": kinds,
            "gain": _gains(groups)}


def _gains(groups: dict[tuple[int, str, str], list[dict]]) -> list[dict]:
    out = []
    for (bucket, decoding, mode), recs in sorted(groups.items()):
        plain = [rec for m in ("plain", "unplanned")
                 for rec in groups.get((bucket, decoding, m), [])]
        if mode != "speculating" or not plain:
            continue
        rate = [sum(r[5] for rec in g for r in rec["requests"]) / sum(rec["step_s"] for rec in g)
                for g in (recs, plain)]
        predicted = [rec["predicted"]["tokens"] / rec["predicted"]["step_s"]
                     / (rec["batch"] / rec["predicted"]["plain_s"])
                     for rec in recs if rec["predicted"] and rec["predicted"].get("tokens")
                     and rec["predicted"]["step_s"] and rec["predicted"].get("plain_s")]
        out.append({"batch": f"{1 << (bucket - 1)}-{(1 << bucket) - 1}", "decoding": decoding,
                    "speculating_steps": len(recs), "plain_steps": len(plain),
                    "predicted_gain": statistics.median(predicted) if predicted else None,
                    "measured_gain": rate[0] / rate[1] if rate[1] > 0 else None})
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def table(report: dict) -> str:
    """The report as two Markdown tables."""
    lines = ["| batch | decoding | mode | steps | tok/s | step s | pred/meas step | "
             "verify | draft |", "|---|---|---|---|---|---|---|---|---|"]
    for k in report["kinds"]:
        r = k["predicted_over_measured"]
        lines.append(f"| {k['batch']} | {k['decoding']} | {k['mode']} "
                     f"| {k['steps']} | {k['tokens_per_s']:.1f} | {k['mean_step_s']:.4f} | "
                     f"{_f(r['step'])} | {_f(r['verify'])} | {_f(r['draft'])} |")
    lines += ["", "| batch | decoding | speculating / other steps | predicted gain | "
              "measured gain |", "|---|---|---|---|---|"]
    for g in report["gain"]:
        lines.append(f"| {g['batch']} | {g['decoding']} | {g['speculating_steps']} / "
                     f"{g['plain_steps']} | {_f(g['predicted_gain'], '.3f')}x | "
                     f"{_f(g['measured_gain'], '.3f')}x |")
    return "\n".join(lines)


def report_file(path: Path) -> dict:
    return summarize(read_trace(path))
