"""The ``spin`` console script, run as a real subprocess."""

import json
import re
import subprocess
import sys
from pathlib import Path

SPIN = [sys.executable, "-m", "spin.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPIN, *args], capture_output=True, text=True, timeout=600)


def test_generate_streams_and_reports_speed() -> None:
    r = run("generate", "def main():", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    text, _, summary = r.stdout.rpartition("\n\n[")
    assert text.strip(), "no generated text before the summary"
    n = int(re.match(r"(\d+) tokens in [\d.]+ s, [\d.]+ tok/s\]", summary).group(1))
    assert 1 <= n <= 8


def test_bad_input_gets_a_clear_error() -> None:
    r = run("generate", "", "--max-tokens", "8")
    assert r.returncode == 2 and "prompt is empty" in r.stderr
    r = run("generate", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "must be > 0" in r.stderr
    r = run("generate", "x", "--temperature", "-1")
    assert r.returncode == 2 and "--temperature must be >= 0" in r.stderr
    r = run("generate", "x", "--max-tokens", "5000")
    assert r.returncode == 2 and "context" in r.stderr


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
