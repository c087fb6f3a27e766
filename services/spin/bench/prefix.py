"""``spin bench prefix``: the chat workload with prefix caching on and off, side by side.

Two deployments of ``spin serve``'s processes run at once, alike but for ``--prefix-caching``
(the verifier's and every drafter's). Each is warmed with a request of the workload's system
prompt without speculation and one drafted by each draft model (a chat service has always seen
its system prompt, in the verifier and in every drafter). Then ``rounds`` passes send
``requests`` requests of the multi-turn chat workload (``loadgen.chat``: a
``system_tokens``-token system prompt shared by all, each later turn repeating its
conversation's earlier turns) at ``concurrency`` in flight, the two deployments in turn, their
order reversed every other pass; every pass sends conversations no pass sent before,
the same ones to both. Reported per deployment: time to first token (median and p90 over every
request), output tokens per second (all tokens over the summed wall time), the verifier's prefix
cache hit rate from its ``/metrics``; and the ratios, and greedy outputs that differ between the
two (lossless: must be 0).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from loadgen.chat import DEFAULT_SOURCE, ChatShape, make_chat
from loadgen.datasets import read_prompts
from loadgen.workload import Request, build_workload

from ..engine.model_runner import RunnerConfig
from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig
from ..zoo.report import family_members
from ..zoo.specs import FAMILY_DIR
from .policy_config import PolicyBenchConfig, run_requests
from .scrape import scrape

MODES = ("prefix caching", "no prefix caching")


@dataclass
class PrefixBenchConfig:
    """What ``spin bench prefix`` runs."""

    family_dir: Path = FAMILY_DIR
    source: Path = DEFAULT_SOURCE
    """The text the chat workload is cut from (its evaluation half)."""
    concurrency: int = 32
    requests: int = 64
    """Requests per pass and deployment."""
    rounds: int = 2
    new_tokens: int = 32
    speculation: str = "auto"
    """The requests' speculation mode (the same in both deployments)."""
    shape: ChatShape = field(default_factory=ChatShape)
    """The workload (its ``conversations`` are set from ``requests`` and ``rounds``)."""
    seed: int = 0


def _prefix_counts(port: int) -> tuple[float, float]:
    """(queries, hits) of the verifier's prefix cache counters at ``/metrics``."""
    out = [0.0, 0.0]
    for key, value in scrape(port).items():
        m = re.match(r'spin:prefix_cache_(queries|hits)_total\{[^}]*role="verifier"', key)
        if m:
            out[m.group(1) == "hits"] += value
    return out[0], out[1]


def _passes(cfg: PrefixBenchConfig) -> tuple[list[list[Request]], Request]:
    """Each pass's requests (conversations no other pass has) and the warm-up request."""
    turns = cfg.shape.turns
    per_pass = -(-cfg.requests // turns)
    shape = ChatShape(cfg.shape.system_tokens, per_pass * cfg.rounds, turns,
                      cfg.shape.user_tokens, cfg.shape.reply_tokens, cfg.seed)
    texts = [r["prompt"] for r in read_prompts(cfg.source)
             if r.get("split", "evaluation") == "evaluation"]
    rows = make_chat(texts, AutoTokenizer.from_pretrained(cfg.family_dir / "target"), shape)
    passes = [build_workload(cfg.requests, rows=rows[r * per_pass * turns:
                                                     (r + 1) * per_pass * turns], seed=cfg.seed)
              for r in range(cfg.rounds)]
    system = rows[0]["prompt"].split("\n\nUser:", 1)[0]
    return passes, Request(0, "warm-up", system + "\n\nUser: hello\n\nAssistant:", 0.0)


def run_prefix(cfg: PrefixBenchConfig, progress: bool = True) -> dict:
    """Both deployments, every pass; the report."""
    passes, warm = _passes(cfg)
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              seed=cfg.seed)
    runs: dict[str, list] = {m: [] for m in MODES}  # mode -> per pass (results, wall)
    counts: dict[str, tuple[float, float]] = {}
    with contextlib.ExitStack() as stack:
        emb = {}
        for mode in MODES:
            log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-prefix-"))
            emb[mode] = stack.enter_context(Embedded(ServeConfig(
                family_dir=cfg.family_dir, port=0, log_dir=log_dir,
                router=RouterConfig(policy="learned"),
                runner=RunnerConfig(prefix_caching=mode == MODES[0]))))
            for spec, k in [("off", 0)] + [(d, 4) for d in family_members(cfg.family_dir)]:
                run_requests(emb[mode].endpoint, [warm], spec, k, bench, f"{mode}: warm-up",
                             progress=False)
        for rnd, reqs in enumerate(passes):
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                runs[mode].append(run_requests(
                    emb[mode].endpoint, reqs, cfg.speculation, 0, bench,
                    f"{mode} ({rnd + 1}/{cfg.rounds})", concurrency=cfg.concurrency,
                    progress=progress))
        for mode in MODES:
            counts[mode] = _prefix_counts(emb[mode].child("verifier", "verifier").metrics_port)
    report: dict = {"config": {"concurrency": cfg.concurrency, "requests": cfg.requests,
                               "rounds": cfg.rounds, "new_tokens": cfg.new_tokens,
                               "speculation": cfg.speculation,
                               "system_tokens": cfg.shape.system_tokens,
                               "turns": cfg.shape.turns, "source": str(cfg.source)},
                    "modes": {}}
    for mode, rs in runs.items():
        ttfts = sorted(r.ttft_s for res, _ in rs for r in res)
        tokens = sum(len(r.token_ids) for res, _ in rs for r in res)
        queries, hits = counts[mode]
        report["modes"][mode] = {
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "tokens_per_s": tokens / sum(wall for _, wall in rs),
            "tokens_per_s_by_round": [sum(len(r.token_ids) for r in res) / wall
                                      for res, wall in rs],
            "verifier_prefix_hit_rate": hits / queries if queries else 0.0}
    on, off = (report["modes"][m] for m in MODES)
    report["ttft_p50_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    report["throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    report["greedy_mismatches"] = sum(
        a.token_ids != b.token_ids for (ra, _), (rb, _) in zip(runs[MODES[0]], runs[MODES[1]])
        for a, b in zip(ra, rb))
    return report


def table(report: dict) -> str:
    """The report as a Markdown table."""
    lines = ["| deployment | TTFT p50 | TTFT p90 | output tok/s (each pass) | verifier hit rate |",
             "|---|---|---|---|---|"]
    for mode, m in report["modes"].items():
        passes = ", ".join(f"{x:.1f}" for x in m["tokens_per_s_by_round"])
        lines.append(f"| {mode} | {m['ttft_p50_s']:.2f} s | {m['ttft_p90_s']:.2f} s | "
                     f"{m['tokens_per_s']:.1f} ({passes}) | {m['verifier_prefix_hit_rate']:.1%} |")
    lines.append(f"\nTTFT p50 with / without: {report['ttft_p50_ratio']:.3f}x; throughput: "
                 f"{report['throughput_ratio']:.3f}x; greedy outputs that differ: "
                 f"{report['greedy_mismatches']}")
    return "\n".join(lines)
