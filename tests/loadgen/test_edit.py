"""The edit workload: groups of a text and its edits, readable as a ``--dataset``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadgen.datasets import read_jsonl, read_prompts
from loadgen.edit import WORD, EditConfig, edit_rows, edit_text, in_order, instruction, main


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "src.jsonl"
    texts = [("code", "def parse(path):\n    with open(path) as handle:\n        return handle"),
             ("prose", "The river runs past the old mill and under the stone bridge."),
             ("prose", "Short words go by, but longer ones change.")]
    path.write_text("".join(json.dumps({"prompt": t, "domain": d, "split": "evaluation"}) + "\n"
                            for d, t in texts))
    return path


def test_an_edit_replaces_that_many_words_by_words_of_the_text() -> None:
    text = "alpha beta gamma delta epsilon zeta"
    new, changes = edit_text(text, 2, random.Random(0))
    old_words, new_words = text.split(), new.split()
    diff = [(a, b) for a, b in zip(old_words, new_words) if a != b]
    assert diff == changes and len(diff) == 2
    assert all(b in old_words for _, b in diff)
    assert edit_text("a b", 3, random.Random(0)) == ("a b", [])  # no word of 3 letters


def test_groups_are_a_text_then_its_edits_each_from_the_last(tmp_path: Path) -> None:
    rows = edit_rows(EditConfig(_source(tmp_path), edits=2, words=1))
    assert [(r["group"], r["edit"]) for r in rows] == [(g, e) for g in range(3) for e in range(3)]
    assert all(r["split"] == "evaluation" for r in rows) and rows[0]["domain"] == "code"
    assert rows[0]["prompt"] == instruction([]) + "def parse(path):\n    with open(path) as " \
        "handle:\n        return handle"
    for prev, row in zip(rows, rows[1:]):
        if row["group"] != prev["group"]:
            continue
        body = [m.group() for m in WORD.finditer(row["prompt"].split("\n\n", 1)[1])]
        before = [m.group() for m in WORD.finditer(prev["prompt"].split("\n\n", 1)[1])]
        assert sum(a != b for a, b in zip(body, before)) <= 1  # one word (maybe by itself)
        assert row["prompt"].startswith("Repeat the text below, replacing '")
    assert edit_rows(EditConfig(_source(tmp_path), groups=1, edits=0)) == rows[:1]
    assert all(r["prompt"] == r["prompt"].split("\n\n", 1)[0] + "\n\n" + r["text"]
               for r in rows)  # the version asked for, without the instruction


def test_a_domain_keeps_only_its_texts(tmp_path: Path) -> None:
    rows = edit_rows(EditConfig(_source(tmp_path), edits=1, domain="prose"))
    assert [(r["group"], r["domain"]) for r in rows] == [(0, "prose"), (0, "prose"),
                                                       (1, "prose"), (1, "prose")]
    with pytest.raises(ValueError, match="no prompts in domain 'sql'"):
        edit_rows(EditConfig(_source(tmp_path), domain="sql"))


def test_the_cli_writes_a_dataset_loadgen_reads(tmp_path: Path) -> None:
    out = tmp_path / "edit.jsonl"
    assert main(["--out", str(out), "--source", str(_source(tmp_path)), "--edits", "1"]) == 0
    read = read_prompts(out)
    assert len(read) == 6 and read[1]["prompt"].startswith("Repeat the text below, replacing")
    assert read_jsonl(out) == [json.loads(line) for line in out.read_text().splitlines()]
    reqs = in_order(read_jsonl(out))
    assert [r.prompt for r in reqs] == [r["prompt"] for r in read]  # in file order
    assert main(["--out", str(out), "--source", str(tmp_path / "missing.jsonl")]) == 2


def test_the_default_source_makes_the_benchmark_workload() -> None:
    rows = edit_rows(EditConfig(groups=2, split="evaluation"))
    assert len(rows) == 6 and {r["split"] for r in rows} == {"evaluation"}
