import pytest
import torch

from spin.engine.tree import TokenTree


def test_chain_shape() -> None:
    t = TokenTree.chain([5, 6, 7])
    assert t.parents == (-1, 0, 1) and t.is_chain and t.depths() == [1, 2, 3]
    assert torch.equal(t.ancestor_mask(), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_tree_mask_sees_only_ancestors() -> None:
    #      root
    #     /    \
    #    0(a)   1(b)
    #    |  \     \
    #   2(c) 3(d)  4(e)
    t = TokenTree((1, 2, 3, 4, 5), (-1, -1, 0, 0, 1))
    assert not t.is_chain and t.depths() == [1, 1, 2, 2, 2]
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(4) == []
    m = t.ancestor_mask()
    assert m[2].tolist() == [True, False, True, False, False]
    assert m[4].tolist() == [False, True, False, False, True]
    assert m[3].tolist() == [True, False, False, True, False]


@pytest.mark.parametrize("tokens,parents", [((1, 2), (-1,)), ((1, 2), (-1, 1)), ((1,), (-2,))])
def test_malformed_trees_are_refused(tokens, parents) -> None:
    with pytest.raises(ValueError):
        TokenTree(tokens, parents)


def test_draft_probs_need_one_row_per_node() -> None:
    with pytest.raises(ValueError, match="rows"):
        TokenTree.chain([1, 2], torch.rand(3, 8))


def test_a_subtree_keeps_its_nodes_rows_and_runner_ups() -> None:
    probs = torch.eye(5)
    tree = TokenTree((1, 2, 3, 4, 0), (-1, 0, 0, 2, -1), probs, second=(9, 8, 7, 6, 5))
    sub = tree.subtree([0, 2, 3])
    assert sub.tokens == (1, 3, 4) and sub.parents == (-1, 0, 1)
    assert torch.equal(sub.draft_probs, probs[[0, 2, 3]]) and sub.second == (9, 7, 6)
    assert tree.subtree([]) == TokenTree((), ())
