"""A service's cached step times are a prior: a start times one grid point again and measures
the grid afresh where the cache ran slower than the machine does now (``rpc/step_times.py``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from spin.engine.drafter import ModelDrafter
from spin.engine.model_runner import ModelRunner
from spin.rpc import step_times
from spin.rpc.step_times import Grid, drafter_times, slower_than_now, verifier_times

GRID = Grid(batches=(1, 2), tokens=(1, 5), ks=(1, 4), contexts=(16,), reps=2)


def _scaled(cache: Path, factor: float) -> list[dict]:
    """Every cached entry's times multiplied by ``factor`` (rewritten in place); its rows."""
    [path] = cache.glob("*.json")
    rows = [{**r, "seconds": r["seconds"] * factor} for r in json.loads(path.read_text())]
    path.write_text(json.dumps(rows))
    return rows


def test_slower_than_now_compares_the_shared_points_only() -> None:
    cached = [{"batch": 1, "k": 4, "context_tokens": 64, "tree": False, "seconds": 0.030},
              {"batch": 1, "k": 4, "context_tokens": 64, "tree": True, "seconds": 0.050},
              {"batch": 4, "k": 4, "context_tokens": 256, "tree": False, "seconds": 0.9}]
    now = [{"drafter": "x", "batch": 1, "k": 4, "context_tokens": 64, "tree": False,
            "seconds": 0.010},
           {"drafter": "x", "batch": 1, "k": 4, "context_tokens": 64, "tree": True,
            "seconds": 0.025}]
    assert slower_than_now(cached, now) == pytest.approx(2.0)   # the smaller of 3x and 2x
    assert slower_than_now(cached, [{**now[0], "batch": 2}]) is None


@pytest.fixture(scope="module")
def target(family_dir: Path) -> ModelRunner:
    return ModelRunner(family_dir / "target", max_seqs=4, max_model_len=64,
                       kv_cache_bytes=8 << 20)


def test_a_cache_measured_on_a_busier_machine_is_measured_again(
        target: ModelRunner, family_dir: Path, tmp_path: Path) -> None:
    first = verifier_times(target, str(family_dir / "target"), "measure", tmp_path, GRID)
    assert {(s.batch, s.scored_tokens, s.tree) for s in first} >= {(1, 1, False), (2, 10, True)}
    inflated = _scaled(tmp_path, 1000.0)  # a forward of this model never takes 1000x its time
    again = verifier_times(target, str(family_dir / "target"), "auto", tmp_path, GRID)
    assert max(s.seconds for s in again) < min(r["seconds"] for r in inflated)
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text()) == [asdict(s) for s in again]  # cached anew


def test_a_cache_no_slower_than_now_is_kept(target: ModelRunner, family_dir: Path,
                                            tmp_path: Path) -> None:
    verifier_times(target, str(family_dir / "target"), "measure", tmp_path, GRID)
    fast = _scaled(tmp_path, 0.001)  # now is slower (a busy machine): the cache stands
    kept = verifier_times(target, str(family_dir / "target"), "auto", tmp_path, GRID)
    assert [asdict(s) for s in kept] == fast


def test_a_drafter_cache_is_checked_too(family_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(family_dir / "draft-structured")
    drafter = ModelDrafter("structured", ModelRunner(path, max_seqs=4, kv_cache_bytes=4 << 20))
    drafter_times(drafter, path, "measure", tmp_path, GRID)
    checks: list[int] = []
    real = step_times.slower_than_now

    def counted(cached: list[dict], now: list[dict]) -> float | None:
        checks.append(len(now))
        return real(cached, now)

    monkeypatch.setattr(step_times, "slower_than_now", counted)
    inflated = _scaled(tmp_path, 1000.0)
    again = drafter_times(drafter, path, "auto", tmp_path, GRID)
    assert checks == [2]                     # k = 4 at batch 1: a chain and a tree
    assert all(s.drafter == "structured" for s in again)
    assert max(s.seconds for s in again) < min(r["seconds"] for r in inflated)
