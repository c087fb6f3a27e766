"""The ``spin`` console script, run as a real subprocess (its help pages in process)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SPIN = [sys.executable, "-m", "spin.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPIN, *args], capture_output=True, text=True, timeout=600)


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sp for a in p._actions if isinstance(a, argparse._SubParsersAction)
            for name, sp in a.choices.items()}


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``spin --help`` as the installed command, then ``spin <command> [<subcommand>] --help``
    in this process (each from its own parser; a process each would cost a torch import)."""
    from spin.cli import main, parser

    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: spin"), r.stderr
    commands = []
    for name, sp in _subcommands(parser()).items():
        commands += [(name,)] + [(name, sub) for sub in _subcommands(sp)]
    assert len(commands) > 15 and ("bench", "policy") in commands and ("serve",) in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as exit_:
            main([*cmd, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0, cmd
        assert out.startswith(" ".join(("usage: spin", *cmd))), out


def test_generate_streams_and_reports_speed(serving) -> None:
    r = run("generate", "def main():", "--max-tokens", "16", "--endpoint", serving.endpoint,
            "--speculation", "draft-code", "--k", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no generated text"
    m = re.search(r"(\d+) tokens in [\d.]+ s = [\d.]+ tokens/s .*tau ([\d.]+) tokens/step over "
                  r"(\d+) steps .*drafters: draft-code \((\d+) steps", r.stderr)
    assert m, r.stderr
    n, tau, steps = int(m.group(1)), float(m.group(2)), int(m.group(3))
    assert n == 16 or "finished: stop" in r.stderr
    assert tau == round(n / steps, 2) and int(m.group(4)) <= steps
    off = run("generate", "def main():", "--max-tokens", "16", "--endpoint", serving.endpoint,
              "--speculation", "off")
    assert off.returncode == 0 and off.stdout == r.stdout  # lossless, as the user sees it
    assert "drafters: none" in off.stderr


def test_generate_steps_prints_every_verification_step(serving) -> None:
    r = run("generate", "def main():", "--max-tokens", "24", "--endpoint", serving.endpoint,
            "--steps")
    assert r.returncode == 0, r.stderr
    m = re.search(r"(\d+) tokens in .* over (\d+) steps", r.stderr)
    assert m, r.stderr
    rows = re.findall(r"^\s*(\d+)  (\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+"
                      r"([\d.]+)\s+([\d.]+|-)$", r.stderr, re.M)
    assert [int(row[0]) for row in rows] == list(range(1, len(rows) + 1)), r.stderr
    # a call of several held plain steps is one row: its forwards add up to the steps
    assert sum(int(row[6]) for row in rows) == int(m.group(2)), r.stderr
    assert sum(int(row[5]) for row in rows) == int(m.group(1))  # every token, once
    assert all(int(row[4]) <= int(row[3]) for row in rows)  # accepted <= drafted
    predicted = sum(row[9] != "-" for row in rows)
    assert re.search(r"predicted vs measured step time: mean absolute error [\d.]+% over "
                     rf"{predicted} steps", r.stderr) or not predicted, r.stderr


def test_bad_input_gets_a_clear_error(serving) -> None:
    r = run("generate", "", "--max-tokens", "8", "--endpoint", serving.endpoint)
    assert r.returncode == 2 and "prompt is empty" in r.stderr
    r = run("generate", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "must be > 0" in r.stderr
    r = run("generate", "x", "--temperature", "-1")
    assert r.returncode == 2 and "--temperature must be >= 0" in r.stderr
    r = run("generate", "x", "--max-tokens", "5000", "--endpoint", serving.endpoint)
    assert r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr and "context" in r.stderr
    r = run("generate", "x", "--endpoint", "127.0.0.1:9")
    assert r.returncode == 2 and "spin serve" in r.stderr


def test_router_rejects_a_malformed_drafter_flag() -> None:
    r = run("router", "--verifier", "127.0.0.1:9", "--tokenizer", "models/demo/target",
            "--drafter", "draft-code")
    assert r.returncode == 2 and "NAME=HOST:PORT" in r.stderr


def test_router_and_serve_reject_a_bad_policy_config() -> None:
    base = ("router", "--verifier", "127.0.0.1:9", "--tokenizer", "models/demo/target")
    r = run(*base, "--policy-config", "{score_rounds: 2")
    assert r.returncode == 2 and "--policy-config: not JSON" in r.stderr
    r = run(*base, "--policy-config", '{"score_round": 2}')
    assert r.returncode == 2 and "unknown learned-policy setting 'score_round'" in r.stderr
    r = run("serve", "--policy-config", '{"selector": {"ucb": 1}}')
    assert r.returncode == 2 and "unknown selector setting(s) ['ucb']" in r.stderr
    r = run(*base, "--policy-config", '{"selector": {"algorithm": "exp3"}}')
    assert r.returncode == 2 and "unknown algorithm 'exp3'" in r.stderr
    r = run(*base, "--policy-config", '{"controller": {"calibration": 2}}')
    assert r.returncode == 2 and "calibration must be in [0, 1]" in r.stderr
    r = run("bench", "ab", "--b", '{"score_rounds": "two"}')
    assert r.returncode == 2 and "'score_rounds' takes int values" in r.stderr


def test_zoo_report_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    r = run("zoo", "report", "--prompts", "1", "--new-tokens", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["k"] == 4 and report["prompts_per_domain"] == 1
    assert "| prompt-lookup |" in r.stdout


def test_zoo_train_rejects_unknown_stage(tmp_path: Path) -> None:
    r = run("zoo", "train", "--stages", "corpus,bogus", "--build-dir", str(tmp_path))
    assert r.returncode == 2 and "unknown stages ['bogus']" in r.stderr


def test_stats_prints_the_population_table() -> None:
    from spin.stats import RedisServer, RedisStatsStore

    with RedisServer() as server:
        store = RedisStatsStore(server.url)
        store.record("draft-code", 4, 3, 0.004, 0.010)
        store.record("draft-code", 4, 1, 0.004, 0.010)
        assert store.flush()
        store.close()
        r = run("stats", "--redis-url", server.url)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("draft-code"))
    # 2 steps, 8 drafted, 4 accepted, 2 rejections: rate 0.50, alpha 4 / (4 + 2) = 0.67,
    # tau 1 + 4/2 = 3.00, 4 ms draft, 10 ms verify
    assert row.split()[1:9] == ["2", "8", "4", "0.50", "0.67", "3.00", "4.00", "10.00"]
    assert run("stats", "--redis-url", "redis://127.0.0.1:9/0").returncode == 2


def test_bench_ab_sampled_workload(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``spin bench ab --sampled`` compares the settings on the sampled workload (the README's
    headline), greedy without it; the report's totals are printed."""
    from spin.bench import ab
    from spin.bench.policy_config import GREEDY, SAMPLED
    from spin.cli import main

    seen: list = []

    def fake_run_ab(cfg: ab.ABConfig) -> dict:
        seen.append(cfg)
        row = {"domain": "code", "a": 1.0, "b": 0.9, "prompt_lookup": 1.2}
        return {"rounds": cfg.rounds, "requests": [row], "sampling": cfg.sampling.name,
                "total_s": {"a": 1.0, "b": 0.9, "prompt_lookup": 1.2}, "b_over_a": 0.9,
                "prompt_lookup_over_a": 1.2, "prompt_lookup_over_b": 1.2 / 0.9}

    monkeypatch.setattr(ab, "run_ab", fake_run_ab)
    assert main(["bench", "ab", "--sampled", "--rounds", "2"]) == 0
    assert main(["bench", "ab"]) == 0
    assert [c.sampling for c in seen] == [SAMPLED, GREEDY] and seen[0].rounds == 2
    out = capsys.readouterr().out
    assert "total (sampled workload, medians of 2 rounds)" in out and "B / A = 0.900" in out
    assert "total (greedy workload, medians of 3 rounds)" in out


def test_bench_sweep_passes_split_fractions_and_settings(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """``spin bench sweep`` runs the load sweep on the split, fractions and policy settings
    asked for (tuning by default) and prints auto / off per rate; bad settings or fractions are
    refused before anything starts, and a lossless mismatch fails the run."""
    from spin.bench import policy_sweep
    from spin.cli import main

    seen: list = []
    mismatches = [0]

    def fake(cfg, split, fractions, overrides):  # type: ignore[no-untyped-def]
        seen.append((split, fractions, overrides))
        row = {"load_fraction": 2.0, "rate": 12.0, "auto_mean_latency_s": 3.0,
               "off_mean_latency_s": 4.0, "auto_p99_latency_s": 6.0, "off_p99_latency_s": 5.0}
        return {"split": split, "requests_per_rate": 64, "capacity_req_s": 6.0, "rates": [row],
                "lossless_mismatches": mismatches[0]}

    monkeypatch.setattr(policy_sweep, "run_sweep_bench", fake)
    setting = '{"controller": {"objective": "throughput"}}'
    assert main(["bench", "sweep", "--fractions", "1,2", "--policy-config", setting]) == 0
    assert main(["bench", "sweep", "--split", "evaluation"]) == 0
    assert seen == [("tuning", (1.0, 2.0), {"controller": {"objective": "throughput"}}),
                    ("evaluation", None, {})]
    out = capsys.readouterr().out
    assert "tuning split, 64 requests per rate" in out
    assert "2.00x (12.00 req/s): auto / off mean latency 0.750 (3.00 / 4.00 s), p99 1.200" in out
    assert main(["bench", "sweep", "--policy-config", '{"controller": {"objective": "x"}}']) == 2
    assert "--policy-config" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--fractions", "1,-2"])
    assert e.value.code == 2
    mismatches[0] = 1
    assert main(["bench", "sweep"]) == 1
    assert len(seen) == 3
