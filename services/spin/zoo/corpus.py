"""The demo corpus, built only from text present on every machine of the project's kind.

Sources (see ``models/demo/README.md`` for licences):

- **code**: the CPython standard library source (``/usr/lib/python3.11``, PSF licence), without
  its test suites, generated tables and bundled packages;
- **prose**: English man pages (sections 1-8) and GNU info manuals (GPL/GFDL/BSD and similar), with
  the cloud CLI's generated reference pages excluded (they are formulaic and make prose
  artificially easy);
- **structured**: JSON records, log lines, tables and INI files generated from a seed
  (``structured.py``).

Every document goes to the training or the held-out split by a hash of its id, so the split is the
same on every machine and does not move when other documents come or go.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from .roff import roff_to_text
from .specs import DOMAINS, HELDOUT_PROMPTS, FamilySpec
from .structured import structured_documents

_CODE_ROOTS = (Path("/usr/lib/python3.11"), Path(sysconfig.get_paths()["stdlib"]))
_CODE_SKIP = ("test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
              "pydoc_data", "__pycache__", "lib2to3", "ensurepip", "config-3.11-x86_64-linux-gnu")
_MAN_ROOT = Path("/usr/share/man")
_INFO_ROOT = Path("/usr/share/info")
#: Machine-specific, generated reference pages (a cloud CLI ships ~16k of them).
_MAN_SKIP_PREFIXES = ("gcloud", "bq", "gsutil")
_MAX_DOC_CHARS = 200_000
STRUCTURED_DOCS = 6000

PromptSplit = Literal["tuning", "evaluation"]
"""Halves of the held-out prompts, disjoint by document (``prompt_split``): tuning tools (``spin
bench ab``, ``spin bench fit``, choosing a benchmark's best configuration) use ``tuning``;
benchmarks time ``evaluation``."""


def is_heldout(doc_id: str, percent: int) -> bool:
    """Whether a document belongs to the held-out split (stable across machines)."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) % 100 < percent


def code_documents() -> Iterator[tuple[str, str]]:
    root = next((r for r in _CODE_ROOTS if (r / "os.py").exists()), None)
    if root is None:
        raise FileNotFoundError(f"no CPython standard library found in {_CODE_ROOTS}")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _CODE_SKIP for part in rel.parts[:-1]) or path.is_symlink():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if 200 < len(text) <= _MAX_DOC_CHARS:
            yield f"code/{rel.as_posix()}", text


def prose_documents() -> Iterator[tuple[str, str]]:
    seen: set[str] = set()
    pages = sorted(p for p in _MAN_ROOT.glob("man[1-8]/*")
                   if not p.name.startswith(_MAN_SKIP_PREFIXES) and not p.is_symlink())
    for path in pages:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = roff_to_text(raw.decode("utf-8", errors="replace"))
        digest = hashlib.sha1(text.encode()).hexdigest()
        if len(text) > 300 and digest not in seen:
            seen.add(digest)
            yield f"man/{path.parent.name}/{path.name}", text[:_MAX_DOC_CHARS]
    for path in sorted(_INFO_ROOT.glob("*.info*.gz")):
        text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        # Info nodes are separated by \x1f; drop the node header lines.
        for i, node in enumerate(text.split("\x1f")):
            body = "\n".join(l for l in node.splitlines() if not l.startswith("File: ")).strip()
            if len(body) > 300:
                yield f"info/{path.name}/{i}", body[:_MAX_DOC_CHARS]


def documents(domain: str, seed: int) -> Iterator[tuple[str, str]]:
    if domain == "code":
        return code_documents()
    if domain == "prose":
        return prose_documents()
    if domain == "structured":
        return structured_documents(STRUCTURED_DOCS, seed)
    raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")


def build_corpus(family: FamilySpec, out_dir: Path) -> dict[str, dict[str, int]]:
    """Write ``{domain}.{train,heldout}.jsonl`` under ``out_dir``; return document/char counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict[str, int]] = {}
    for domain in DOMAINS:
        counts = {"train_docs": 0, "heldout_docs": 0, "train_chars": 0, "heldout_chars": 0}
        with (open(out_dir / f"{domain}.train.jsonl", "w") as train,
              open(out_dir / f"{domain}.heldout.jsonl", "w") as held):
            for doc_id, text in tqdm(documents(domain, family.seed), desc=f"corpus {domain}",
                                     unit="doc"):
                split = "heldout" if is_heldout(doc_id, family.heldout_percent) else "train"
                (held if split == "heldout" else train).write(
                    json.dumps({"id": doc_id, "text": text}) + "\n")
                counts[f"{split}_docs"] += 1
                counts[f"{split}_chars"] += len(text)
        stats[domain] = counts
    (out_dir / "manifest.json").write_text(json.dumps(stats, indent=2))
    return stats


def read_documents(path: Path) -> Iterator[dict[str, str]]:
    with open(path) as f:
        for line in f:
            yield json.loads(line)


def sample_excerpts(path: Path, count: int, prompt_chars: int, reference_chars: int,
                    seed: int) -> list[dict[str, str]]:
    """``count`` excerpts (prompt + the human text that follows it), spread over the documents.

    Documents are visited in a seeded order, round-robin, so a small split still yields ``count``
    excerpts (at different offsets). Excerpts start at a line boundary so prompts read naturally;
    documents too short for a prompt and a reference are skipped.
    """
    docs = [d for d in read_documents(path) if len(d["text"]) >= prompt_chars + reference_chars]
    if not docs:
        raise ValueError(f"{path}: no document is long enough for an excerpt")
    rng = random.Random(seed)
    rng.shuffle(docs)
    out = []
    for i in range(count):
        doc = docs[i % len(docs)]
        text = doc["text"]
        start = rng.randrange(0, len(text) - prompt_chars - reference_chars + 1)
        newline = text.rfind("\n", 0, start)
        start = newline + 1 if newline >= 0 and start - newline < 200 else start
        prompt = text[start:start + prompt_chars]
        reference = text[start + prompt_chars:start + prompt_chars + reference_chars]
        out.append({"id": f"{doc['id']}@{start}", "prompt": prompt, "reference": reference})
    return out


def prompt_split(prompt_id: str) -> PromptSplit:
    """The split of a held-out prompt ``"{document id}@{offset}"``: by a hash of its document, so
    two excerpts of one document never land on both sides."""
    doc_id = prompt_id.rsplit("@", 1)[0]
    return "evaluation" if int(hashlib.sha1(f"split:{doc_id}".encode()).hexdigest()[:8],
                                16) % 2 else "tuning"


def heldout_prompts(family_dir: Path, domains: tuple[str, ...] | None = None,
                    split: PromptSplit | None = None) -> list[dict[str, str]]:
    """The family's held-out prompt rows ``{"domain", "id", "prompt", "reference"}``; with
    ``split``, only that half (``prompt_split``)."""
    path = family_dir / HELDOUT_PROMPTS
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `spin zoo train --stages prompts`")
    rows = [r for r in read_documents(path) if (domains is None or r["domain"] in domains)
            and (split is None or prompt_split(r["id"]) == split)]
    if not rows:
        raise ValueError(f"{path} has no {split or 'held-out'} prompts for domains {domains}")
    return rows
