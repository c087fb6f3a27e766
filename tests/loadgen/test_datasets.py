"""``--dataset``: JSON Lines (prompts and chats), ShareGPT and plain text, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.datasets import chat_renderer, read_prompts
from loadgen.workload import build_workload


def test_jsonl_prompts_and_chats(tmp_path: Path, family_dir: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "def f():", "domain": "code"}) + "\n\n" +
                    json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rows = read_prompts(path, chat_renderer(family_dir / "target"))
    assert rows == [{"domain": "code", "prompt": "def f():"},
                    {"domain": "dataset", "prompt": "user: hi\nassistant: "}]


def test_sharegpt_takes_each_conversations_first_human_turn(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "Q2"}]},
        {"conversations": []}]))
    assert [r["prompt"] for r in read_prompts(path)] == ["Q1", "Q2"]


def test_plain_text_is_one_prompt_a_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\nsecond prompt\n")
    rows = read_prompts(path)
    assert [r["prompt"] for r in rows] == ["first prompt", "second prompt"]
    reqs = build_workload(5, seed=1, rows=rows)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"first prompt", "second prompt"}


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x"}\nnot json\n', "d.jsonl:2: not JSON"),
    ('{"text": "x"}\n', "d.jsonl:1: wants an object"),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', "needs a tokenizer"),
    ("\n\n", "has no prompts"),
])
def test_bad_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_prompts(path)


def test_the_cli_reads_a_dataset(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "import os", "domain": "mine"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "loadgen", "--dataset", str(path),
                          "--num-prompts", "3", "--jsonl"], capture_output=True, text=True,
                         timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["domain"], r["prompt"]) for r in rows] == [("mine", "import os")] * 3
    bad = subprocess.run([sys.executable, "-m", "loadgen", "--dataset", str(tmp_path / "nope"),
                          "--jsonl"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read" in bad.stderr


def test_a_dataset_s_split_field_picks_its_half(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "a", "split": "tuning"}, {"prompt": "b", "split": "evaluation"},
        {"prompt": "c"}, {"prompt": "d", "split": "other"})))
    rows = read_prompts(path)
    assert [r.get("split") for r in rows] == ["tuning", "evaluation", None, None]
    timed = build_workload(8, rows=rows, split="evaluation")
    assert {r.prompt for r in timed} == {"b", "c", "d"}  # rows without a known half stay
    with pytest.raises(ValueError, match="no prompts of the tuning split"):
        build_workload(2, rows=rows[1:2], split="tuning")


def test_the_committed_long_prompt_dataset_is_unseen_text_in_two_halves() -> None:
    """``benchmarks/datasets/unseen-long.jsonl`` (``spin bench dataset``): 60 prompts of each kind,
    200-320 target tokens, tuning and evaluation halves disjoint by source document."""
    from spin.bench.unseen import DEFAULT_OUT, split_of

    rows = [json.loads(line) for line in DEFAULT_OUT.read_text().splitlines()]
    assert len(rows) == 180 and {r["domain"] for r in rows} == {"code", "prose", "structured"}
    assert all(200 <= r["tokens"] <= 320 and r["split"] == split_of(r["source"]) for r in rows)
    halves = {s: {r["source"] for r in rows if r["split"] == s} for s in ("tuning", "evaluation")}
    assert halves["tuning"] and halves["evaluation"] and not halves["tuning"] & halves["evaluation"]
