"""TextStream: incremental detokenization with stop strings, on the demo tokenizer (byte-level
BPE: a multi-byte character may be split over tokens)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from spin.engine.sampling import SamplingParams
from spin.router.requests import (DrafterTally, RequestParams, RequestStatus, RouterRequest,
                                  TextStream)
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


class WholeDecode:
    """The reference: every push decodes the whole output and searches it all for stop strings
    (what ``TextStream`` did before it was incremental: O(n) per push)."""

    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def push(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        text = self.decode(tokens)
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:
            at = min(hits)
            delta = text[self.sent:at] if at > self.sent else ""
            self.sent = max(self.sent, at)
            return delta, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            end = max(self.sent, end - self.hold)
        delta = text[self.sent:end]
        self.sent = end
        return delta, False


@pytest.fixture(scope="module")
def long_ids(tok) -> list[int]:
    """About 4500 tokens of held-out code, prose and structured text, and multi-byte text."""
    rows = heldout_prompts(FAMILY_DIR)[:40]
    text = "".join(r["prompt"] + ("\n" + MULTIBYTE if i % 7 == 0 else "") for i, r in
                   enumerate(rows))
    return _ids(tok, text + "\n∑ 🙂 日本語テキスト ok")


def _cuts(n: int, seed: int, most: int = 5) -> list[int]:
    """Push boundaries: 1..``most`` tokens at a time (a verification step's tokens), up to n."""
    rng, cuts, at = random.Random(seed), [], 0
    while at < n:
        at = min(n, at + rng.randint(1, most))
        cuts.append(at)
    return cuts


@pytest.mark.parametrize("seed", range(4))
def test_same_pushes_as_decoding_the_whole_output(decode, long_ids, seed: int) -> None:
    """Push by push, the incremental stream sends what decoding the whole output each time
    sends: the same text, the same stop hit at the same push."""
    rng = random.Random(seed)
    ids = long_ids[:rng.randint(300, len(long_ids))]
    full = decode(ids)
    picks = [rng.randrange(len(full) // 2, len(full) - 8) for _ in range(2)]
    stop = tuple(full[i:i + rng.randint(1, 6)] for i in picks) + ("NOT THERE",)
    mine, ref = TextStream(decode, stop), WholeDecode(decode, stop)
    cuts = _cuts(len(ids), seed)
    for n, cut in enumerate(cuts):
        final = n == len(cuts) - 1
        got = mine.push(ids[:cut], final)
        assert got == ref.push(ids[:cut], final), f"push {n} ({cut} tokens)"
        if got[1]:
            break
    assert got[1]  # the stop strings were taken from the text


@pytest.mark.parametrize("most", [1, 4])
def test_text_over_many_steps_is_the_decode_up_to_the_stop(decode, long_ids, most: int) -> None:
    full = decode(long_ids)
    stop = "ok"  # the very end: everything before it is sent, and nothing of it
    assert full.endswith(stop) and full.find(stop) == len(full) - 2
    s, sent, hit = TextStream(decode, (stop, "\n\n\n\n\n")), "", False
    for cut in _cuts(len(long_ids), 0, most):
        delta, hit = s.push(long_ids[:cut], final=cut == len(long_ids))
        assert "\ufffd" not in delta
        sent += delta
    assert hit and sent == full[:full.find(stop)]
    without = TextStream(decode, ())
    text = "".join(without.push(long_ids[:c], final=c == len(long_ids))[0]
                   for c in _cuts(len(long_ids), 1, most))
    assert text == full


@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_characters_split_over_tokens(tok, decode, step: int) -> None:
    text = "∑ 🙂 日本語テキスト ok"
    ids = _ids(tok, text)
    split = [n for n in range(1, len(ids)) if decode(ids[:n]).endswith("\ufffd")]
    assert len(split) >= 10  # byte-level BPE cuts these characters between tokens
    deltas, _ = _stream(decode, ids, step=step)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    deltas, hits = _stream(decode, ids, stop=("語テ",), step=step)
    assert "".join(deltas) == "∑ 🙂 日本" and any(hits)


def test_stop_string_spanning_steps(tok, decode) -> None:
    """A stop string whose characters arrive over several pushes (steps) is still caught, and
    none of it is ever sent."""
    ids = _ids(tok, "alpha beta gamma delta")
    stop = "ta gam"
    first = next(n for n in range(1, len(ids) + 1) if stop in decode(ids[:n]))
    starts = next(n for n in range(1, len(ids) + 1) if "ta" in decode(ids[:n]))
    assert starts < first  # it begins one push and ends in a later one
    deltas, hits = _stream(decode, ids, stop=(stop,), step=1)
    assert "".join(deltas) == "alpha be" and hits.index(True) == first - 1


def test_stop_string_at_the_very_start_of_a_multi_token_push(tok, decode) -> None:
    ids = _ids(tok, "STOP here and more")
    s = TextStream(decode, ("STOP",))
    assert s.push(ids[:1], final=False) == ("", False)  # "ST..." could be the stop
    assert s.push(ids, final=True) == ("", True)
    assert s.push(ids, final=True) == ("", True)  # nothing after a stop, ever


def test_work_per_push_does_not_grow_with_the_output(tok, long_ids) -> None:
    """Each push decodes a window of the latest tokens: the tokens decoded per push are bounded
    by the push sizes, not by the output's length (decoding the whole output is O(n) per push,
    O(n^2) per request)."""
    decoded: list[int] = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tok.decode(ids, skip_special_tokens=True)

    s = TextStream(counting, ("NEVER", "\n\n\n\n\n"))
    per_push: list[tuple[int, int]] = []  # (decode calls, tokens decoded)
    for cut in _cuts(len(long_ids), 2, most=4):
        before = (len(decoded), sum(decoded))
        s.push(long_ids[:cut], final=cut == len(long_ids))
        per_push.append((len(decoded) - before[0], sum(decoded) - before[1]))
    assert len(long_ids) > 4000 and len(per_push) > 1000
    assert max(calls for calls, _ in per_push) <= 2
    assert max(n for _, n in per_push) <= 24  # the last two pushes (<= 8) and a few pending
    first, last = per_push[:300], per_push[-300:]
    assert sum(n for _, n in last) <= 1.2 * sum(n for _, n in first)
    assert sum(decoded) <= 4 * len(long_ids)


def test_router_request_bookkeeping() -> None:
    r = RouterRequest(RequestParams("r1", prompt=(1, 2, 3), max_tokens=8,
                                    sampling=SamplingParams()))
    assert r.status is RequestStatus.WAITING and not r.finished
    r.generated.extend([4, 5])
    r.tally.drafters["a"] = DrafterTally(steps=2, draft_tokens=6, accepted_tokens=3)
    r.tally.drafters["b"] = DrafterTally(steps=1, draft_tokens=2, accepted_tokens=2)
    assert r.context == [1, 2, 3, 4, 5] and r.context_len == 5 and r.remaining == 6
    assert r.tally.draft_tokens == 8 and r.tally.accepted_tokens == 5
