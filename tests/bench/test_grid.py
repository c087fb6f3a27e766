"""``spin bench grid``: a cell (auto and off on the same requests, lossless; here on one
deployment), the table and the plot from it, each mode's deployment and trace, and the
command's refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spin.bench.grid import OFF_AGAIN, GridConfig, _cell, _trace, modes, plot_grid, table
from spin.bench.policy_config import PolicyBenchConfig
from spin.serve import Embedded


def test_a_greedy_cell_of_long_prompts_is_lossless_and_reported(serving: Embedded,
                                                                tmp_path: Path) -> None:
    cfg = GridConfig(quick=True, concurrencies=(2,), temperatures=(0.0,), prompt_sets=("long",),
                     repeat_off=True)
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens)
    cell = _cell({label: serving.endpoint for label, _, _ in modes(cfg)}, cfg, bench, "long",
                 0.0, 2)
    # two passes (off, auto, off again, then the reverse): every output equals off's first
    assert cell["requests"] == 8 and cell["rounds"] == 2 and cell["greedy_mismatches"] == 0
    off, auto, again = (cell["modes"][m] for m in ("off", "auto", OFF_AGAIN))
    assert off["tau"] == again["tau"] == 1.0 and auto["tau"] >= 1.0  # off: one token a step
    assert cell["off_again_over_off"] == again["tokens_per_s"] / off["tokens_per_s"] > 0
    assert cell["auto_over_off"] == auto["tokens_per_s"] / off["tokens_per_s"] > 0
    assert len(off["tokens_per_s_by_round"]) == len(cell["auto_over_off_by_round"]) == 2
    # the cell's rate lies between its passes' (tokens over wall time, summed)
    assert (min(off["tokens_per_s_by_round"]) <= off["tokens_per_s"]
            <= max(off["tokens_per_s_by_round"]))
    report = {"config": {"fixed": None, "repeat_off": True}, "cells": [cell]}
    row = table(report).splitlines()[2]
    assert row.startswith("| long | 0 | 2 |") and row.count(", ") == 1
    assert row.endswith(f" {cell['off_again_over_off']:.3f}x |")
    plot_grid(report, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"


def test_the_command_parses_its_lists() -> None:
    from spin.cli import parser

    args = parser().parse_args(["bench", "grid", "--concurrency", "1,8", "--temperatures",
                                 "0,0.8"])
    assert args.concurrency == (1, 8) and args.temperatures == (0.0, 0.8)
    assert args.suffix_decoding is False
    assert parser().parse_args(["bench", "grid", "--suffix-decoding"]).suffix_decoding is True


def test_each_mode_has_a_deployment_and_a_trace_of_its_own(tmp_path: Path) -> None:
    cfg = GridConfig(fixed=("draft-code", 3), repeat_off=True, trace=tmp_path / "steps.jsonl")
    assert [m[0] for m in modes(cfg)] == ["off", "auto", "draft-code:k3", OFF_AGAIN]
    assert modes(GridConfig())[1] == ("auto", "auto", 0) and len(modes(GridConfig())) == 2
    assert _trace(cfg, "auto") == str(tmp_path / "steps.jsonl")
    assert _trace(cfg, "off") == str(tmp_path / "steps-off.jsonl")
    assert _trace(cfg, OFF_AGAIN) == str(tmp_path / "steps-off-again.jsonl")
    assert _trace(cfg, "draft-code:k3") == str(tmp_path / "steps-draft-code-k3.jsonl")
    assert _trace(GridConfig(), "auto") is None
    assert GridConfig().suffix_decoding is False  # repeated prompts would flatter it


def test_the_command_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from spin.cli import main

    for args, message in ((["--prompts", "medium"], "--prompts takes short, long, short,long"),
                          (["--fixed", "draft-code"], "--fixed wants DRAFTER:K"),
                          (["--temperatures", "3"], "temperatures must be in [0, 2]"),
                          (["--concurrency", "1,0"], "must be > 0"),
                          (["--policy-config", "{\"nope\": 1}"], "unknown learned-policy"),
                          (["--variant", "{}"], "--variant wants LABEL=JSON"),
                          (["--variant", "off={}"], "label 'off' is taken"),
                          (["--variant", "a={}", "--variant", "a={}"], "label 'a' is taken"),
                          (["--variant", "g={\"guard\": {\"nope\": 1}}"],
                           "--variant g: unknown guard setting")):
        try:
            rc = main(["bench", "grid", *args])
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
        assert rc == 2 and message in capsys.readouterr().err, args
    # and as a command: the exit status and the message reach the shell
    r = subprocess.run([sys.executable, "-m", "spin", "bench", "grid", "--variant", "off={}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "label 'off' is taken" in r.stderr, r.stderr


def test_tuning_runs_time_other_prompts_than_the_reported_ones() -> None:
    """``--split tuning`` (for runs that choose code or constants) never times a prompt of the
    evaluation half, of either prompt set."""
    from spin.bench.grid import grid_rows
    from spin.cli import parser

    assert parser().parse_args(["bench", "grid", "--split", "tuning"]).split == "tuning"
    for prompts in ("short", "long"):
        tuning = {r.prompt for r in grid_rows(GridConfig(split="tuning"), prompts, 64)}
        evaluation = {r.prompt for r in grid_rows(GridConfig(), prompts, 64)}
        assert tuning and evaluation and not tuning & evaluation, prompts


def test_a_variants_deployment_key_is_what_it_serves_not_a_policy_setting() -> None:
    from spin.bench.grid import deployment_options, policy_config
    from spin.cli.bench_grid import grid_variants

    variants = grid_variants(['inside={"deployment": {"colocate": ["all"]}, "trees": false}'],
                             {}, None)
    cfg = GridConfig(variants=variants)
    assert policy_config(cfg, "inside") == {"trees": False}
    assert deployment_options(variants["inside"]) == {"colocate": ["all"]}
    assert deployment_options({}) == {}
    for bad in ('{"deployment": {"cpus": "split"}}', '{"deployment": {"colocate": [1]}}',
                '{"deployment": ["all"]}'):
        with pytest.raises(ValueError, match='--variant v: "deployment"'):
            grid_variants([f"v={bad}"], {}, None)


def test_a_variant_is_auto_on_a_deployment_of_its_own_with_its_settings_merged() -> None:
    """``--variant``: auto with other settings, a mode of its own, its overrides applied key by
    key over ``--policy-config`` (the other settings of a nested group kept)."""
    from spin.bench.grid import policy_config

    cfg = GridConfig(policy_config={"guard": {"probe_min": 2}, "trees": False},
                     variants={"slow": {"guard": {"decay": 0.9}}, "bare": {}}, repeat_off=True)
    assert modes(cfg) == [("off", "off", 0), ("auto", "auto", 0), ("slow", "auto", 0),
                          ("bare", "auto", 0), (OFF_AGAIN, "off", 0)]
    assert policy_config(cfg, "slow") == {"guard": {"probe_min": 2, "decay": 0.9},
                                          "trees": False}
    assert policy_config(cfg, "auto") == policy_config(cfg, "bare") == cfg.policy_config
    assert cfg.policy_config == {"guard": {"probe_min": 2}, "trees": False}  # not mutated
    mode = {"tokens_per_s": 10.0, "mean_latency_s": 1.0}
    cell = {"prompts": "short", "temperature": 0.0, "concurrency": 8, "auto_over_off": 1.0,
            "modes": {"off": mode, "auto": mode}, "off_again_over_off": 1.0,
            "variants": {"slow": {"over_auto": 0.5, "over_off": 0.5},
                         "bare": {"over_auto": 1.25, "over_off": 1.25}}}
    lines = table({"config": {"fixed": None, "repeat_off": True, "variants": cfg.variants},
                   "cells": [cell]}).splitlines()
    assert "| slow / auto | bare / auto | off again / off |" in lines[0]
    assert lines[2].endswith("| 0.500x | 1.250x | 1.000x |")
