"""The schema workload: texts with a JSON Schema each, every schema one the grammar engine
compiles, written as a ``--dataset`` file."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from loadgen.schemas import SCHEMAS, SchemaConfig, main, schema_rows
from spin.engine.grammar import GrammarCompiler, GrammarSpec


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"text number {i} " * 40, "domain": "prose",
                                        "split": "evaluation" if i % 2 else "tuning"}) + "\n"
                            for i in range(12)))
    return path


def test_rows_take_the_split_cut_texts_and_every_schema_in_turn(tmp_path: Path) -> None:
    rows = schema_rows(SchemaConfig(_source(tmp_path), requests=5, chars=50,
                                    split="evaluation"))
    assert len(rows) == 5 and {r["split"] for r in rows} == {"evaluation"}
    assert [r["schema_name"] for r in rows] == list(SCHEMAS)[:5]
    for i, r in enumerate(rows):  # the odd texts are the evaluation split's
        assert r["prompt"].startswith(f"text number {2 * i + 1} ")
        assert r["prompt"].endswith(", ".join(SCHEMAS[r["schema_name"]]["properties"]) + ":\n")
        assert len(r["prompt"].split("\n\n")[0]) == 50
        jsonschema.Draft202012Validator.check_schema(r["schema"])


def test_every_schema_compiles(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    for schema in SCHEMAS.values():
        assert compiler.constraint(GrammarSpec("json_schema", json.dumps(schema))).forced(4)


def test_the_command_writes_a_dataset(tmp_path: Path, capsys) -> None:
    out = tmp_path / "schemas.jsonl"
    assert main(["--out", str(out), "--source", str(_source(tmp_path)), "--requests", "3"]) == 0
    assert len(out.read_text().splitlines()) == 3 and "3 requests" in capsys.readouterr().out
    assert main(["--out", str(out), "--source", str(tmp_path / "none.jsonl")]) == 2
