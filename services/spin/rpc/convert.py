"""Engine data types <-> ``spin.v1`` messages. Both sides are plain token ids and parent indices;
draft probabilities travel only for sampling requests, as fp16 bytes, dense or sparse, whichever
is smaller.

The router passes a drafter's tree on to the verifier without decoding its probability rows
(``ReceivedTree``, ``tree_from_wire``, ``tree_to_wire``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.logprobs import TokenLogprobs
from ..engine.sampling import SamplingParams
from ..engine.transfer import to_device
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
    """Raises ValueError (the caller's INVALID_ARGUMENT) for out-of-range values, naming the
    field and its range: temperature finite and >= 0, top_p (when set) in (0, 1], top_k >= 0
    (any int64 seed is fine)."""
    if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        raise ValueError(f"sampling.temperature must be finite and >= 0 (0 = greedy), "
                         f"got {msg.temperature}")
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:  # NaN and inf fail too
        raise ValueError(f"sampling.top_p must be in (0, 1], got {top_p}")
    if msg.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {msg.top_k}")
    return SamplingParams(temperature=msg.temperature, top_p=top_p, top_k=msg.top_k,
                          seed=msg.seed if msg.HasField("seed") else None)


def tree_to_proto(tree: TokenTree) -> token_tree_pb2.TokenTree:
    """Draft probability rows go as fp16 bytes: dense (2 bytes per vocabulary id), or sparse
    (the ids with probability > 0 and their fp16 values) when that is smaller."""
    msg = token_tree_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents, second=tree.second)
    if tree.draft_probs is not None:  # numpy, on the bits: fp16 arithmetic on the CPU is slow
        rows = tree.draft_probs.detach().to("cpu", torch.float16).numpy().astype("<f2")  # [N, V]
        bits = rows.view(np.uint16)  # a probability is 0 exactly when its bits are
        for row, row_bits, nnz in zip(rows, bits, np.count_nonzero(bits, axis=1)):
            if nnz * 6 < row.size * 2:  # an int32 varint (<= 4 bytes here) + 2 per entry
                ids = np.flatnonzero(row_bits)
                msg.probs.add(token_ids=ids.tolist(), token_probs_f16=row[ids].tobytes())
            else:
                msg.probs.add(dense_f16=row.tobytes())
    return msg


def _f16(data: bytes, what: str) -> tuple[torch.Tensor, float]:
    """Little-endian fp16 bytes -> (fp16 values, their sum), checked finite and >= 0. The checks
    run in float32 numpy: torch's fp16 reductions on the CPU take ~50 ms for a 152k-token row,
    these ~0.02 ms."""
    if len(data) % 2:
        raise ValueError(f"{what}: {len(data)} bytes is not a whole number of fp16 values")
    raw = np.frombuffer(data, dtype="<f2")
    wide = raw.astype(np.float32)
    if not bool(np.isfinite(wide).all()) or bool((wide < 0).any()):
        raise ValueError(f"{what}: probabilities must be finite and >= 0")
    return torch.from_numpy(raw.astype(np.float16)), float(wide.sum())


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
                dense, mass = _f16(row.dense_f16, "dense row")
                if len(dense) > vocab_size:
                    raise ValueError(f"dense row of {len(dense)} for a vocabulary of {vocab_size}")
                probs[i, :len(dense)] = dense
            else:
                values, mass = _f16(row.token_probs_f16, "sparse row")
                if len(row.token_ids) != len(values):
                    raise ValueError(f"sparse row with {len(row.token_ids)} ids and "
                                     f"{len(values)} probabilities")
                ids = torch.tensor(row.token_ids, dtype=torch.long)
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    raise ValueError("sparse row names a token outside the vocabulary")
                probs[i, ids] = values
            if not mass > 0:
                raise ValueError(f"probability row {i} has no mass")
        probs = to_device(probs, device)
    if any(not 0 <= t < vocab_size for t in msg.tokens):
        raise ValueError("tree token outside the vocabulary")
    return TokenTree(tuple(msg.tokens), tuple(msg.parents), probs)


# ---- the router: drafts passed on to the verifier ------------------------------------------------
@dataclass(frozen=True)
class ReceivedTree(TokenTree):
    """A drafter's tree as the router received it: tokens and parents read (and checked), the
    draft probability rows left as they came, to go on to the verifier as they are.

    The router never reads draft probabilities, and decoding fp16 rows costs far more than
    passing them on (tens of milliseconds per 152k-entry row on a CPU); the verifier checks them
    when it decodes them (``tree_from_proto``). ``draft_probs`` stays None here: that the rows
    exist is ``message``'s business, and ``tree_to_wire`` sends them."""

    message: token_tree_pb2.TokenTree | None = field(default=None, compare=False, repr=False)
    """The received message, probability rows included."""


def tree_from_wire(msg: token_tree_pb2.TokenTree) -> TokenTree:
    """A drafter's tree for the router: a ``ReceivedTree`` carrying its probability rows
    undecoded, or a plain ``TokenTree`` when it has none. Raises ValueError for a malformed
    tree (parents out of order, a probability row count other than the node count)."""
    if len(msg.probs) and len(msg.probs) != len(msg.tokens):
        raise ValueError(f"{len(msg.probs)} probability rows for {len(msg.tokens)} nodes")
    second = tuple(msg.second) if len(msg.second) == len(msg.tokens) else ()
    if not len(msg.probs):
        return TokenTree(tuple(msg.tokens), tuple(msg.parents), second=second)
    return ReceivedTree(tuple(msg.tokens), tuple(msg.parents), second=second, message=msg)


def subtree(tree: TokenTree, nodes: list[int]) -> TokenTree:
    """``tree.subtree(nodes)``, a received tree's probability rows kept as they came."""
    if not isinstance(tree, ReceivedTree) or tree.message is None:
        return tree.subtree(nodes)
    cut = tree.subtree(nodes)
    msg = token_tree_pb2.TokenTree(tokens=cut.tokens, parents=cut.parents, second=cut.second)
    msg.probs.extend(tree.message.probs[n] for n in nodes)
    return ReceivedTree(cut.tokens, cut.parents, second=cut.second, message=msg)


def tree_to_wire(tree: TokenTree) -> token_tree_pb2.TokenTree:
    """The message for a tree the router sends on: a received tree's own message (its rows as
    they came), any other tree converted (``tree_to_proto``)."""
    if isinstance(tree, ReceivedTree) and tree.message is not None:
        return tree.message
    return tree_to_proto(tree)


def logprobs_to_proto(logprobs: Iterable[TokenLogprobs], out) -> None:
    """Append ``logprobs`` to ``out``, a repeated ``spin.v1.TokenLogprobs`` field."""
    for lp in logprobs:
        out.add(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                top_logprobs=[v for _, v in lp.top])


def logprobs_from_proto(msgs: Iterable[sampling_pb2.TokenLogprobs]) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs))) for m in msgs]
