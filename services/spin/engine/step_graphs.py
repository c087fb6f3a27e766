"""Static-shape steps: decode and verification forwards padded to shape buckets, replayed as
captured CUDA graphs on CUDA (and optionally ``torch.compile``'d, on either device).

A small model's decode step on a GPU is hundreds of kernel launches of microseconds each: the
host, not the GPU, sets the pace. A CUDA graph replays all of them with one launch, but only for
the exact shapes and addresses it was captured with. So a step is padded to a **bucket**:

- batch: ``GraphConfig.batch_sizes`` (1, 2, 4, ... 64): padded requests feed token 0 with no
  context and write to the cache's scratch block;
- new tokens per request: ``query_sizes`` (1, 2, 4, 8, 16): a decode step, a drafted chain of
  up to 15 tokens with its bonus row, a tree of up to 16 nodes;
- keys: powers of two from ``min_keys`` to ``max_keys`` (each request's block table padded
  with the scratch block; masked).

Every input of a bucket lives in one int64 buffer (tokens, context lengths, new-token counts,
the ancestor mask of the new tokens, block tables, write slots, logit rows: ``_Layout``), filled
on the host (pinned memory on CUDA) and copied with one non-blocking copy per step; positions
and the attention mask are computed from it inside the graph, so a tree and a chain replay the
same graph. The graph ends at the final norm's hidden states [Bb, Qb, D]; the output layer runs
after it on the real rows only (over a 128k vocabulary the logits of every padded row would
cost as much as the rest of a small model, and each graph would keep its own [Bb, Qb, V]
output alive).

Steps outside the buckets (a prefill, a batch past the largest bucket, a context past
``max_keys``) and half precision on the CPU (``ModelRunner.batch_invariant``) run eager.

On the CPU the same bucketed step runs eager (``GraphConfig.capture`` off) or compiled by
inductor (``compile``); the tests prove its output equals the eager forward's, token for token.
Neither is the CPU's default (``spin bench steps``, ``benchmarks/cpu/bench-steps.json``: 2
cores, medians of 30 decode steps at context 100): padding keys to 256 made draft-general's step
4.76 ms against 3.72 eager at batch 1, 9.18 against 8.65 at batch 8; compiled 3.74 and 7.20 ms,
after 20.3 and 11.7 s of compiling a bucket.

CUDA graphs with static buffers rather than ``torch.compile(mode="reduce-overhead")``: the
buckets, the capture at start, the shared memory pool and the outputs (hidden states, not
logits) are ours to size, nothing recompiles behind a guard, and the eager step (the default)
needs no compiler at all; ``--compile`` composes with it (compiled, then captured).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Protocol

import torch

from .kv_cache import KVCache, Paged
from .tree import ancestors


class StepItem(Protocol):
    """New tokens of one request (``model_runner.ForwardItem``)."""

    @property
    def seq(self) -> int: ...
    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def parents(self) -> Sequence[int] | None: ...


class StaticRunner(Protocol):
    """What the bucketed steps use of their ``model_runner.ModelRunner``."""

    device: torch.device
    cache: KVCache
    max_len: int

    def static_body(self, tokens: torch.Tensor, ctx: torch.Tensor, n: torch.Tensor,
                    anc: torch.Tensor, table: torch.Tensor, slots: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class GraphConfig:
    """Which steps run with static shapes, and how."""

    capture: bool = True
    """Capture each bucket's step as a CUDA graph and replay it (CUDA only)."""
    compile: bool = False
    """``torch.compile`` the bucketed step (inductor; on CUDA before capture)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Batch buckets (a batch pads to the smallest that holds it; larger batches run eager)."""
    query_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    """New tokens per request buckets (more: eager, e.g. a prefill)."""
    min_keys: int = 256
    """Smallest key bucket (tokens; rounded up to whole blocks)."""
    max_keys: int = 4096
    """Largest key bucket: longer contexts run eager (the model's length caps it too)."""


@dataclass(frozen=True)
class Bucket:
    """A static step shape."""

    batch: int
    """Requests (padded)."""
    queries: int
    """New tokens per request (padded)."""
    keys: int
    """Key positions per request (a multiple of the block size)."""


@dataclass
class _Step:
    """One bucket's static input buffer, its runner and (captured) output."""

    host: torch.Tensor                 # [N] int64, pinned on CUDA
    device: torch.Tensor               # [N] int64 on the runner's device (``host`` on the CPU)
    run: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """-> hidden states [Bb, Qb, D], kept layer inputs [Bb, Qb, F] or None"""
    copied: torch.cuda.Event | None = None
    """Recorded after the last host-to-device copy: the host buffer is free again after it."""


@dataclass(frozen=True)
class _Layout:
    """Views of a bucket's int64 buffer (shapes in comments)."""

    tokens: torch.Tensor   # [Bb, Qb]
    ctx: torch.Tensor      # [Bb] committed context length
    n: torch.Tensor        # [Bb] new tokens (0 for a padded request)
    anc: torch.Tensor      # [Bb, Qb, Qb] 1 where column j is an ancestor of (or is) row i
    table: torch.Tensor    # [Bb, Kb / BS] block table, padded with the scratch block
    slots: torch.Tensor    # [Bb * Qb] cache slot written by each new token (padding: scratch)
    rows: torch.Tensor     # [Bb, Qb] hidden-state rows whose logits are asked for

    @staticmethod
    def size(b: Bucket, block_size: int) -> int:
        q = b.queries
        return b.batch * (q + 2 + q * q + b.keys // block_size + 2 * q)

    @staticmethod
    def of(buf: torch.Tensor, b: Bucket, block_size: int) -> _Layout:
        bb, q, mb = b.batch, b.queries, b.keys // block_size
        parts = buf.split([bb * q, bb, bb, bb * q * q, bb * mb, bb * q, bb * q])
        return _Layout(parts[0].view(bb, q), parts[1], parts[2], parts[3].view(bb, q, q),
                       parts[4].view(bb, mb), parts[5], parts[6].view(bb, q))


@dataclass
class StepGraphs:
    """The bucketed steps of one ``ModelRunner`` (built by it when graphs or compile are on)."""

    runner: StaticRunner
    config: GraphConfig
    steps: dict[Bucket, _Step] = field(default_factory=dict)
    pool: object | None = None
    """The CUDA graphs' shared memory pool."""
    replays: int = 0
    """Steps run through a bucket (the rest ran eager)."""

    def __post_init__(self) -> None:
        dev = self.runner.device
        self.capture = self.config.capture and dev.type == "cuda"
        bs = self.runner.cache.block_size
        top = min(self.config.max_keys, self.runner.max_len)  # a step never passes max_len
        keys, k = [], -(-self.config.min_keys // bs) * bs
        while True:
            keys.append(k)
            if k >= top:
                break
            k *= 2
        self.key_sizes = tuple(keys)
        self.batch_sizes = tuple(b for b in self.config.batch_sizes
                                 if b <= self.runner.cache.blocks.max_seqs) or (1,)
        self._body = self.runner.static_body
        if self.config.compile:
            _raise_recompile_limit(len(self.buckets()) + 8)
            self._body = torch.compile(self.runner.static_body, dynamic=False)
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def buckets(self) -> list[Bucket]:
        """Every bucket, largest first (a shared graph pool is best filled that way)."""
        return [Bucket(b, q, k) for b, q, k in product(sorted(self.batch_sizes, reverse=True),
                                                       sorted(self.config.query_sizes,
                                                              reverse=True),
                                                       sorted(self.key_sizes, reverse=True))]

    def bucket(self, sizes: list[int], lk: int) -> Bucket | None:
        """The smallest bucket holding a batch of ``sizes`` new tokens and ``lk`` keys."""
        b = next((x for x in sorted(self.batch_sizes) if x >= len(sizes)), None)
        q = next((x for x in sorted(self.config.query_sizes) if x >= max(sizes)), None)
        k = next((x for x in self.key_sizes if x >= lk), None)
        if b is None or q is None or k is None:
            return None
        return Bucket(b, q, k)

    @torch.inference_mode()  # as forwards run (the weights are parameters that want grads)
    def prepare(self, buckets: list[Bucket] | None = None, progress: bool = False) -> int:
        """Build (on CUDA: capture) the steps of ``buckets`` (default: all) now, not at first
        use; returns how many were built."""
        todo = [b for b in (buckets or self.buckets()) if b not in self.steps]
        if progress:
            from tqdm import tqdm
            what = "capturing CUDA graphs" if self.capture else "compiling steps"
            todo = tqdm(todo, desc=what, unit="graph", leave=False)
        for b in todo:
            self.steps[b] = self._build(b)
        return len(todo)

    def _build(self, b: Bucket) -> _Step:
        bs, dev = self.runner.cache.block_size, self.runner.device
        host = torch.zeros(_Layout.size(b, bs), dtype=torch.long,
                           pin_memory=dev.type == "cuda")
        _fill_idle(_Layout.of(host, b, bs), self.runner.cache.scratch, bs)
        buf = host.to(dev) if dev.type != "cpu" else host
        lay = _Layout.of(buf, b, bs)
        body = self._body

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            return body(lay.tokens, lay.ctx, lay.n, lay.anc, lay.table, lay.slots)

        if not self.capture:  # eager or compiled; on CUDA its copy is ordered by an event too
            return _Step(host, buf, run, torch.cuda.Event() if dev.type == "cuda" else None)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up (allocator, autotuning) outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = run()

        def replay() -> tuple[torch.Tensor, torch.Tensor | None]:
            graph.replay()
            return out

        return _Step(host, buf, replay, torch.cuda.Event())

    def forward(self, items: list[StepItem], rows: list[list[int]], lk: int
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Hidden states [B, Lr, D] of ``rows[i]`` of item i (the final norm applied) and the
        kept layer inputs [B, Lq, F] of every new token (None unless the runner keeps some;
        a copy: the graph's own output is overwritten by its next replay, perhaps before a
        batch in flight is settled), or None when the batch fits no bucket (run it eager).
        Blocks are reserved already."""
        sizes = [len(it.tokens) for it in items]
        b = self.bucket(sizes, lk)
        if b is None:
            return None
        step = self.steps.get(b)
        if step is None:
            step = self.steps[b] = self._build(b)
        if step.copied is not None:
            step.copied.synchronize()  # the last step's copy has left the pinned buffer
        bs = self.runner.cache.block_size
        _fill(_Layout.of(step.host, b, bs), items, rows, self.runner.cache, bs)
        if step.device is not step.host:
            step.device.copy_(step.host, non_blocking=True)
            if step.copied is not None:
                step.copied.record()
        hidden, kept = step.run()                                  # [Bb, Qb, D], [Bb, Qb, F]
        self.replays += 1
        lay = _Layout.of(step.device, b, bs)
        lr = len(rows[0])
        idx = lay.rows[:len(items), :lr]                                         # [B, Lr]
        out = hidden[:len(items)].gather(1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))
        return out, None if kept is None else kept[:len(items), :max(sizes)].clone()


def _fill_idle(lay: _Layout, scratch: int | None, block_size: int) -> None:
    """A bucket's buffer with every request padding: no context, no new token, all reads and
    writes in the scratch block (what a capture and its warm-up run on)."""
    if scratch is None:
        raise ValueError("static-shape steps need a KV cache with a scratch block")
    lay.tokens.zero_()
    lay.ctx.zero_()
    lay.n.zero_()
    lay.anc.zero_()
    lay.table.fill_(scratch)
    lay.slots.fill_(scratch * block_size)
    lay.rows.zero_()


def _fill(lay: _Layout, items: list[StepItem], rows: list[list[int]], cache: KVCache,
          block_size: int) -> None:
    """Write a batch's inputs into a bucket's (host) buffer: a few tensor writes per step,
    none per request (a per-request write costs microseconds of host time each)."""
    scratch = cache.scratch
    _fill_idle(lay, scratch, block_size)
    b, q, mb = len(items), lay.tokens.shape[1], lay.table.shape[1]
    lengths, tables = cache.blocks.lengths, cache.blocks.tables
    sizes = [len(it.tokens) for it in items]
    starts = [lengths[it.seq] for it in items]
    lay.tokens[:b] = torch.tensor([list(it.tokens) + [0] * (q - n)
                                   for it, n in zip(items, sizes)])
    lay.ctx[:b] = torch.tensor(starts)
    lay.n[:b] = n_t = torch.tensor(sizes)
    valid = torch.arange(q)[None, :] < n_t[:, None]                              # [B, Qb]
    lay.anc[:b] = torch.ones(q, q, dtype=torch.long).tril() * (valid[:, :, None]
                                                                & valid[:, None, :])
    trees = [i for i, it in enumerate(items) if it.parents is not None]
    if trees:  # one batched ancestor walk for every tree of the step
        parents = torch.tensor([list(items[i].parents) + [-1] * (q - sizes[i]) for i in trees])
        anc = ancestors(parents)[0] & valid[trees][:, :, None] & valid[trees][:, None, :]
        lay.anc[trees] = anc.long()                                              # [T, Qb, Qb]
    lay.table[:b] = torch.tensor([tables[it.seq][:mb] + [scratch] * (mb - len(tables[it.seq][:mb]))
                                  for it in items])
    pad = [scratch * block_size] * q
    lay.slots.view(-1, q)[:b] = torch.tensor([
        [tables[it.seq][p // block_size] * block_size + p % block_size
         for p in range(start, start + n)] + pad[n:]
        for it, start, n in zip(items, starts, sizes)])
    lr = len(rows[0])
    lay.rows[:b, :lr] = torch.tensor(rows)


def static_mask(ctx: torch.Tensor, n: torch.Tensor, anc: torch.Tensor, keys: int,
                dense: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(positions [Bb, Qb], attention mask [Bb, 1, Qb, Kb], None unless ``dense``) of a
    bucket's step from its context lengths ctx [Bb], new-token counts n [Bb] and ancestor
    masks anc [Bb, Qb, Qb]: a new token sees its request's context and its tree ancestors; a
    padded row sees key 0 (finite, never used)."""
    bb, q, _ = anc.shape
    anc = anc.bool()
    depth = anc.sum(-1)                                                         # [Bb, Qb]
    positions = (ctx[:, None] + depth - 1).clamp(min=0)                         # [Bb, Qb]
    if not dense:
        return positions, None
    kpos = torch.arange(keys, device=ctx.device)                                # [Kb]
    rel = kpos[None, None, :] - ctx[:, None, None]                              # [Bb, 1, Kb]
    in_tree = (rel >= 0) & (rel < n[:, None, None])
    tree = anc.gather(2, rel.clamp(0, q - 1).expand(bb, q, keys)) & in_tree     # [Bb, Qb, Kb]
    valid = torch.arange(q, device=ctx.device)[None, :] < n[:, None]            # [Bb, Qb]
    mask = (rel < 0) | tree | (~valid[:, :, None] & (kpos == 0))
    return positions, mask[:, None]


def static_paged(table: torch.Tensor, slots: torch.Tensor, block_size: int) -> Paged:
    """The ``Paged`` of a bucket's step: writes through ``slots``, reads through ``table``."""
    return Paged(table.shape[1] * block_size, None, table=table, slots=slots)


def _raise_recompile_limit(n: int) -> None:
    """Let dynamo keep one compiled graph per bucket (``recompile_limit``, formerly
    ``cache_size_limit``)."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name) and getattr(dc, name) < n:
            setattr(dc, name, n)


def describe(graphs: StepGraphs | None) -> str:
    if graphs is None:
        return "eager steps"
    how = "CUDA graphs" if graphs.capture else "bucketed steps"
    if graphs.config.compile:
        how += ", compiled"
    return (f"{how}: batch {list(graphs.batch_sizes)} x new tokens "
            f"{list(graphs.config.query_sizes)} x keys {list(graphs.key_sizes)}, "
            f"{len(graphs.steps)} built")


def iter_rows(sizes: list[int], last_only: bool, logits_from: list[int] | None
              ) -> Iterator[list[int]]:
    """Per item, the new-token rows whose logits a forward returns (as ``ModelRunner.forward``
    defines them: every row, ``logits_from[i]`` on, or the last)."""
    if last_only:
        starts = [n - 1 for n in sizes]
    elif logits_from is not None and any(logits_from):
        starts = list(logits_from)
    else:
        starts = [0] * len(sizes)
    lr = max(n - f for n, f in zip(sizes, starts))
    for n, f in zip(sizes, starts):
        yield [min(f + j, n - 1) for j in range(lr)]
