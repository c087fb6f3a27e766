"""Vocabulary compatibility by tokens, not sizes.

A draft model may pair with a target when both tokenize every text alike: the same token -> id
map and special tokens, whatever their embedding tables are padded to (Qwen2.5-7B has 152064
output rows, Qwen2.5-0.5B 151936, for one tokenizer of 151665 tokens). ``TokenizerId`` names a
tokenizer by a fingerprint of exactly that; the router compares fingerprints, not row counts.

A drafter scores only the ids its tokenizer knows (``vocab_limit``), so it never drafts a padding
row, and the target's distributions, over its own rows, stay the reference: draft probabilities
past the draft's rows are zero.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TokenizerId:
    """Who a tokenizer is."""

    name: str
    """Class and source, e.g. 'Qwen2TokenizerFast Qwen2.5-7B-Instruct'."""
    size: int
    """One past its largest token id (every id it produces is below it)."""
    fingerprint: str
    """SHA-256 of its token -> id map and its special tokens (hex)."""

    def describe(self) -> str:
        return f"{self.name} (ids < {self.size}, fingerprint {self.fingerprint[:12]})"


def identify(tokenizer) -> TokenizerId:
    """The ``TokenizerId`` of a loaded transformers tokenizer."""
    vocab = tokenizer.get_vocab()
    special = {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())}
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]),
                             ensure_ascii=False).encode())
    digest.update(json.dumps(special, sort_keys=True, ensure_ascii=False).encode())
    source = Path(str(getattr(tokenizer, "name_or_path", "") or "")).name
    return TokenizerId(f"{type(tokenizer).__name__} {source}".strip(),
                       max(vocab.values(), default=-1) + 1, digest.hexdigest())


def load_identity(path: str | Path) -> TokenizerId | None:
    """The identity of the tokenizer saved beside a checkpoint; None when there is none."""
    from transformers import AutoTokenizer

    try:
        return identify(AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError, TypeError):
        return None


def incompatibility(target: TokenizerId | None, target_rows: int, draft: TokenizerId | None,
                    draft_rows: int) -> str | None:
    """Why a drafter cannot draft for a target (None: it can). Without tokenizers on both
    sides, equal row counts are the only evidence of a shared vocabulary."""
    if target is not None and draft is not None:
        if target.fingerprint == draft.fingerprint:
            return None
        return (f"its tokenizer {draft.describe()} is not the target's {target.describe()}: "
                f"they tokenize text differently")
    if target_rows == draft_rows:
        return None
    return (f"it has {draft_rows} vocabulary rows, the target {target_rows}, and "
            f"{'neither' if target is None and draft is None else 'one'} has a tokenizer to "
            f"compare")
