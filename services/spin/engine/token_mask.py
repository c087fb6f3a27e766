"""Allowed-token masks: packed bits, one row per tree row, applied to the target's logits.

A structured-output request's grammar allows some tokens at each row of its step's tree (row 0
after the context, row ``i + 1`` after node ``i``: the rows of ``rejection.py``). The router
computes the rows (``grammar.py``) and sends them packed, bit ``t % 32`` of int32 word
``t // 32`` (llguidance's and xgrammar's layout); the verifier restricts the target's rows to them
before the acceptance rule, so greedy decoding takes the best allowed token and sampling draws
from the target's distribution renormalised over the allowed tokens: constrained decoding,
drafts or not.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .tree import TokenTree


def words_per_row(vocab_size: int) -> int:
    """int32 words that hold one bit per token of a ``vocab_size`` vocabulary."""
    return (vocab_size + 31) // 32


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """words [R, W] int32 -> [R, vocab_size] bool (tokens past ``32 W`` are not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)                 # [32]
    bits = (words[..., None] >> shifts) & 1                                           # [R, W, 32]
    flat = bits.reshape(words.shape[0], -1).bool()                                    # [R, 32 W]
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size]
    return torch.nn.functional.pad(flat, (0, vocab_size - flat.shape[1]))


def apply_allowed(logits: torch.Tensor, words: torch.Tensor) -> None:
    """Restrict logits [R, V] in place to the allowed tokens of words [R', W] (R' >= R rows;
    the first R apply): the others get -inf. A row that allows nothing is left as it is (a
    grammar never asks that; the router's rows always allow something)."""
    rows = logits.shape[0]
    allowed = unpack(words[:rows].to(logits.device), logits.shape[-1])                # [R, V]
    empty = ~allowed.any(-1, keepdim=True)                                            # [R, 1]
    logits.masked_fill_(~(allowed | empty), float("-inf"))


def restrict_draft(tree: TokenTree, words: torch.Tensor) -> TokenTree:
    """``tree`` with each node's draft distribution restricted to what its parent's row allows
    (words [len(tree) + 1, W]); a tree without distributions (one-hot drafts) as it is.

    The router drops drafted nodes the grammar rejects, so a sampled node that reaches the
    verifier was drawn from its draft distribution *given* that it is allowed: the acceptance
    rule must divide by that conditional distribution, or the output would lean towards the
    tokens the draft favoured (the rule normalises the restricted rows)."""
    if tree.draft_probs is None or not len(tree):
        return tree
    probs = tree.draft_probs                                                          # [N, Vd]
    rows = words[[p + 1 for p in tree.parents]].to(probs.device)                      # [N, W]
    return replace(tree, draft_probs=probs * unpack(rows, probs.shape[-1]).to(probs.dtype))


def to_bytes(words: torch.Tensor) -> bytes:
    """words [R, W] int32 -> little-endian bytes (the wire's ``TokenMask.bits``)."""
    return words.numpy().astype("<i4").tobytes()


def from_bytes(bits: bytes, words_per_row_: int) -> torch.Tensor:
    """``to_bytes``'s inverse: [R, W] int32. ValueError when the length is not whole rows."""
    if words_per_row_ <= 0 or len(bits) % (4 * words_per_row_):
        raise ValueError(f"a token mask of {len(bits)} bytes is not whole rows of "
                         f"{words_per_row_} 4-byte words")
    arr = np.frombuffer(bits, dtype="<i4").astype(np.int32).reshape(-1, words_per_row_)
    return torch.from_numpy(arr.copy())


def allows(words: torch.Tensor, row: int, token: int) -> bool:
    """Whether row ``row`` of words [R, W] allows ``token``."""
    word = token >> 5
    return word < words.shape[1] and bool((int(words[row, word]) >> (token & 31)) & 1)
