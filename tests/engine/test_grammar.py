"""Grammars compiled once; a request's matcher cuts drafts where the grammar rejects them and
gives the allowed rows; emitted tokens advance it; forced tokens are what it allows alone."""

import json

import pytest
import torch

from spin.engine.grammar import (MAX_GRAMMAR_CHARS, GrammarCompiler, GrammarError,
                                 GrammarSpec)
from spin.engine.token_mask import allows, unpack
from spin.engine.tree import TokenTree

SCHEMA = {"type": "object", "properties": {"role": {"enum": ["admin", "guest"]},
                                           "age": {"type": "integer"}},
          "required": ["role", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("json_schema", "{"), "not JSON"),
    (GrammarSpec("json_schema", '{"type": "bogus"}'), "bogus"),
    (GrammarSpec("json_schema", "[1, 2]"), "is an object"),
    (GrammarSpec("regex", "(("), "regex"),
    (GrammarSpec("lark", "start: missing_rule"), "missing_rule"),
    (GrammarSpec("json_schema", ""), "needs its source"),
    (GrammarSpec("xml", "<a/>"), "kind must be one of"),  # type: ignore[arg-type]
    (GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1)), "at most"),
])
def test_a_grammar_that_cannot_compile_says_why(compiler, spec, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        compiler.compile(spec)


def test_each_grammar_is_compiled_once(compiler) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(GrammarSpec("json_schema",
                                                                   json.dumps(SCHEMA)))
    a, b = compiler.constraint(spec), compiler.constraint(spec)
    assert a.matcher is not b.matcher


def test_a_draft_is_cut_at_the_first_token_the_grammar_rejects(compiler, tokenizer) -> None:
    c = compiler.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    good = ids(tokenizer, '{"role":"admin","age":7}')
    before = c.allowed()
    kept, rows = c.restrict(TokenTree.chain(good))
    assert kept == list(range(len(good))) and rows.shape == (len(good) + 1, c.words)
    assert all(allows(rows, i, t) for i, t in enumerate(good))
    bad = ids(tokenizer, '{"role":"root"}')
    n_ok = next(i for i, t in enumerate(bad) if not allows(c.restrict(
        TokenTree.chain(bad[:i + 1]))[1], i, t))
    kept, rows = c.restrict(TokenTree.chain(bad))
    assert kept == list(range(n_ok)) and rows.shape[0] == n_ok + 1
    assert torch.equal(c.allowed(), before)  # the walk leaves the matcher where it was


def test_a_tree_keeps_the_allowed_branches(compiler, tokenizer) -> None:
    c = compiler.constraint(GrammarSpec("regex", "(cat|dog)s?"))
    cat, dog, bird = (ids(tokenizer, w) for w in ("cat", "dog", "bird"))
    first = [cat[0], bird[0], dog[0]]
    tree = TokenTree(tuple(first), (-1, -1, -1))
    kept, rows = c.restrict(tree)
    assert [tree.tokens[i] for i in kept] == [t for t in first if t != bird[0]]
    cut = tree.subtree(kept)
    assert cut.parents == (-1,) * len(kept) and rows.shape[0] == len(kept) + 1


def test_emitted_tokens_advance_until_the_grammar_is_complete(compiler, tokenizer) -> None:
    c = compiler.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    out = ids(tokenizer, '{"role":"guest","age":42}')
    assert c.advance(out[:-1]) == len(out) - 1 and not c.done
    assert c.advance(out[-1:]) == 1 and c.done
    eos = tokenizer.eos_token_id
    assert unpack(c.allowed(), len(tokenizer))[0].nonzero().flatten().tolist() == [eos]
    assert c.advance([eos]) == 0  # complete: nothing more is taken


def test_forced_tokens_are_the_one_continuation(compiler, tokenizer) -> None:
    c = compiler.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert tokenizer.decode(c.forced(64)) == '{"role":"'
    assert len(c.forced(2)) == 2
    c.advance(ids(tokenizer, '{"role":"ad'))
    assert tokenizer.decode(c.forced(64)) == 'min","age":'
    free = compiler.constraint(GrammarSpec("regex", "[a-z]+"))
    assert free.forced(8) == []


def test_only_names_the_one_allowed_token(compiler, tokenizer) -> None:
    c = compiler.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    taken = []
    while (tok := c.only()) is not None:
        assert unpack(c.allowed(), len(tokenizer))[0].nonzero().flatten().tolist() == [tok]
        c.advance([tok])
        taken.append(tok)
    assert tokenizer.decode(taken) == '{"role":"'  # then admin or guest: a choice
    c.advance(ids(tokenizer, 'guest","age":4}'))
    assert c.done and c.only() is None
