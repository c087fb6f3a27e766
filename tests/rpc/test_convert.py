"""Engine types <-> spin.v1 messages: sampling parameters and token trees, both directions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.rpc.convert import sampling_from_proto, sampling_to_proto, tree_from_proto, tree_to_proto
from spin.v1 import sampling_pb2, token_tree_pb2

V = 16  # a small vocabulary for hand-built trees


# --- sampling parameters -------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.25, top_p=0.75, top_k=40, seed=7),
    SamplingParams(temperature=2.0, top_k=3, seed=0),        # seed 0 is a seed, not "unset"
    SamplingParams(temperature=0.5, seed=-3),
])
def test_sampling_round_trip(params: SamplingParams) -> None:
    """Values exactly representable in float32 come back identical."""
    back = sampling_from_proto(sampling_to_proto(params))
    assert back == params
    assert back.seed == params.seed and back.top_p == params.top_p


def test_sampling_round_trip_is_float32_close() -> None:
    """The wire carries float32: a decimal temperature survives to float32 precision."""
    back = sampling_from_proto(sampling_to_proto(SamplingParams(temperature=0.7, top_p=0.9)))
    assert back.temperature == pytest.approx(0.7, rel=1e-6)
    assert back.top_p == pytest.approx(0.9, rel=1e-6)


def test_sampling_to_proto_leaves_defaults_unset() -> None:
    msg = sampling_to_proto(SamplingParams(temperature=0.5))
    assert not msg.HasField("top_p") and not msg.HasField("seed")
    msg = sampling_to_proto(SamplingParams(temperature=0.5, top_p=0.5, seed=0))
    assert msg.HasField("top_p") and msg.top_p == 0.5
    assert msg.HasField("seed") and msg.seed == 0


def test_sampling_from_proto_defaults() -> None:
    """Unset top_p is 1.0 (off), unset seed is None; an explicit top_p of 1 is also off."""
    p = sampling_from_proto(sampling_pb2.SamplingParams())
    assert p == SamplingParams() and p.top_p == 1.0 and p.seed is None and p.greedy
    p = sampling_from_proto(sampling_pb2.SamplingParams(temperature=1.0, top_p=1.0))
    assert p.top_p == 1.0 and p.seed is None
    p = sampling_from_proto(sampling_pb2.SamplingParams(temperature=1.0, seed=123))
    assert p.seed == 123 and p.top_p == 1.0


@pytest.mark.parametrize("msg", [
    sampling_pb2.SamplingParams(temperature=-0.5),
    sampling_pb2.SamplingParams(temperature=float("nan")),
    sampling_pb2.SamplingParams(temperature=1.0, top_p=0.0),
    sampling_pb2.SamplingParams(temperature=1.0, top_p=1.5),
    sampling_pb2.SamplingParams(temperature=1.0, top_p=-0.1),
    sampling_pb2.SamplingParams(temperature=1.0, top_k=-1),
])
def test_sampling_from_proto_rejects_out_of_range(msg: sampling_pb2.SamplingParams) -> None:
    with pytest.raises(ValueError):
        sampling_from_proto(msg)


# --- token trees ---------------------------------------------------------------------------------

def _round_trip(tree: TokenTree, vocab: int = V) -> TokenTree:
    return tree_from_proto(tree_to_proto(tree), vocab)


@pytest.mark.parametrize("tree", [
    TokenTree((), ()),
    TokenTree.chain([3]),
    TokenTree.chain([5, 1, 9, 0]),
    TokenTree((4, 7, 2, 2, 15), (-1, -1, 0, 1, 2)),
    TokenTree((1, 2, 3, 4), (-1, 0, 0, -1)),
])
def test_tree_round_trip_without_probs(tree: TokenTree) -> None:
    msg = tree_to_proto(tree)
    assert list(msg.tokens) == list(tree.tokens) and list(msg.parents) == list(tree.parents)
    assert len(msg.probs) == 0
    back = _round_trip(tree)
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.draft_probs is None
    assert back.is_chain == tree.is_chain


def _topk_row(k: int, seed: int, vocab: int = V) -> torch.Tensor:
    """A normalised [vocab] row with exactly k nonzero entries."""
    g = torch.Generator().manual_seed(seed)
    row = torch.zeros(vocab)
    ids = torch.randperm(vocab, generator=g)[:k]
    row[ids] = torch.rand(k, generator=g) + 0.1
    return row / row.sum()


def _full_row(seed: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g), -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp16 values as their bit patterns (equality bit for bit)."""
    assert t.dtype == torch.float16
    return t.view(torch.int16)


def _f16(values) -> bytes:
    return np.asarray(values, dtype="<f2").tobytes()


def test_chain_probs_sparse_and_dense_round_trip_bit_for_bit() -> None:
    """A top-k'd row travels sparse (only its nonzero entries), a full row dense; both as
    little-endian fp16 bytes, and come back as the same fp16 values."""
    probs = torch.stack([_topk_row(3, 0), _full_row(1), _topk_row(1, 2)]).half()
    tree = TokenTree.chain([int(probs[i].argmax()) for i in range(3)], probs)
    msg = tree_to_proto(tree)
    assert len(msg.probs) == 3
    sparse, dense, one = msg.probs
    assert len(sparse.dense_f16) == 0 and len(sparse.token_ids) == 3
    assert len(sparse.token_probs_f16) == 2 * 3
    assert list(sparse.token_ids) == probs[0].nonzero().flatten().tolist()  # ascending
    assert sparse.token_probs_f16 == _f16(probs[0][probs[0] > 0].numpy())
    assert dense.dense_f16 == _f16(probs[1].numpy()) and len(dense.dense_f16) == 2 * V
    assert len(dense.token_ids) == 0 and len(dense.token_probs_f16) == 0
    assert list(one.token_ids) == [int(probs[2].argmax())] and one.token_probs_f16 == _f16([1.0])
    back = tree_from_proto(msg, V)
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.draft_probs is not None and back.draft_probs.shape == (3, V)
    assert back.draft_probs.dtype == torch.float16
    assert torch.equal(_bits(back.draft_probs), _bits(probs))


def test_tree_probs_round_trip() -> None:
    """A branching tree with a mix of sparse and dense rows comes back equal, bit for bit;
    fp32 rows travel as their fp16 rounding."""
    rows = [_full_row(10), _full_row(10), _topk_row(2, 11), _topk_row(5, 12), _full_row(13)]
    probs = torch.stack(rows)
    tree = TokenTree((1, 2, 3, 4, 5), (-1, -1, 0, 1, 2), probs)
    msg = tree_to_proto(tree)
    assert [len(r.dense_f16) > 0 for r in msg.probs] == [True, True, False, False, True]
    back = tree_from_proto(msg, V)
    assert back == tree  # tokens and parents (draft_probs is excluded from equality)
    assert torch.equal(_bits(back.draft_probs), _bits(probs.half()))


def test_half_full_row_goes_dense_and_low_precision_converts() -> None:
    """Exactly half the vocabulary nonzero is not smaller sparse; bfloat16 rows ship as fp16."""
    row = torch.zeros(V)
    row[: V // 2] = 1.0 / (V // 2)
    tree = TokenTree.chain([0], row[None].to(torch.bfloat16))
    msg = tree_to_proto(tree)
    assert len(msg.probs[0].dense_f16) == 2 * V
    back = tree_from_proto(msg, V)
    assert torch.equal(_bits(back.draft_probs), _bits(row[None].half()))


def test_rows_of_a_smaller_draft_vocabulary_are_zero_padded() -> None:
    """A draft whose vocabulary has fewer ids than the target's rows: dense or sparse, its rows
    come back [N, V] with zeros past its ids."""
    small = V - 5
    probs = torch.stack([_full_row(20, small), _topk_row(2, 21, small)]).half()
    msg = tree_to_proto(TokenTree.chain([0, 1], probs))
    assert len(msg.probs[0].dense_f16) == 2 * small and len(msg.probs[1].token_ids) == 2
    back = tree_from_proto(msg, V)
    assert back.draft_probs.shape == (2, V)
    assert torch.equal(_bits(back.draft_probs[:, :small]), _bits(probs))
    assert not bool(back.draft_probs[:, small:].any())


def test_tree_from_proto_builds_on_device() -> None:
    tree = TokenTree.chain([1], _full_row(3)[None])
    back = tree_from_proto(tree_to_proto(tree), V, device="cpu")
    assert back.draft_probs.device.type == "cpu" and back.draft_probs.dtype == torch.float16


def _msg(tokens: list[int], parents: list[int]) -> token_tree_pb2.TokenTree:
    return token_tree_pb2.TokenTree(tokens=tokens, parents=parents)


def test_wrong_number_of_prob_rows_raises() -> None:
    msg = _msg([1, 2], [-1, 0])
    msg.probs.add(dense_f16=_f16(_full_row(0).numpy()))
    with pytest.raises(ValueError, match="probability rows"):
        tree_from_proto(msg, V)
    msg.probs.add(dense_f16=_f16(_full_row(1).numpy()))
    msg.probs.add(dense_f16=_f16(_full_row(2).numpy()))
    with pytest.raises(ValueError, match="probability rows"):
        tree_from_proto(msg, V)


def test_dense_row_longer_than_the_vocabulary_raises() -> None:
    msg = _msg([1], [-1])
    msg.probs.add(dense_f16=_f16([1.0 / (V + 1)] * (V + 1)))
    with pytest.raises(ValueError, match="dense row"):
        tree_from_proto(msg, V)
    msg = _msg([1], [-1])
    msg.probs.add(dense_f16=_f16([1.0 / (V - 1)] * (V - 1)))  # shorter: zero-padded
    assert tree_from_proto(msg, V).draft_probs[0, V - 1] == 0


ONE, INF, NAN, NEG = b"\x00\x3c", b"\x00\x7c", b"\x00\x7e", b"\x00\xbc"  # 1.0, inf, nan, -1.0


@pytest.mark.parametrize(("dense", "ids", "values", "match"), [
    (ONE + b"\x00", None, None, "whole number of fp16"),
    (None, [1, 2], ONE + ONE[:1], "whole number of fp16"),
    (ONE + INF, None, None, "finite"),
    (NAN + ONE, None, None, "finite"),
    (None, [3], INF, "finite"),
    (ONE + NEG, None, None, ">= 0"),
    (None, [1, 2], ONE + NEG, ">= 0"),
    (b"\x00\x00" * V, None, None, "no mass"),
    (None, [4], b"\x00\x00", "no mass"),
    (None, [], b"", "no mass"),
], ids=["odd-dense", "odd-sparse", "inf-dense", "nan-dense", "inf-sparse", "negative-dense",
        "negative-sparse", "zero-dense", "zero-sparse", "empty-row"])
def test_malformed_rows_raise(dense: bytes | None, ids: list[int] | None,
                              values: bytes | None, match: str) -> None:
    msg = _msg([1], [-1])
    if dense is not None:
        msg.probs.add(dense_f16=dense)
    else:
        msg.probs.add(token_ids=ids, token_probs_f16=values)
    with pytest.raises(ValueError, match=match):
        tree_from_proto(msg, V)


@pytest.mark.parametrize("ids", [[V], [-1], [0, V + 5]])
def test_sparse_row_outside_vocab_raises(ids: list[int]) -> None:
    msg = _msg([1], [-1])
    msg.probs.add(token_ids=ids, token_probs_f16=_f16([1.0 / len(ids)] * len(ids)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tree_from_proto(msg, V)


@pytest.mark.parametrize("tokens", [[V], [-1], [0, 1, V + 100]])
def test_tree_token_outside_vocab_raises(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tree_from_proto(_msg(tokens, list(range(-1, len(tokens) - 1))), V)
    assert tree_from_proto(_msg([V - 1], [-1]), V).tokens == (V - 1,)  # the last id is fine


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 3]])
def test_parent_not_preceding_child_raises(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parents must precede"):
        tree_from_proto(_msg(list(range(len(parents))), parents), V)


def test_tokens_parents_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="parents"):
        tree_from_proto(_msg([1, 2], [-1]), V)


@pytest.mark.parametrize(("ids", "probs"), [([1, 2], [0.5]), ([], [0.5]), ([1, 2, 3], [0.5, 0.5])],
                         ids=["broadcast", "probs-without-ids", "runtime-error"])
def test_sparse_row_length_mismatch_raises_value_error(ids: list[int], probs: list[float]) -> None:
    msg = _msg([1], [-1])
    msg.probs.add(token_ids=ids, token_probs_f16=_f16(probs))
    with pytest.raises(ValueError):
        tree_from_proto(msg, V)
