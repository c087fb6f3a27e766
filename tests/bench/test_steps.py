"""``spin bench steps`` measures each mode it is asked for, on real demo models."""

from __future__ import annotations

from pathlib import Path

from spin.bench.steps import run_steps_bench


def test_rows_per_model_mode_and_batch(family_dir: Path) -> None:
    rows = run_steps_bench(family_dir, ("draft-general",), (1, 2), context=20, reps=2,
                           modes=("eager", "bucketed"))
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("eager", 1), ("eager", 2), ("bucketed", 1), ("bucketed", 2)]
    assert all(r["step_ms"] > 0 and r["first_s"] > 0 and r["context"] == 20 for r in rows)
