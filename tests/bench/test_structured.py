"""``spin bench structured``'s report, on made-up runs (the run itself is a benchmark: it
starts two deployments)."""

from __future__ import annotations

import pytest

from spin.bench.structured import StructuredBenchConfig, _report, _valid, summary


def _mode(rate: float, outputs: list[list[int]], valid: int, accepted: int = 0,
          grammar: int = 0) -> dict:
    return {"tokens_per_s": rate, "valid": valid, "accepted": accepted,
            "grammar_accepted": grammar, "outputs": outputs}


def test_the_report_divides_what_each_mode_measured() -> None:
    out = [[1, 2], [3]]
    per = [{"concurrency": 1, "temperature": 0.0, "with": _mode(30.0, out, 2, 10, 4),
            "without": _mode(20.0, [[1, 2], [4]], 2), "off": _mode(10.0, out, 2)},
           {"concurrency": 4, "temperature": 0.8, "with": _mode(60.0, [[7]], 1, 0),
            "without": _mode(40.0, [[8]], 0), "off": _mode(30.0, [[9]], 1)}]
    before = {"spin:grammar_seconds_total": 1.0, "spin:step_seconds_sum": 10.0,
              "spin:grammar_steps_total": 100, "spin:grammar_forced_tokens_total": 10,
              "spin:generation_tokens_total": 100}
    after = {"spin:grammar_seconds_total": 1.5, "spin:step_seconds_sum": 20.0,
             "spin:grammar_steps_total": 600, "spin:grammar_forced_tokens_total": 40,
             "spin:generation_tokens_total": 200}
    r = _report(StructuredBenchConfig(requests=2), per, 2, before, after)
    greedy, sampled = r["cells"]
    assert greedy["with_over_without"] == 1.5 and greedy["with_over_off"] == 3.0
    assert greedy["greedy_mismatches"] == 1 and sampled["greedy_mismatches"] is None
    assert greedy["grammar_share_of_accepted"] == pytest.approx(0.4)
    assert sampled["grammar_share_of_accepted"] == 0.0
    assert r["grammar_share_of_step"] == pytest.approx(0.05)
    assert r["grammar_ms_per_request_step"] == pytest.approx(1.0)
    assert r["forced_share_of_tokens"] == pytest.approx(0.3)
    text = summary(r)
    assert "5.00% of the router's step time" in text and "1.500" in text
    assert "forced (appended unverified, with): 30%" in text


def test_an_output_counts_as_valid_only_when_it_follows_the_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}
    assert _valid('{"a":1}', schema)
    assert not _valid('{"a":2}', schema) and not _valid('{"a":', schema)
