"""The schema workload: requests for structured output, each a text and a JSON Schema to fill.

Agent and extraction traffic sends a text and asks for a JSON object of a given shape (OpenAI's
``response_format: json_schema``, or a tool call's arguments). Each row here is one source text
(a ``--dataset``-style JSON Lines file, by default ``benchmarks/datasets/unseen-long.jsonl``:
text from outside the demo corpus, of its ``split``) cut to ``chars`` characters, after an
instruction naming the schema's fields, with one of ``SCHEMAS`` (in turn): records with strings,
numbers, enums, booleans, arrays and nested objects, as extraction and tool-call schemas are.
Strings and arrays are bounded (``maxLength``, ``maxItems``) as production schemas bound them,
so a small model's output ends.

Rows keep their source's ``domain`` and ``split`` and add ``schema`` (the JSON Schema) and
``schema_name``; ``python -m loadgen.schemas --out FILE`` writes one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from .datasets import DEFAULT_SOURCE, read_jsonl, write_jsonl


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


def _str(n: int = 32) -> dict:
    return {"type": "string", "maxLength": n}


SCHEMAS: dict[str, dict] = {
    "summary": _obj({"title": _str(48), "language": {"enum": ["python", "c", "english",
                                                              "german", "other"]},
                     "topics": {"type": "array", "items": _str(16), "maxItems": 3},
                     "lines": {"type": "integer", "minimum": 0, "maximum": 10000},
                     "has_code": {"type": "boolean"}}),
    "entities": _obj({"people": {"type": "array", "items": _obj({
        "name": _str(24), "role": {"enum": ["author", "subject", "other"]}}), "maxItems": 2},
        "places": {"type": "array", "items": _str(24), "maxItems": 2},
        "sentiment": {"enum": ["positive", "neutral", "negative"]}}),
    "ticket": _obj({"priority": {"enum": ["low", "medium", "high", "urgent"]},
                    "component": {"enum": ["parser", "compiler", "runtime", "docs", "tests"]},
                    "summary": _str(60), "reproducible": {"type": "boolean"},
                    "estimate_hours": {"type": "integer", "minimum": 1, "maximum": 40}}),
    "call": _obj({"name": {"enum": ["search_code", "open_file", "run_tests"]},
                  "arguments": _obj({"query": _str(40), "path": _str(40),
                                     "max_results": {"type": "integer", "minimum": 1,
                                                     "maximum": 50}})}),
    "review": _obj({"verdict": {"enum": ["approve", "request_changes", "comment"]},
                    "issues": {"type": "array", "maxItems": 2, "items": _obj({
                        "line": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "severity": {"enum": ["info", "warning", "error"]},
                        "message": _str(40)})},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
}
"""Schema name -> JSON Schema."""


@dataclass(frozen=True)
class SchemaConfig:
    """What the schema workload is made of."""

    source: Path = DEFAULT_SOURCE
    """JSON Lines with a ``prompt`` per row (``domain`` and ``split`` are kept)."""
    requests: int | None = None
    """Rows, from the source's texts in file order after the split's filter (None: all)."""
    chars: int = 600
    """Characters of each source text kept."""
    split: str | None = None
    """Only sources of this split (``tuning``/``evaluation``; None: all)."""


def schema_rows(cfg: SchemaConfig) -> list[dict]:
    """The workload's rows (module doc); ValueError when the source has no texts."""
    srcs = read_jsonl(cfg.source)
    srcs = [s for s in srcs if cfg.split is None or s.get("split") == cfg.split]
    if not srcs:
        raise ValueError(f"{cfg.source} has no texts of split {cfg.split}")
    names = list(SCHEMAS)
    rows = []
    for i, src in enumerate(srcs[:cfg.requests]):
        name = names[i % len(names)]
        fields = ", ".join(SCHEMAS[name]["properties"])
        prompt = (f"{src['prompt'][:cfg.chars]}\n\nThe text above as a JSON {name} with "
                  f"{fields}:\n")
        extra = {"split": src["split"]} if src.get("split") else {}
        rows.append({"prompt": prompt, "domain": str(src.get("domain", "dataset")),
                     "schema_name": name, "schema": SCHEMAS[name], **extra})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.schemas",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON Lines to write")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                   help="texts (JSON Lines with 'prompt'; default "
                   "benchmarks/datasets/unseen-long.jsonl)")
    p.add_argument("--requests", type=int, help="rows (default: one per source text)")
    p.add_argument("--chars", type=int, default=600, help="characters kept of each text")
    p.add_argument("--split", choices=("tuning", "evaluation"), help="only this split's texts")
    a = p.parse_args(argv)
    if a.chars < 1 or (a.requests is not None and a.requests < 1):
        p.error("--chars and --requests must be >= 1")
    try:
        rows = schema_rows(SchemaConfig(a.source, a.requests, a.chars, a.split))
    except (OSError, ValueError) as e:
        print(f"loadgen.schemas: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out, rows)
    print(f"{len(rows)} requests over {len(SCHEMAS)} schemas: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
