"""TextStream: incremental detokenization with stop strings, on the demo tokenizer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from spin.engine.sampling import SamplingParams
from spin.router.requests import DrafterTally, RouterRequest, TextStream
from spin.zoo.corpus import heldout_prompts
from spin.zoo.specs import FAMILY_DIR

MULTIBYTE = "été — naïve ✓\nline two\n\tx = 1"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(FAMILY_DIR / "target")


@pytest.fixture(scope="module")
def decode(tok: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(decode, ids: list[int], stop: tuple[str, ...] = (), step: int = 1,
            final: bool = True) -> tuple[list[str], list[bool]]:
    """Push ``ids`` ``step`` tokens at a time (the last push final); the deltas and hit flags."""
    s = TextStream(decode, stop)
    deltas, hits = [], []
    cuts = list(range(step, len(ids), step)) + [len(ids)]
    for n, cut in enumerate(cuts):
        delta, hit = s.push(ids[:cut], final=final and n == len(cuts) - 1)
        deltas.append(delta)
        hits.append(hit)
    return deltas, hits


def _texts() -> list[str]:
    code = [r["prompt"][:300] for r in heldout_prompts(FAMILY_DIR, ("code",))[:3]]
    return [MULTIBYTE, "hello world\n\n  indented\r\nend", "∑ 🙂 日本語テキスト ok"] + code


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text_index", range(6))
def test_pushes_reproduce_full_decode(tok, decode, text_index: int, step: int) -> None:
    """Concatenated deltas equal the full decode; no replacement character leaks mid-sequence."""
    text = _texts()[text_index]
    ids = _ids(tok, text)
    deltas, hits = _stream(decode, ids, step=step)
    assert "".join(deltas) == decode(ids) == text
    assert not any(hits)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_held_until_complete(tok, decode) -> None:
    """A token ending inside a UTF-8 sequence emits nothing of it until the sequence completes."""
    ids = _ids(tok, MULTIBYTE)
    s = TextStream(decode, ())
    sent = ""
    for n in range(1, len(ids) + 1):
        delta, hit = s.push(ids[:n], final=n == len(ids))
        sent += delta
        full = decode(ids[:n])
        assert not hit
        assert sent == full.rstrip("\ufffd")  # without stop strings nothing else is held back
    assert sent == MULTIBYTE


def test_eos_is_skipped(tok, decode) -> None:
    ids = _ids(tok, "done.") + [tok.eos_token_id]
    deltas, hits = _stream(decode, ids)
    assert "".join(deltas) == "done." and deltas[-1] == "" and not any(hits)


def test_stop_that_never_matches_changes_nothing(tok, decode) -> None:
    ids = _ids(tok, MULTIBYTE)
    deltas, hits = _stream(decode, ids, stop=("ZZZ", "\n\n\n"))
    assert "".join(deltas) == MULTIBYTE and not any(hits)


def test_stop_string_cuts_text_and_hits_at_the_right_push(tok, decode) -> None:
    ids = _ids(tok, "abc END def")
    texts = [decode(ids[:n]) for n in range(1, len(ids) + 1)]
    first = next(i for i, t in enumerate(texts) if "END" in t)
    deltas, hits = _stream(decode, ids, stop=("END",))
    assert hits == [False] * first + [True] * (len(ids) - first)
    assert "".join(deltas[:first + 1]) == "abc "
    assert all(d == "" for d in deltas[first + 1:])  # nothing after the stop, even when final
    assert "E" not in "".join(deltas)


def test_stop_spanning_tokens(tok, decode) -> None:
    ids = _ids(tok, "say hello world")
    deltas, hits = _stream(decode, ids, stop=("lo w",))
    assert "".join(deltas) == "say hel"
    first = hits.index(True)
    assert "lo w" in decode(ids[:first + 1]) and "lo w" not in decode(ids[:first])


def test_stop_at_start_emits_nothing(tok, decode) -> None:
    ids = _ids(tok, "END of story")
    deltas, hits = _stream(decode, ids, stop=("END",))
    assert "".join(deltas) == "" and hits[0]


def test_multibyte_stop_string(tok, decode) -> None:
    ids = _ids(tok, MULTIBYTE)
    deltas, hits = _stream(decode, ids, stop=("✓",))
    assert "".join(deltas) == "été — naïve "
    assert any(hits) and not any("\ufffd" in d for d in deltas)


def test_stop_found_in_a_multi_token_push(tok, decode) -> None:
    """A verify step emits several tokens at once: the stop may arrive inside one push."""
    ids = _ids(tok, "abc END def")
    delta, hit = TextStream(decode, ("END",)).push(ids, final=False)
    assert (delta, hit) == ("abc ", True)
    delta, hit = TextStream(decode, ("END",)).push(ids, final=True)
    assert (delta, hit) == ("abc ", True)


def test_possible_stop_prefix_is_held_back_then_released(tok, decode) -> None:
    """Text ending in 'EN' could start 'END': it waits, and goes out once it cannot."""
    ids = _ids(tok, "xxENxx")
    assert [decode(ids[:n]) for n in range(1, 4)] == ["xx", "xxEN", "xxENxx"]
    s = TextStream(decode, ("END",))
    assert s.push(ids[:1], final=False) == ("", False)      # the last len("END") - 1 chars wait
    delta, hit = s.push(ids[:2], final=False)
    assert not hit and "EN" not in delta and delta == "xx"
    delta, hit = s.push(ids[:3], final=False)
    assert not hit and delta == "EN"                          # disambiguated: not the stop
    assert s.push(ids[:3], final=True) == ("xx", False)       # the held tail at the end


def test_held_prefix_that_becomes_the_stop_is_never_sent(tok, decode) -> None:
    ids = _ids(tok, "xxEN") + _ids(tok, "D")
    assert decode(ids) == "xxEND"
    s = TextStream(decode, ("END",))
    sent = ""
    for n in range(1, len(ids) + 1):
        delta, hit = s.push(ids[:n], final=n == len(ids))
        sent += delta
    assert sent == "xx" and hit


def test_final_flushes_held_text(tok, decode) -> None:
    ids = _ids(tok, "xxEN")
    s = TextStream(decode, ("END", "STOP"))
    assert s.push(ids, final=False) == ("x", False)  # 3 chars held for a 4-char stop string
    assert s.push(ids, final=True) == ("xEN", False)


def test_earliest_of_several_stop_strings_wins(tok, decode) -> None:
    ids = _ids(tok, "say hello world")
    delta, hit = TextStream(decode, ("world", "hello")).push(ids, final=False)
    assert hit and delta == "say "


def test_router_request_bookkeeping() -> None:
    r = RouterRequest("r1", prompt=(1, 2, 3), max_tokens=8, sampling=SamplingParams())
    r.generated.extend([4, 5])
    r.tallies["a"] = DrafterTally(steps=2, draft_tokens=6, accepted_tokens=3)
    r.tallies["b"] = DrafterTally(steps=1, draft_tokens=2, accepted_tokens=2)
    assert r.context == [1, 2, 3, 4, 5] and r.context_len == 5
    assert r.draft_tokens == 8 and r.accepted_tokens == 5
