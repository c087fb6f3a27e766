"""Token translation: a draft model with another tokenizer drafts for the target through text.

A draft model whose tokenizer differs from the target's cannot read the target's token ids or
propose them. Like vLLM's heterogeneous-vocabulary mode and transformers' universal assisted
generation, the router keeps the request's context in the draft's tokens too, lets the draft
model draft a greedy chain of its own tokens, and re-tokenises the drafted text into the target's
tokens. The verifier checks those as one-hot drafts, exact for greedy and for sampling whatever
produced them (``rejection.py``), so translation only decides how good the drafts are: an
approximation here never changes the output.

``TranslatedContext`` is one request's state for one such drafter:

- ``extend`` takes in newly emitted target tokens. Only they are decoded, with a few tokens of
  left context (``decode(tail + new)`` minus ``decode(tail)``), so SentencePiece leading spaces
  and multi-byte characters come out right; tokens whose text ends in an incomplete UTF-8
  character wait for the next ones. The text is encoded with the draft tokenizer together with
  the context's last few draft tokens (re-encoded, so a word cut across steps is tokenised as a
  whole), so the work per step is O(new tokens), never the whole context.
- ``sync`` gives the drafter's ``(keep, delta)`` in draft tokens: how many tokens it holds that
  still hold, and what to append.
- ``propose`` turns a drafted chain into at most ``k`` target tokens. The chain's text is encoded
  with the target tokenizer after the context's last target tokens; when that encoding does not
  reproduce them (the drafted text merges with the context's end), it proposes nothing rather
  than tokens the target would tokenise differently. Target tokens held back for an unfinished
  character (the draft context stops before it) must begin the encoding and are cut from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"
"""What a decoder writes for the bytes of an unfinished UTF-8 character."""
MAX_HOLD = 4
"""Target tokens held back at most for an unfinished character (a character has <= 4 bytes)."""
TEXT_KEPT = 64
"""Draft tokens up to which a context keeps its whole text (a window re-encoded from the start
takes it from there, not from a decoder that may drop a leading space)."""


class Codec:
    """Exact encode/decode of one tokenizer: no special tokens added, none skipped, no clean-up
    of spaces. Takes a transformers tokenizer or a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer

        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(
            tokenizer, "backend_tokenizer", None)
        self.backend = backend
        self.slow = None if backend is not None else tokenizer
        if isinstance(tokenizer, Tokenizer):
            added = tokenizer.get_added_tokens_decoder()
            self.special = {i for i, t in added.items() if t.special}
            self.eos: int | None = None
        else:
            self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
            self.eos = getattr(tokenizer, "eos_token_id", None)

    def encode(self, text: str) -> list[int]:
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.slow.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.slow.decode(list(ids), skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)

    def text_after(self, context: Sequence[int], ids: Sequence[int]) -> str:
        """The text ``ids`` add after ``context``: ``decode(context + ids)`` minus
        ``decode(context)`` (``decode(ids)`` alone when the first does not extend the second)."""
        if not context:
            return self.decode(ids)
        head, full = self.decode(context), self.decode([*context, *ids])
        return full[len(head):] if full.startswith(head) else self.decode(ids)

    def encode_after(self, context: Sequence[int], text: str,
                     whole: bool = False) -> list[int] | None:
        """The tokens of ``text`` following ``context``: ``text`` is encoded after the context's
        text and the context's tokens stripped, with the whole context first, then (unless
        ``whole``) shorter ends of it (a context the model emitted need not be how its text
        encodes); an end that starts inside a character is skipped. None when no encoding starts
        with those tokens: the text merges with the context's end."""
        if not context:
            return self.encode(text)
        context = list(context)
        for n in range(len(context), 0, -1):
            head = self.decode(context[-n:])
            if head.startswith(INCOMPLETE):
                continue
            ids = self.encode(head + text)
            if ids[:n] == context[-n:]:
                return ids[n:]
            if whole:
                break
        return None


class Translator:
    """Translation between one target tokenizer and one draft tokenizer (shared by requests)."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any, tail: int = 4,
                 redo: int = 4) -> None:
        self.target = Codec(target_tokenizer)
        self.draft = Codec(draft_tokenizer)
        self.tail = tail
        """Tokens of left context decoded or encoded with new ones."""
        self.redo = redo
        """Last draft tokens of the context re-encoded with the new text."""

    def context(self) -> TranslatedContext:
        """A new request's state (empty: ``extend`` it with the prompt)."""
        return TranslatedContext(self)


class TranslatedContext:
    """One request's context in draft tokens, kept up to date with its target tokens."""

    def __init__(self, translator: Translator) -> None:
        self.tr = translator
        self.draft: list[int] = []
        """The context in draft tokens."""
        self.target_len = 0
        """Target tokens taken into ``draft``."""
        self.pending: list[int] = []
        """Target tokens after those, held back: their text ends in an unfinished character."""
        self.stable = 0
        """Leading tokens of ``draft`` unchanged since the last ``sync``."""
        self._text: str | None = ""
        """The draft context's text while it is short (``TEXT_KEPT`` tokens)."""
        self._target_tail: list[int] = []
        """The last target tokens taken in (left context for decoding and for ``propose``)."""

    @property
    def seen(self) -> int:
        """Target tokens given to ``extend`` so far (the next call takes the context from here)."""
        return self.target_len + len(self.pending)

    def extend(self, new: Sequence[int]) -> None:
        """Take in the target tokens after the first ``seen`` of the context."""
        tokens = self.pending + list(new)
        if not tokens:
            return
        t = self.tr.target
        take, text = len(tokens), t.text_after(self._target_tail, tokens)
        for n in range(len(tokens) - 1, max(len(tokens) - MAX_HOLD, 0) - 1, -1):
            if not text.endswith(INCOMPLETE):
                break
            take, text = n, t.text_after(self._target_tail, tokens[:n])
        if text.endswith(INCOMPLETE):  # not a character in the making: take it as it is
            take, text = len(tokens), t.text_after(self._target_tail, tokens)
        self.pending = tokens[take:]
        self.target_len += take
        self._target_tail = (self._target_tail + tokens[:take])[-self.tr.tail:]
        if text:
            self._append_text(text)

    def _append_text(self, text: str) -> None:
        """Append ``text`` to the draft context, re-encoding its last ``redo`` tokens with it
        (2 and 4 times as many when the tokens before them do not stay as they are)."""
        d, draft, tail = self.tr.draft, self.draft, self.tr.tail
        start, tokens = len(draft), None
        for redo in (self.tr.redo, 2 * self.tr.redo, 4 * self.tr.redo):
            anchor = max(0, len(draft) - redo)
            if anchor == 0:  # from the start, whose text is known (a decoder may drop a space)
                if self._text is not None:
                    start, tokens = 0, d.encode(self._text + text)
                break
            left = draft[max(0, anchor - tail):anchor]
            if d.decode(left).endswith(INCOMPLETE):
                continue  # the window would start inside a character
            tokens = d.encode_after(left, d.text_after(left, draft[anchor:]) + text, whole=True)
            if tokens is not None:
                start = anchor
                break
        if tokens is None:  # no stable edge found: keep the tokens, append the text's
            start, tokens = len(draft), d.encode_after(draft[-tail:], text)
            if tokens is None:
                tokens = d.encode(text)
        same = start
        for a, b in zip(draft[start:], tokens):
            if a != b:
                break
            same += 1
        self.stable = min(self.stable, same)
        del draft[start:]
        draft.extend(tokens)
        keep_text = self._text is not None and len(draft) <= TEXT_KEPT
        self._text = self._text + text if keep_text else None

    def sync(self, held: int) -> tuple[int, list[int]]:
        """``(keep, delta)`` for a drafter that holds ``held`` tokens of the draft context (0 =
        none): it keeps what is still the context's and appends the rest. Afterwards it holds the
        whole draft context."""
        keep = max(0, min(held, self.stable, len(self.draft)))
        self.stable = len(self.draft)
        return keep, self.draft[keep:]

    def propose(self, chain: Sequence[int], k: int) -> list[int]:
        """At most ``k`` target tokens for a drafted chain of draft tokens following the draft
        context; [] when nothing can be proposed safely (a boundary that merges differently, a
        drafted text that does not go on with the held-back target tokens, no text)."""
        if not chain or k <= 0:
            return []
        d = self.tr.draft
        cut = next((i for i, tok in enumerate(chain) if tok in d.special), len(chain))
        text = d.text_after(self.draft[-self.tr.tail:], chain[:cut])
        complete = not text.endswith(INCOMPLETE)
        text = text.rstrip(INCOMPLETE)
        out = self.tr.target.encode_after(self._target_tail, text) if text else []
        if out is None or out[:len(self.pending)] != self.pending:
            return []  # (the drafted text starts after the characters ``pending`` begins)
        out = out[len(self.pending):]
        eos = self.tr.target.eos
        if complete and cut < len(chain) and chain[cut] == d.eos and eos is not None:
            out.append(eos)  # the draft ends the text: so may the target
        return out[:k]
