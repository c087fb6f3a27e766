"""The edit workload: requests that ask to repeat an earlier text with a small change.

Editing traffic (rewrite this file with one change, fix this paragraph) sends the same long text
again and again, each time a little different, and gets back nearly what it got the last time:
what suffix decoding drafts from (``spin.engine.suffix_decoding``). Here each source text
(a ``--dataset``-style JSON Lines file, by default ``benchmarks/datasets/unseen-long.jsonl``:
text from outside the demo corpus) makes one *group* of requests sent one after the other: the
text as it is, then ``edits`` versions of it, each the previous one with ``words`` words replaced
by other words of the same text, each prompt an instruction to repeat the text with the change
(``Request``'s ``prompt``). A completion model (the demo family's target) continues the text
instead of obeying; the draftable repetition is the same: a group's later requests share its
earlier ones' prompt tail and, mostly, their outputs.

Rows keep their source's ``domain`` and ``split`` and add ``group``, ``edit`` (0 = the
original) and ``text`` (the version the prompt asks to repeat, without the instruction);
``loadgen.datasets.read_prompts`` reads the file like any ``--dataset``, and a run that wants
the groups' order sends the rows in file order (``in_order``; ``datasets.read_jsonl`` reads
them back). ``python -m loadgen.edit --out FILE [--domain code]`` writes one.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .datasets import DEFAULT_SOURCE, read_jsonl, write_jsonl
from .workload import Request

WORD = re.compile(r"[A-Za-z]{3,}")
"""What an edit may replace: a word of three letters or more."""


@dataclass(frozen=True)
class EditConfig:
    """What the edit workload is made of."""

    source: Path = DEFAULT_SOURCE
    """JSON Lines with a ``prompt`` per row (``domain`` and ``split`` are kept)."""
    groups: int | None = None
    """Source texts used, in file order after the split's filter (None: all)."""
    edits: int = 2
    """Edited versions after each original (a group has ``edits + 1`` requests)."""
    words: int = 3
    """Words replaced per edit (by other words of the same text)."""
    split: str | None = None
    """Only sources of this split (``tuning``/``evaluation``; None: all)."""
    domain: str | None = None
    """Only sources of this domain (``code`` for a code-edit workload; None: all)."""
    seed: int = 0
    """Which words are replaced, and by what."""


def instruction(changes: list[tuple[str, str]]) -> str:
    """The request's first line: repeat the text, with ``changes`` (old word, new word)."""
    if not changes:
        return "Repeat the text below exactly.\n\n"
    said = ", ".join(f"'{a}' with '{b}'" for a, b in changes)
    return f"Repeat the text below, replacing {said}.\n\n"


def edit_text(text: str, words: int, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """``text`` with ``words`` of its words (at distinct places) replaced by other words of it;
    the new text and the (old, new) pairs, in text order. Fewer when the text has fewer."""
    spans = [m.span() for m in WORD.finditer(text)]
    vocab = sorted({text[a:b] for a, b in spans})
    if len(vocab) < 2:
        return text, []
    chosen = sorted(rng.sample(range(len(spans)), min(words, len(spans))))
    out, changes, at = [], [], 0
    for i in chosen:
        a, b = spans[i]
        old = text[a:b]
        new = rng.choice([w for w in vocab if w != old])
        out += [text[at:a], new]
        changes.append((old, new))
        at = b
    out.append(text[at:])
    return "".join(out), changes


def edit_rows(cfg: EditConfig) -> list[dict]:
    """The workload's rows, group by group (module doc)."""
    sources = read_jsonl(cfg.source)
    sources = [s for s in sources if isinstance(s, dict) and isinstance(s.get("prompt"), str)
               and (cfg.split is None or s.get("split", cfg.split) == cfg.split)
               and (cfg.domain is None or s.get("domain") == cfg.domain)]
    if cfg.groups is not None:
        sources = sources[:cfg.groups]
    if not sources:
        raise ValueError(f"{cfg.source}: no prompts"
                         + (f" of the {cfg.split} split" if cfg.split else "")
                         + (f" in domain {cfg.domain!r}" if cfg.domain else ""))
    rng = random.Random(cfg.seed)
    rows = []
    for g, src in enumerate(sources):
        text, changes = src["prompt"], []
        for e in range(cfg.edits + 1):
            extra = {"split": src["split"]} if src.get("split") else {}
            rows.append({"prompt": instruction(changes) + text, "text": text,
                         "domain": str(src.get("domain", "dataset")), "group": g, "edit": e,
                         **extra})
            text, changes = edit_text(text, cfg.words, rng)
    return rows


def in_order(rows: list[dict]) -> list[Request]:
    """The rows as a workload in their order (``workload.build_workload`` shuffles), all
    arriving at once (a closed loop sends them in turn)."""
    return [Request(i, r.get("domain", "dataset"), r["prompt"], 0.0) for i, r in enumerate(rows)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.edit", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON Lines to write")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                   help="texts to edit (JSON Lines with 'prompt'; default "
                   "benchmarks/datasets/unseen-long.jsonl)")
    p.add_argument("--groups", type=int, help="source texts used (default: all)")
    p.add_argument("--edits", type=int, default=2, help="edited versions per text (default 2)")
    p.add_argument("--words", type=int, default=3, help="words replaced per edit (default 3)")
    p.add_argument("--split", choices=("tuning", "evaluation"), help="only this split's texts")
    p.add_argument("--domain", help="only this domain's texts (e.g. code)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.edits < 0 or a.words < 1 or (a.groups is not None and a.groups < 1):
        p.error("--edits must be >= 0, --words and --groups >= 1")
    try:
        rows = edit_rows(EditConfig(a.source, a.groups, a.edits, a.words, a.split, a.domain,
                                    a.seed))
    except (OSError, ValueError) as e:
        print(f"loadgen.edit: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out, rows)
    print(f"{len(rows)} requests in {len(rows) // (a.edits + 1)} groups: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
