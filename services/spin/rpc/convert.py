"""Engine data types <-> ``spin.v1`` messages. Both sides are plain token ids and parent indices;
draft probabilities travel only for sampling requests, dense or sparse, whichever is smaller."""

from __future__ import annotations

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
    msg = token_tree_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)
    if tree.draft_probs is not None:
        probs = tree.draft_probs.float().cpu()                                 # [N, V]
        for row in probs:
            nz = row.nonzero().flatten()
            if len(nz) * 2 < row.numel():
                msg.probs.add(token_ids=nz.tolist(), token_probs=row[nz].tolist())
            else:
                msg.probs.add(dense=row.tolist())
    return msg


def tree_from_proto(msg: token_tree_pb2.TokenTree, vocab_size: int,
                    device: torch.device | str = "cpu") -> TokenTree:
    """Raises ValueError for a malformed tree (parents out of order, wrong probability rows)."""
    probs = None
    if len(msg.probs):
        if len(msg.probs) != len(msg.tokens):
            raise ValueError(f"{len(msg.probs)} probability rows for {len(msg.tokens)} nodes")
        probs = torch.zeros(len(msg.probs), vocab_size)                       # [N, V]
        for i, row in enumerate(msg.probs):
            if len(row.dense):
                if len(row.dense) != vocab_size:
                    raise ValueError(f"dense row of {len(row.dense)} for a vocabulary of {vocab_size}")
                probs[i] = torch.tensor(row.dense)
            else:
                if len(row.token_ids) != len(row.token_probs):
                    raise ValueError(f"sparse row with {len(row.token_ids)} ids and "
                                     f"{len(row.token_probs)} probabilities")
                ids = torch.tensor(row.token_ids, dtype=torch.long)
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    raise ValueError("sparse row names a token outside the vocabulary")
                probs[i, ids] = torch.tensor(row.token_probs)
        probs = probs.to(device)
    if any(not 0 <= t < vocab_size for t in msg.tokens):
        raise ValueError("tree token outside the vocabulary")
    return TokenTree(tuple(msg.tokens), tuple(msg.parents), probs)
