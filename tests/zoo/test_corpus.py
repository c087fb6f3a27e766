import json
from pathlib import Path

import pytest

from spin.zoo.corpus import heldout_prompts, is_heldout, prompt_split, sample_excerpts
from spin.zoo.specs import FAMILY_DIR


def test_split_is_stable_and_about_the_requested_share() -> None:
    ids = [f"code/module_{i}.py" for i in range(4000)]
    held = [i for i in ids if is_heldout(i, 5)]
    assert held == [i for i in ids if is_heldout(i, 5)]
    assert 0.035 < len(held) / len(ids) < 0.065
    assert not any(is_heldout(i, 0) for i in ids)


def test_excerpts_are_contiguous_seeded_and_cycle(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    docs = [{"id": f"d{i}", "text": "\n".join(f"line {i}.{j}" for j in range(200))} for i in range(3)]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    ex = sample_excerpts(path, count=7, prompt_chars=100, reference_chars=80, seed=3)
    assert len(ex) == 7 and ex == sample_excerpts(path, 7, 100, 80, seed=3)
    by_id = {d["id"]: d["text"] for d in docs}
    for e in ex:
        doc = by_id[e["id"].split("@")[0]]
        assert e["prompt"] + e["reference"] in doc
        assert len(e["prompt"]) == 100 and len(e["reference"]) == 80


def test_excerpts_need_long_enough_documents(tmp_path: Path) -> None:
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "too short"}) + "\n")
    with pytest.raises(ValueError, match="long enough"):
        sample_excerpts(path, 1, 100, 100, seed=0)


def test_prompt_splits_are_disjoint_by_document_and_cover_every_domain() -> None:
    tuning = heldout_prompts(FAMILY_DIR, split="tuning")
    evaluation = heldout_prompts(FAMILY_DIR, split="evaluation")
    assert len(tuning) + len(evaluation) == len(heldout_prompts(FAMILY_DIR))
    docs = [{r["id"].rsplit("@", 1)[0] for r in rows} for rows in (tuning, evaluation)]
    assert not docs[0] & docs[1]
    for rows in (tuning, evaluation):
        assert {r["domain"] for r in rows} == {"code", "prose", "structured"}
    # two excerpts of one document share a split whatever their offsets
    assert prompt_split("code/os.py@10") == prompt_split("code/os.py@90000")
