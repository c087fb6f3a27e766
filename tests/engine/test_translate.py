"""Token translation between two real, different tokenizers (``engine/translate.py``): the demo
family's byte-level BPE, a byte-level BPE with other merges and a SentencePiece-style one
(Metaspace: a word's leading space is part of its token), the latter two trained here on a few
sentences; and the shuffled word-level tokenizers of ``real_sizes``."""

from __future__ import annotations

import pytest
from real_sizes import tokenizer as word_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spin.engine.translate import Translator

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "def parse(path):\n    return open(path).read()",
    "Speculative decoding drafts tokens and the target verifies them.",
    "Café au lait, naïve façade, 日本語のテキスト, an emoji 🙂 too.",
    "  two  spaces and\ttabs, then international internationalisation.",
]
"""Plain text, code, multi-byte characters (split across byte-level tokens) and runs of
spaces."""


def _byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _sentencepiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def toks(tokenizer) -> dict[str, PreTrainedTokenizerFast]:
    return {"demo": tokenizer, "bpe": _byte_bpe(), "sp": _sentencepiece()}


PAIRS = [("demo", "bpe"), ("demo", "sp"), ("bpe", "demo"), ("bpe", "sp"), ("sp", "demo")]
"""(target, draft)."""


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_tokenizers_differ(toks) -> None:
    text = SENTENCES[0]
    encodings = {name: tuple(_encode(t, text)) for name, t in toks.items()}
    assert len(set(encodings.values())) == 3
    assert toks["sp"].convert_ids_to_tokens(_encode(toks["sp"], " fox"))[0].startswith("▁")


@pytest.mark.parametrize("target,draft", PAIRS)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_context_is_a_fresh_encode(toks, target: str, draft: str, step: int) -> None:
    """Target tokens arriving ``step`` at a time give the draft tokens of the decoded text, and
    the drafter's (keep, delta) updates keep its copy equal to them."""
    t, d = toks[target], toks[draft]
    tr = Translator(t, d)
    redone = 0
    for text in SENTENCES:
        ids = _encode(t, text)
        ctx, held = tr.context(), []
        for i in range(0, len(ids), step):
            ctx.extend(ids[i:i + step])
            keep, delta = ctx.sync(len(held))
            redone += keep < len(held)
            held = held[:keep] + delta
            assert held == ctx.draft
            assert ctx.seen == min(i + step, len(ids))
        assert ctx.pending == [] and ctx.target_len == len(ids)
        assert ctx.draft == _encode(d, t.decode(ids)), text
    if step == 1:
        assert redone  # a word cut across target tokens is re-encoded whole


@pytest.mark.parametrize("target,draft", PAIRS)
def test_a_drafted_chain_round_trips(toks, target: str, draft: str) -> None:
    """After any prefix of a text's target tokens, the draft tokens of the rest translate to the
    target tokens of the rest (cut to k), also after a prefix that ends inside a character."""
    t, d = toks[target], toks[draft]
    tr = Translator(t, d)
    checked = mid_character = 0
    for text in SENTENCES:
        ids = _encode(t, text)
        fresh = _encode(d, text)
        for n in range(1, len(ids)):
            ctx = tr.context()
            ctx.extend(ids[:n])
            if fresh[:len(ctx.draft)] != ctx.draft:
                continue  # the draft tokenizer merges across this boundary: no aligned chain
            chain = fresh[len(ctx.draft):]
            if target == "sp" and n == 1 and text.startswith(" "):
                assert ctx.propose(chain, 100) in ([], ids[n:])  # the decoder drops the space
                continue
            assert ctx.propose(chain, 100) == ids[n:], (text, n)
            assert ctx.propose(chain, 3) == ids[n:n + 3]
            checked += 1
            mid_character += bool(ctx.pending)
    assert checked >= 30
    if target != "sp":  # byte-level targets split multi-byte characters
        assert mid_character > 0


def test_raw_tokenizers_translate_alike(toks) -> None:
    """A ``tokenizers.Tokenizer`` serves as well as the transformers tokenizer around it."""
    t, d = toks["demo"], toks["bpe"]
    ids = _encode(t, SENTENCES[3])
    wrapped, raw = Translator(t, d).context(), Translator(t.backend_tokenizer,
                                                          d.backend_tokenizer).context()
    for ctx in (wrapped, raw):
        for i in range(0, 20, 2):
            ctx.extend(ids[i:i + 2])
    assert raw.draft == wrapped.draft and raw.pending == wrapped.pending
    chain = _encode(d, " and more")
    assert raw.propose(chain, 5) == wrapped.propose(chain, 5) != []


def test_multibyte_characters_wait_for_their_last_byte(toks) -> None:
    t, d = toks["demo"], toks["sp"]
    ids = _encode(t, "日本")
    assert len(ids) > 2 and "\ufffd" in t.decode(ids[:1])  # the demo vocabulary splits them
    ctx = Translator(t, d).context()
    ctx.extend(ids[:1])
    assert ctx.draft == [] and ctx.pending == ids[:1]
    ctx.extend(ids[1:])
    assert ctx.pending == [] and d.decode(ctx.draft) == "日本"


def test_leading_spaces_follow_the_sentencepiece_convention(toks) -> None:
    """A SentencePiece target's word tokens carry their space: decoded alone they lose it, after
    the context they keep it, and a drafted ' word' comes back as its '▁word' token."""
    t, d = toks["sp"], toks["demo"]
    tr = Translator(t, d)
    ids = _encode(t, "The quick brown fox")
    ctx = tr.context()
    for tok in ids:
        ctx.extend([tok])
    assert d.decode(ctx.draft) == "The quick brown fox"
    out = ctx.propose(_encode(d, " jumps over"), 10)
    assert t.decode(ids + out) == "The quick brown fox jumps over"
    assert t.convert_ids_to_tokens(out)[0].startswith("▁")


def test_a_boundary_that_merges_proposes_nothing(toks) -> None:
    """The context ends with ' bro' and the draft goes on with 'wn fox': the target tokenizer
    writes ' brown' as one token, so no token sequence after the context is the target's own
    tokenization of the drafted text; nothing is proposed rather than something the target
    would not emit."""
    t, d = toks["demo"], toks["bpe"]
    vocab = t.get_vocab()
    word = next(w[1:] for w in sorted(vocab) if w.startswith("Ġ") and len(w) >= 6
                and w[1:].isalpha() and w[1:].islower() and "Ġ" + w[1:4] in vocab)
    ctx = Translator(t, d).context()
    ctx.extend(_encode(t, "The") + [vocab["Ġ" + word[:3]]])
    chain = _encode(d, word[3:] + " is")
    assert ctx.propose(chain, 10) == []
    # the same text after a context that ends at a word's end translates
    ctx = Translator(t, d).context()
    ctx.extend(_encode(t, "The"))
    assert t.decode(ctx.propose(_encode(d, " " + word + " is"), 10)) == " " + word + " is"


def test_end_of_text_and_k(toks) -> None:
    t, d = toks["demo"], toks["bpe"]
    ctx = Translator(t, d).context()
    ctx.extend(_encode(t, "The quick"))
    chain = _encode(d, " brown fox") + [d.eos_token_id] + _encode(d, " more")
    out = ctx.propose(chain, 20)
    assert out[-1] == t.eos_token_id and t.decode(out[:-1]) == " brown fox"
    assert ctx.propose(chain, 1) == out[:1]
    assert ctx.propose(chain, 0) == [] and ctx.propose([], 4) == []


def test_renumbered_words_translate_to_their_ids() -> None:
    """The word-level tokenizers of ``real_sizes`` (the same words under other ids): a drafted
    chain comes back as the target's ids of the same words."""
    target, shuffled = word_tokenizer(50), word_tokenizer(50, shuffle_seed=1)
    tr = Translator(target, shuffled)
    ids = [3, 17, 8, 42, 0, 5]
    ctx = tr.context()
    ctx.extend(ids[:2])
    ctx.extend(ids[2:3])
    assert ctx.draft == _encode(shuffled, target.decode(ids[:3])) != ids[:3]
    assert ctx.propose(_encode(shuffled, target.decode(ids[3:])), 4) == ids[3:]
