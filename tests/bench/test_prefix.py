"""``spin bench prefix``'s workload and report: each pass sends conversations no other pass
sent, all behind one system prompt, which the warm-up request carries too; the table reads the
report (the deployments themselves: ``tests/verifier/test_prefix_caching.py``)."""

from __future__ import annotations

from pathlib import Path

from loadgen.chat import ChatShape
from spin.bench.prefix import MODES, PrefixBenchConfig, _passes, table


def test_passes_are_disjoint_behind_one_system_prompt(family_dir: Path) -> None:
    cfg = PrefixBenchConfig(family_dir=family_dir, requests=6, rounds=2,
                            shape=ChatShape(system_tokens=100, turns=2))
    passes, warm = _passes(cfg)
    assert [len(p) for p in passes] == [6, 6]
    prompts = [{r.prompt for r in p} for p in passes]
    assert len(prompts[0]) == 6 and not prompts[0] & prompts[1]
    system = warm.prompt.split("\n\nUser:", 1)[0]
    assert all(r.prompt.startswith(system + "\n\nUser:") for p in passes for r in p)


def test_the_table_shows_both_deployments_and_the_ratios() -> None:
    mode = {"ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "tokens_per_s": 100.0,
            "tokens_per_s_by_round": [90.0, 110.0], "verifier_prefix_hit_rate": 0.8}
    report = {"modes": {m: mode for m in MODES}, "ttft_p50_ratio": 0.25,
              "throughput_ratio": 1.5, "greedy_mismatches": 0}
    text = table(report)
    assert "| prefix caching | 0.50 s | 1.00 s | 100.0 (90.0, 110.0) | 80.0% |" in text
    assert "0.250x" in text and "1.500x" in text and "differ: 0" in text
