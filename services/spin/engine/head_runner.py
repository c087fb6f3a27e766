"""Draft heads served inside the verifier: each head's paged KV, the target's features, drafting.

The verify step already computes what an EAGLE head needs (``eagle.py``): the target's states at
every position it feeds. ``FeatureLog`` keeps, per request, the fused-layer states of the last
``window`` committed positions (a request that has not asked for a head yet keeps only those).
When the router asks a head to draft for a request (``HeadAsk``), right after the step's
verdict ``HeadRunner.draft`` brings the head's cache up to the request's committed context from
the log (one ragged forward for every request of the step), then drafts a chain of ``k`` tokens
(one batched single-token forward per level). The draft waits in the runner; the next step the
router sends its tokens back as the tree (``HeadAsk.stored``) and the verifier verifies them
with the distributions they were drawn from, so they never cross the wire.

A head's cache holds position p when it has fed the pair (target state at p, token p + 1); its
committed length equals the target's committed cache length. A request whose log no longer
reaches back to the head's last position restarts the head's cache where the log starts: its
history is cut, its positions shift (rotary attention depends only on differences), and the
output stays exact: a draft only changes what is accepted, never what is emitted.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import Iota, ragged_layout, sdpa
from .eagle import EagleHead
from .kv_cache import CacheFull, KVCache
from .sampling import SamplingParams, probs_from_logits


@dataclass(frozen=True)
class HeadAsk:
    """What a verification task asks of a head (``VerifyRequest.head``)."""

    name: str
    """The head."""
    k: int = 0
    """Tokens to draft right after this step's verdict (0: none)."""
    stored: int = 0
    """This step's tree is the first ``stored`` tokens of the head's previous draft."""


@dataclass(frozen=True)
class HeadDraft:
    """A head's draft for a request's next step."""

    context_len: int
    """The request's context length it was drafted at (it holds while that is unchanged)."""
    tokens: tuple[int, ...]
    """The drafted chain."""
    probs: torch.Tensor | None
    """[k, V] the distribution each token was drawn from (sampling), or None (greedy)."""


class InVerifierDrafter(abc.ABC):
    """A drafter inside the verifier: a draft head (``HeadRunner``) or a colocated draft model
    (``colocated.ColocatedDrafter``). Its last draft per request waits here for the next step."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.drafts: dict[str, HeadDraft] = {}
        """Request id -> its last draft."""

    def stored(self, request_id: str, context_len: int) -> HeadDraft | None:
        """The request's last draft, if drafted at this context length."""
        d = self.drafts.get(request_id)
        return d if d is not None and d.context_len == context_len else None

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the request (idempotent)."""

    @abc.abstractmethod
    def rollback(self, request_id: str, valid: int) -> None:
        """The request's context holds only its first ``valid`` tokens."""

    @abc.abstractmethod
    def draft(self, tasks: list[DraftTask], log: FeatureLog) -> dict[str, HeadDraft]:
        """Each task's chain for its next step, after this step's verdict."""


@dataclass
class _Log:
    first: int
    """Context position of the first row."""
    chunks: list[torch.Tensor]
    """The steps' rows [n_i, F], in order."""
    rows: int = 0
    """Rows held (the chunks' total)."""


class FeatureLog:
    """Per request, the target's fused-layer states of its last ``window`` committed positions
    or a few more (kept as the steps' chunks, dropped whole: a step adds its rows without
    copying the others; at most twice ``window``)."""

    def __init__(self, window: int) -> None:
        self.window = window
        """Positions kept per request (memory: ``window`` x 3 x the target's width)."""
        self._logs: dict[str, _Log] = {}

    def record(self, request_id: str, start: int, states: torch.Tensor) -> None:
        """States [n, F] of positions ``start`` .. ``start + n - 1`` (a later record at an
        earlier position replaces what follows it)."""
        if len(states) > self.window:  # a prefill: its last window positions alone
            start, states = start + len(states) - self.window, states[-self.window:]
            self._logs.pop(request_id, None)
        log = self._logs.get(request_id)
        if log is None or not log.first <= start <= log.first + log.rows:
            log = self._logs[request_id] = _Log(start, [])
        self._cut(log, start - log.first)
        log.chunks.append(states)
        log.rows += len(states)
        while len(log.chunks) > 1 and log.rows - len(log.chunks[0]) >= self.window:
            n = len(log.chunks.pop(0))
            log.first, log.rows = log.first + n, log.rows - n

    @staticmethod
    def _cut(log: _Log, rows: int) -> None:
        """Keep the first ``rows`` rows (usually all: then nothing is done)."""
        while log.chunks and log.rows - len(log.chunks[-1]) >= rows:
            log.rows -= len(log.chunks.pop())
        if log.chunks and log.rows > rows:
            log.chunks[-1] = log.chunks[-1][:len(log.chunks[-1]) - (log.rows - rows)]
            log.rows = rows

    def truncate(self, request_id: str, length: int) -> None:
        """Forget positions at or past ``length`` (the context changed there)."""
        log = self._logs.get(request_id)
        if log is None or length >= log.first + log.rows:
            return
        if length <= log.first:
            del self._logs[request_id]
        else:
            self._cut(log, length - log.first)

    def span(self, request_id: str) -> tuple[int, int]:
        """[first, end) of the positions held (0, 0 when none)."""
        log = self._logs.get(request_id)
        return (log.first, log.first + log.rows) if log is not None else (0, 0)

    def states(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """States of positions [start, end), held (``span``) -> [end - start, F]."""
        log = self._logs[request_id]
        out, pos = [], log.first + log.rows
        for c in reversed(log.chunks):  # the rows asked are usually the last few
            pos -= len(c)
            lo, hi = max(start, pos), min(end, pos + len(c))
            if lo < hi:
                out.append(c[lo - pos:hi - pos])
            if pos <= start:
                break
        return out[0] if len(out) == 1 else torch.cat(out[::-1])

    def release(self, request_id: str) -> None:
        self._logs.pop(request_id, None)


@dataclass
class _State:
    seq: int
    """The head cache's sequence."""
    offset: int
    """The context position of the head cache's first entry."""


@dataclass
class DraftTask:
    """One request a head drafts for after its verdict."""

    request_id: str
    context: list[int]
    """The request's context, the step's emitted tokens included."""
    k: int
    sampling: SamplingParams
    generator: torch.Generator | None = None
    """Sampling: the generator its drafts are drawn with."""


class HeadRunner(InVerifierDrafter):
    """One head on the verifier's device, its KV cache and its requests' drafts."""

    def __init__(self, name: str, head: EagleHead, embed: torch.Tensor, num_blocks: int,
                 max_seqs: int, block_size: int) -> None:
        """``embed`` [V, Dt]: the target's embedding (unless the head has its own);
        ``num_blocks``: the head cache's blocks (one layer)."""
        super().__init__(name)
        self.head = head
        self.embed = head.embed_tokens.weight if head.embed_tokens is not None else embed
        c = head.config
        dev, dtype = embed.device, embed.dtype
        self.cache = KVCache(1, num_blocks, c.num_kv_heads, c.head_dim, max_seqs, block_size,
                             dtype, dev)
        self.iota = Iota(dev)
        self.target_ids = head.target_ids.to(dev)                                     # [Vd]
        self._states: dict[str, _State] = {}

    # ---- per request state -------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Forget the request (idempotent)."""
        st = self._states.pop(request_id, None)
        if st is not None:
            self.cache.blocks.free(st.seq)
        self.drafts.pop(request_id, None)

    def rollback(self, request_id: str, valid: int) -> None:
        """The request's context holds only its first ``valid`` tokens' states: keep the head
        positions whose pairs lie inside them."""
        st = self._states.get(request_id)
        if st is None:
            return
        keep = valid - 1 - st.offset
        if keep <= 0:
            self.release(request_id)
        elif keep < self.cache.lengths[st.seq]:
            self.cache.rollback(st.seq, keep)

    def _start(self, request_id: str, first: int) -> _State:
        self.release(request_id)
        st = _State(self.cache.blocks.admit(request_id), first)
        self._states[request_id] = st
        return st

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, tasks: list[DraftTask], log: FeatureLog) -> dict[str, HeadDraft]:
        """Each task's chain of ``k`` tokens from its committed context (one that cannot be
        drafted, for want of states or cache blocks, gets none)."""
        items = []  # (task, state, feed start position)
        for t in tasks:
            committed = len(t.context) - 1  # the last emitted token is not in any cache yet
            first, end = log.span(t.request_id)
            if end != committed or committed < 1:
                self.release(t.request_id)
                continue
            st = self._states.get(t.request_id)
            have = st.offset + self.cache.lengths[st.seq] if st is not None else -1
            if st is None or have < first:
                try:
                    st, have = self._start(t.request_id, first), first
                except CacheFull:  # every head sequence in use: no draft for it this step
                    continue
            start = min(have, committed - 1)  # at least the last position: it drafts
            self.cache.rollback(st.seq, start - st.offset)
            items.append((t, st, start))
        if not items:
            return {}
        try:
            return self._chains(items, self._extend(items, log))
        except CacheFull:  # no draft this step; the next one starts these requests afresh
            for t, _, _ in items:
                self.release(t.request_id)
            return {}

    def _extend(self, items: list[tuple[DraftTask, _State, int]], log: FeatureLog
                ) -> torch.Tensor:
        """Feed every item's new positions; the pre-norm output at each item's last [B, D]."""
        tokens, states = [], []
        for t, st, start in items:
            end = len(t.context) - 1
            tokens.append(t.context[start + 1:end + 1])
            states.append(log.states(t.request_id, start, end))
        sizes = [len(x) for x in tokens]
        lq = max(sizes)
        feats = torch.stack([F.pad(s, (0, 0, 0, lq - s.shape[0])) for s in states])  # [B, Lq, F]
        hidden = self.head.fuse(feats.to(self.embed.dtype))                         # [B, Lq, D]
        out = self._forward([st.seq for _, st, _ in items], tokens, hidden)        # [B, Lq, D]
        for (t, st, _), n in zip(items, sizes):
            self.cache.commit(st.seq, len(t.context) - 1 - st.offset)
        idx = torch.tensor([n - 1 for n in sizes], device=out.device)
        return out[torch.arange(len(items), device=out.device), idx]                # [B, D]

    def _chains(self, items: list[tuple[DraftTask, _State, int]], state: torch.Tensor
                ) -> dict[str, HeadDraft]:
        """Each item's chain from its last position's state [B, D]: a token per level, the
        chains still growing fed together (their positions kept until the chain is done)."""
        tasks = [t for t, _, _ in items]
        tokens: dict[str, list[int]] = {t.request_id: [] for t in tasks}
        rows: dict[str, list[torch.Tensor]] = {t.request_id: [] for t in tasks}
        live = list(range(len(items)))
        for level in range(max(t.k for t in tasks)):
            picks = self._pick([tasks[i] for i in live], state, rows)
            for i, tok in zip(live, picks):
                tokens[tasks[i].request_id].append(tok)
            grow = [j for j, i in enumerate(live) if tasks[i].k > level + 1]
            if not grow:
                break
            seqs = [items[live[j]][1].seq for j in grow]
            state = self._forward(seqs, [[picks[j]] for j in grow], state[grow][:, None])[:, 0]
            for s in seqs:
                self.cache.commit(s, self.cache.lengths[s] + 1)
            live = [live[j] for j in grow]
        result = {}
        for t, st, _ in items:
            self.cache.rollback(st.seq, len(t.context) - 1 - st.offset)
            probs = torch.stack(rows[t.request_id]) if rows[t.request_id] else None
            result[t.request_id] = self.drafts[t.request_id] = HeadDraft(
                len(t.context), tuple(tokens[t.request_id]), probs)
        return result

    def _pick(self, tasks: list[DraftTask], prenorm: torch.Tensor,
              rows: dict[str, list[torch.Tensor]]) -> list[int]:
        """Each task's next token from its state [B, D]: the argmax (greedy) or a draw from
        the processed distribution over the target's vocabulary (kept in ``rows``)."""
        logits = self.head.logits(prenorm)                                          # [B, Vd]
        picks = self.target_ids[logits.argmax(-1)].tolist()
        if all(t.sampling.greedy for t in tasks):
            return picks
        full = logits.new_full((len(tasks), self.head.config.vocab_size), float("-inf"))
        full[:, self.target_ids] = logits                                           # [B, V]
        for b, t in enumerate(tasks):
            if t.sampling.greedy:
                continue
            q = probs_from_logits(full[b], t.sampling)                              # [V]
            picks[b] = int(torch.multinomial(q, 1, generator=t.generator))
            rows[t.request_id].append(q)
        return picks

    def _forward(self, seqs: list[int], tokens: list[list[int]], hidden: torch.Tensor
                 ) -> torch.Tensor:
        """The head's layer over new positions of ``seqs`` (tokens [B][n], hidden [B, Lq, D]),
        writing their keys and values after each sequence's committed length -> pre-norm
        outputs [B, Lq, D]."""
        cache = self.cache
        need = sum(cache.blocks.needed(s, cache.lengths[s] + len(t)) for s, t in zip(seqs, tokens))
        if need > cache.blocks.free_blocks:
            raise CacheFull(f"a head needs {need} more KV blocks, {cache.blocks.free_blocks} free")
        for s, t in zip(seqs, tokens):
            cache.reserve(s, cache.lengths[s] + len(t))
        sizes = [len(t) for t in tokens]
        paged = cache.locate(seqs, sizes, max(sizes))
        lay = ragged_layout(tokens, [None] * len(seqs), [cache.lengths[s] for s in seqs],
                            paged.lk, self.iota)
        b, lq = lay["tokens"].shape
        q, k, v = self.head.attention_inputs(F.embedding(lay["tokens"], self.embed), hidden,
                                             lay["positions"])                # [B, Lq, *, hd]
        cache.write(0, paged, k, v)
        keys, values = cache.read(0, paged)                                         # [B, KVH, Lk, hd]
        attn = sdpa(q.transpose(1, 2), keys, values, lay["mask"])                  # [B, H, Lq, hd]
        return self.head.after_attention(hidden, attn.transpose(1, 2).reshape(b, lq, -1))
