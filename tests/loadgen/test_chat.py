"""The chat workload: every request starts with the same system prompt of the asked length,
each turn repeats its conversation's earlier turns, and the file reads back as a dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loadgen.chat import DEFAULT_SOURCE, ChatShape, main, make_chat
from loadgen.datasets import read_prompts


@pytest.fixture(scope="module")
def tok(family_dir: Path):
    return AutoTokenizer.from_pretrained(family_dir / "target")


def _texts() -> list[str]:
    return [r["prompt"] for r in read_prompts(DEFAULT_SOURCE)]


def test_requests_share_the_system_prompt_and_their_conversation(tok) -> None:
    shape = ChatShape(system_tokens=200, conversations=3, turns=3, user_tokens=20,
                      reply_tokens=10)
    rows = make_chat(_texts(), tok, shape)
    assert len(rows) == 9 and [r["domain"] for r in rows[:3]] == [
        "chat-turn1", "chat-turn2", "chat-turn3"]
    system = rows[0]["prompt"].split("\n\nUser:", 1)[0]
    assert abs(len(tok(system.removeprefix("System: "))["input_ids"]) - 200) <= 2
    assert all(r["prompt"].startswith(system + "\n\nUser:") for r in rows)
    for c in range(3):
        turns = [r["prompt"] for r in rows if r["conversation"] == c]
        for earlier, later in zip(turns, turns[1:]):
            assert later.startswith(earlier)  # the history, then a reply and a new turn
            assert len(later) > len(earlier)
    assert len({r["prompt"] for r in rows}) == 9
    assert make_chat(_texts(), tok, shape) == rows  # seeded


def test_too_little_text_is_refused(tok) -> None:
    with pytest.raises(ValueError, match="fewer than the system prompt"):
        make_chat(["a few words"], tok, ChatShape(system_tokens=500))


def test_the_file_is_a_dataset(tmp_path: Path, family_dir: Path, capsys) -> None:
    out = tmp_path / "chat.jsonl"
    assert main(["--out", str(out), "--conversations", "2", "--turns", "2",
                 "--tokenizer", str(family_dir / "target")]) == 0
    rows = read_prompts(out)
    assert len(rows) == 4 and all(r["split"] == "evaluation" for r in rows)
    assert json.loads(out.read_text().splitlines()[0])["conversation"] == 0
    assert "wrote 4 requests" in capsys.readouterr().out
    assert main(["--out", str(out), "--source", str(tmp_path / "missing.jsonl")]) == 2
