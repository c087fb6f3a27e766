"""``spin bench gpu``: the quick run on the CPU writes every expected row with positive finite
numbers; shapes count their parameters right; budgets, failures and bars are reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from spin.bench.gpu_run import Run
from spin.bench.gpu_config import PARTS, GpuBenchConfig, parse_parts
from spin.bench.gpu_report import bars, drafter_speedups, table
from spin.bench.gpu_shapes import DRAFTERS, LLAMA3_8B, TINY_DRAFTERS, TINY_TARGET, build_random
from spin.cli import main


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """``spin bench gpu --device cpu --quick --json F``: its exit status and report."""
    path = tmp_path_factory.mktemp("bench-gpu") / "bench-gpu.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--quick", "--json", str(path)])
    return rc, json.loads(path.read_text())


def test_quick_cpu_run_reports_every_part(quick: tuple[int, dict]) -> None:
    rc, r = quick
    assert rc == 0
    meta = r["meta"]
    assert meta["device_name"] == "cpu" and meta["torch"] == torch.__version__
    assert meta["date"][:2] == "20" and meta["dtype"] == "float32"
    assert list(r["parts"]) == ["target", "verify", "baselines", "drafters"]
    for name, part in r["parts"].items():
        assert part["status"] == "ok" and part["errors"] == [], name
        assert _positive(part["wall_s"]), name
    # the whole run's seconds add up its parts'; how many depends on what else the machine runs
    assert _positive(r["wall_s"]) and r["wall_s"] >= max(p["wall_s"] for p in r["parts"].values())


def test_quick_target_and_verify_rows(quick: tuple[int, dict]) -> None:
    _, r = quick
    target = r["parts"]["target"]
    assert target["shape"]["params"] == TINY_TARGET.params
    for key in ("bandwidth_bytes_s", "weight_bytes", "hbm_limit_ms", "build_s"):
        assert _positive(target[key]), key
    assert [row["graphs"] for row in target["rows"]] == [False, True]
    for row in target["rows"]:
        assert all(_positive(row[k]) for k in ("step_ms", "tok_s", "vs_hbm_limit", "load_s"))
        assert row["graphs_active"] is False and row["graphs_built"] == 0  # no graphs on a CPU
    rows = r["parts"]["verify"]["rows"]
    points = {(row["graphs"], row["batch"], row["shape"], row["tokens"]) for row in rows}
    want = {(g, b, "chain", n) for g in (False, True) for b in (1, 4) for n in (1, 2, 4, 8, 16)}
    want |= {(g, b, "tree", 16) for g in (False, True) for b in (1, 4)}
    assert points == want and len(rows) == len(want)
    assert all(_positive(row["ms"]) for row in rows)
    ratios = r["parts"]["verify"]["ratio_8_over_1_b1"]
    assert _positive(ratios["eager"]) and _positive(ratios["graphs"])


def test_quick_baselines_and_drafters_rows(quick: tuple[int, dict]) -> None:
    _, r = quick
    base = r["parts"]["baselines"]
    assert [row["method"] for row in base["rows"]] == [
        "hf generate", "hf assisted tiny-draft-a constant-4"]
    assert all(_positive(row["tok_s"]) for row in base["rows"])
    demo = base["demo"]
    assert set(demo["tok_s"]) == {"hf_generate", "hf_assisted", "spin_off", "spin_on"}
    assert all(_positive(v) for v in demo["tok_s"].values())
    # lossless in float32: speculation, transformers and its assisted generation agree
    assert demo["spin_mismatches"] == demo["spin_vs_hf_mismatches"] == 0
    assert demo["hf_assisted_mismatches"] == 0
    rows = r["parts"]["drafters"]["rows"]
    points = {(row["model"], row["graphs"], row["batch"]) for row in rows}
    assert points == {(s.name, g, b) for s in TINY_DRAFTERS for g in (False, True)
                      for b in (1, 4)}
    assert all(_positive(row["step_ms"]) and _positive(row["tok_s"]) for row in rows)


def test_quick_bars_and_table(quick: tuple[int, dict]) -> None:
    _, r = quick
    b = r["bars"]
    assert b["demo_spin_mismatches"]["ok"] is True
    # the speed bars are the CUDA path's: reported on the CPU, not judged
    assert _positive(b["verify_8_over_1_b1"]["value"]) and b["verify_8_over_1_b1"]["ok"] is None
    assert b["drafter_graphs_speedup_b1"]["ok"] is None  # no graphs ran
    assert b["e2e_greedy_mismatches"]["ok"] is None  # the part did not run
    text = table(r)
    for name in r["parts"]:
        assert f"\n{name}: ok" in text
    assert "time(8)/time(1) at batch 1, eager" in text


def test_shapes_count_their_parameters() -> None:
    assert LLAMA3_8B.params == 8_030_261_248  # Meta-Llama-3-8B
    assert [round(s.params / 1e6) for s in DRAFTERS] == [68, 162, 1236]
    for shape in (TINY_TARGET, *TINY_DRAFTERS):
        model = build_random(shape, torch.device("cpu"), torch.float32)
        assert sum(p.numel() for p in model.parameters()) == shape.params, shape.name
    model = build_random(TINY_TARGET, torch.device("cpu"), torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # as from_pretrained keeps it


def test_parts_parse_and_order() -> None:
    assert parse_parts("services,target") == ("target", "services")
    with pytest.raises(ValueError, match="unknown parts"):
        parse_parts("target,gpu")
    assert GpuBenchConfig(quick=True).selected == ("target", "verify", "baselines", "drafters")
    assert GpuBenchConfig().selected == PARTS
    with pytest.raises(SystemExit):
        main(["bench", "gpu", "--parts", "nothing"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """1, not 2 (a missed speed bar, which scripts/gpu-check lets pass)."""
    assert main(["bench", "gpu", "--device", "cuda", "--quick"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_a_spent_budget_skips_parts(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--quick", "--parts", "drafters,e2e",
               "--budget", "1", "--json", str(path)])
    r = json.loads(path.read_text())
    assert rc == 0
    assert {n: p["status"] for n, p in r["parts"].items()} == {"drafters": "skipped",
                                                              "e2e": "skipped"}


def test_a_failing_part_is_recorded_and_the_report_written(tmp_path: Path) -> None:
    run = Run(GpuBenchConfig(quick=True, device="cpu", json_path=tmp_path / "r.json"),
              say=lambda line: None)
    run.timed("e2e", lambda: 1 / 0)
    run.timed("services", lambda: run.part("services").update(lossless=True))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["parts"]["e2e"]["status"] == "error"
    assert saved["parts"]["e2e"]["errors"] == ["ZeroDivisionError: division by zero"]
    assert saved["parts"]["services"]["status"] == "ok"


def test_bars_judge_cuda_runs() -> None:
    rows = [{"model": "m", "batch": 1, "graphs": g, "graphs_active": g, "step_ms": ms}
            for g, ms in ((False, 3.0), (True, 1.0))]
    assert drafter_speedups(rows) == {"m": 3.0}
    verify = [{"batch": 1, "shape": "chain", "tokens": n, "ms": ms, "graphs": True,
               "graphs_active": True} for n, ms in ((1, 10.0), (8, 14.0))]
    report = {"meta": {"device": "cuda:0", "dtype": "float32"},
              "parts": {"drafters": {"rows": rows},
                        "verify": {"rows": verify, "ratio_8_over_1_b1": {"graphs": 1.4}},
                        "e2e": {"greedy_mismatches": 2}}}
    b = bars(report)
    assert b["drafter_graphs_speedup_b1"]["ok"] is True
    assert b["verify_8_over_1_b1"]["ok"] is False  # 1.4 > 1.3
    assert b["e2e_greedy_mismatches"]["ok"] is False
    assert b["services_lossless"]["ok"] is None
    report["meta"]["dtype"] = "bfloat16"  # near ties round either way: reported, not judged
    assert bars(report)["e2e_greedy_mismatches"]["ok"] is None
