"""Engine data types <-> ``spin.v1`` messages. Both sides are plain token ids and parent indices;
draft probabilities travel only for sampling requests, as fp16 bytes, dense or sparse, whichever
is smaller."""

from __future__ import annotations

import numpy as np
import torch

from ..engine.sampling import SamplingParams
from ..engine.tree import TokenTree
from ..v1 import sampling_pb2, token_tree_pb2


def sampling_to_proto(s: SamplingParams) -> sampling_pb2.SamplingParams:
    msg = sampling_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k)
    if s.top_p != 1.0:
        msg.top_p = s.top_p
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (the caller's INVALID_ARGUMENT) for out-of-range values."""
    return SamplingParams(temperature=msg.temperature,
                          top_p=msg.top_p if msg.HasField("top_p") else 1.0,
                          top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None)


def tree_to_proto(tree: TokenTree) -> token_tree_pb2.TokenTree:
    """Draft probability rows go as fp16 bytes: dense (2 bytes per vocabulary id), or sparse
    (the ids with probability > 0 and their fp16 values) when that is smaller."""
    msg = token_tree_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)
    if tree.draft_probs is not None:
        rows = tree.draft_probs.detach().to("cpu", torch.float16)                      # [N, V]
        nonzero = (rows != 0).sum(-1).tolist()                                         # [N]
        for row, nnz in zip(rows, nonzero):
            if nnz * 6 < row.numel() * 2:  # an int32 varint (<= 4 bytes here) + 2 per entry
                ids = row.nonzero().flatten()
                msg.probs.add(token_ids=ids.tolist(), token_probs_f16=_le(row[ids]))
            else:
                msg.probs.add(dense_f16=_le(row))
    return msg


def _le(values: torch.Tensor) -> bytes:
    """fp16 values as little-endian bytes."""
    return values.contiguous().numpy().astype("<f2").tobytes()


def _f16(data: bytes, what: str) -> torch.Tensor:
    """Little-endian fp16 bytes -> fp16 values (finite, >= 0)."""
    if len(data) % 2:
        raise ValueError(f"{what}: {len(data)} bytes is not a whole number of fp16 values")
    values = torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float16))
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"{what}: probabilities must be finite and >= 0")
    return values


def tree_from_proto(msg: token_tree_pb2.TokenTree, vocab_size: int,
                    device: torch.device | str = "cpu") -> TokenTree:
    """Raises ValueError for a malformed tree (parents out of order, wrong probability rows).
    Probability rows come back as fp16 [N, vocab_size] (zeros past the draft's vocabulary);
    the rejection rule normalises them."""
    probs = None
    if len(msg.probs):
        if len(msg.probs) != len(msg.tokens):
            raise ValueError(f"{len(msg.probs)} probability rows for {len(msg.tokens)} nodes")
        probs = torch.zeros(len(msg.probs), vocab_size, dtype=torch.float16)           # [N, V]
        for i, row in enumerate(msg.probs):
            if row.dense_f16:
                dense = _f16(row.dense_f16, "dense row")
                if len(dense) > vocab_size:
                    raise ValueError(f"dense row of {len(dense)} for a vocabulary of {vocab_size}")
                probs[i, :len(dense)] = dense
            else:
                values = _f16(row.token_probs_f16, "sparse row")
                if len(row.token_ids) != len(values):
                    raise ValueError(f"sparse row with {len(row.token_ids)} ids and "
                                     f"{len(values)} probabilities")
                ids = torch.tensor(row.token_ids, dtype=torch.long)
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    raise ValueError("sparse row names a token outside the vocabulary")
                probs[i, ids] = values
            if not float(probs[i].float().sum()) > 0:
                raise ValueError(f"probability row {i} has no mass")
        probs = probs.to(device)
    if any(not 0 <= t < vocab_size for t in msg.tokens):
        raise ValueError("tree token outside the vocabulary")
    return TokenTree(tuple(msg.tokens), tuple(msg.parents), probs)
