"""Long prompts the demo family has never seen: text from outside its corpus, in its three kinds.

The demo corpus (``zoo/corpus.py``) is CPython's standard library without its test suites, man
pages and info manuals, and generated records. This builds prompts from what it left out, all of
it on every machine of the project's kind:

- **code**: CPython's own test suite (``<stdlib>/test/test_*.py``);
- **prose**: the licence texts of ``/usr/share/common-licenses`` and the ``copyright`` files of
  ``/usr/share/doc`` (legal English, a register the corpus has little of);
- **structured**: Debian changelogs (``/usr/share/doc/*/changelog.Debian.gz``: dated entries,
  version lines, bullet lists) and the configuration files of ``/etc``.

Each prompt is a window of one document, cut at a line start, ``min_tokens`` to ``max_tokens``
target tokens long. Documents go to the ``tuning`` or ``evaluation`` half by a hash of their path
(``split`` in each row), so tuning and timing never share a document. The rows are loadgen's
``--dataset`` JSON Lines (``prompt``, plus ``domain``, ``split`` and ``source``); the committed file
(``benchmarks/datasets/unseen-long.jsonl``) is what the benchmarks read, so they do not depend on
the machine's files.
"""

from __future__ import annotations

import gzip
import hashlib
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.datasets import DEFAULT_SOURCE, write_jsonl

DEFAULT_OUT = DEFAULT_SOURCE


@dataclass(frozen=True)
class UnseenConfig:
    """What ``build_unseen`` writes."""

    tokenizer: Path
    """The target's tokenizer directory (prompt lengths are in its tokens)."""
    per_domain: int = 60
    """Prompts of each kind."""
    min_tokens: int = 200
    """Shortest prompt, in target tokens."""
    max_tokens: int = 320
    """Longest prompt, in target tokens."""
    seed: int = 0
    """Which documents and windows are taken."""
    out: Path = DEFAULT_OUT


def _code() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    for path in sorted(root.glob("test_*.py")):
        yield str(path), path.read_text(errors="replace")


def _prose() -> Iterator[tuple[str, str]]:
    for path in sorted(Path("/usr/share/common-licenses").glob("*")):
        if path.is_file() and not path.is_symlink():
            yield str(path), path.read_text(errors="replace")
    for path in sorted(Path("/usr/share/doc").glob("*/copyright")):
        yield str(path), path.read_text(errors="replace")


def _structured() -> Iterator[tuple[str, str]]:
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz")):
        with gzip.open(path, "rt", errors="replace") as f:
            yield str(path), f.read()
    for path in sorted(Path("/etc").glob("*.conf")):
        if path.is_file():
            yield str(path), path.read_text(errors="replace")


SOURCES: dict[str, Callable[[], Iterator[tuple[str, str]]]] = {
    "code": _code, "prose": _prose, "structured": _structured}


def split_of(source: str) -> str:
    """The half a document belongs to, by a hash of its path (stable across machines)."""
    return "tuning" if int(hashlib.sha1(source.encode()).hexdigest()[:8], 16) % 2 else "evaluation"


def window(text: str, count: Callable[[str], int], lo: int, hi: int,
           rng: random.Random) -> str | None:
    """A run of whole lines of ``text`` from a random line on, at least a length drawn from
    ``lo``..``hi`` tokens and at most ``hi``; None when the document is too short."""
    lines = text.splitlines(keepends=True)
    starts = list(range(len(lines)))
    rng.shuffle(starts)
    want = rng.randint(lo, hi)
    for start in starts[:8]:
        out, n = "", 0
        for line in lines[start:]:
            m = count(line)
            if n + m > hi:
                break
            out, n = out + line, n + m
            if n >= want and lo <= count(out) <= hi:  # tokens can merge across lines
                return out
    return None


def build_unseen(cfg: UnseenConfig) -> dict:
    """Write the dataset; a summary of what it holds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(cfg.seed)
    rows = []
    for domain, source in SOURCES.items():
        docs = [(s, t) for s, t in source() if t.strip()]
        rng.shuffle(docs)
        taken = 0
        for name, text in docs:
            if taken == cfg.per_domain:
                break
            prompt = window(text, count, cfg.min_tokens, cfg.max_tokens, rng)
            if prompt is None:
                continue
            rows.append({"prompt": prompt, "domain": domain, "split": split_of(name),
                         "source": name, "tokens": count(prompt)})
            taken += 1
        if taken < cfg.per_domain:
            raise RuntimeError(f"only {taken} {domain} documents of {cfg.min_tokens}+ tokens "
                               f"(wanted {cfg.per_domain})")
    write_jsonl(cfg.out, rows)
    return {"out": str(cfg.out), "prompts": len(rows),
            "by_split": {s: sum(r["split"] == s for r in rows) for s in ("tuning", "evaluation")},
            "mean_tokens": sum(r["tokens"] for r in rows) / len(rows)}
