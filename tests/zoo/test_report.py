from pathlib import Path

import pytest

from spin.zoo.acceptance import PROMPT_LOOKUP
from spin.zoo.report import (README_BEGIN, README_END, ReportConfig, criteria, markdown, run_report,
                             update_readme)
from spin.zoo.specs import DOMAINS


@pytest.fixture(scope="module")
def small_report(family_dir: Path) -> dict:
    return run_report(ReportConfig(family_dir=family_dir, prompts_per_domain=2, new_tokens=24,
                                   timing_runs=3))


def test_report_measures_every_drafter_and_domain(small_report: dict) -> None:
    drafters = set(small_report["target_continuation"])
    assert PROMPT_LOOKUP in drafters and len(drafters) >= 4
    for mode in ("target_continuation", "human_text"):
        for name, row in small_report[mode].items():
            assert set(row) == set(DOMAINS)
            assert all(0.0 <= v <= small_report["k"] for v in row.values()), (mode, name, row)
    assert small_report["forward_ms"]["target"] > 0
    assert set(small_report["criteria"]["best_by_domain"]) == set(DOMAINS)


def test_markdown_lists_every_drafter(small_report: dict) -> None:
    table = markdown(small_report)
    for name in small_report["target_continuation"]:
        assert f"| {name} |" in table
    assert "target (verifier)" in table


def test_criteria_find_selection_gaps() -> None:
    own = {"a": {"code": 2.0, "prose": 0.5, "structured": 1.0},
           "b": {"code": 0.5, "prose": 1.5, "structured": 1.1},
           "c": {"code": 0.1, "prose": 0.1, "structured": 0.2}}
    c = criteria(own, {"target": 10.0, "a": 1.0, "b": 3.0})
    assert c["best_by_domain"] == {"code": "a", "prose": "b", "structured": "b"}
    assert c["selection_gaps"]["code"] == {"best": "a", "rival": "b", "ratio": 4.0}
    assert c["selection_gaps"]["prose"] == {"best": "b", "rival": "a", "ratio": 3.0}
    assert c["selection_gaps"]["structured"]["ratio"] == 1.1
    assert c["domains_with_20pct_gap"] == 2
    assert c["target_over_smallest_draft_cost"] == 10.0
    assert c["smallest_over_largest_draft_cost"] == round(1 / 3, 3)


def test_update_readme_replaces_only_the_section(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n")
    update_readme(readme, "| new |")
    assert readme.read_text() == f"intro\n{README_BEGIN}\n| new |\n{README_END}\noutro\n"
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(ValueError, match="section"):
        update_readme(tmp_path / "bare.md", "x")
