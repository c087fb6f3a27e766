"""Suffix decoding's texts shared by router replicas through Redis, so that they learn together.

Each router's suffix store (``engine/suffix_decoding.py``) learns from its own requests only.
With ``--suffix-share`` a router also publishes each finished request's text (its prompt and
output, as the target's token ids) to a Redis stream, and takes in what the other routers
publish; a router that starts reads the stream's latest entries first, up to its store's token
budget, so a new replica drafts from what the others served before it.

**Layout.** One stream, ``{key_prefix}:{namespace}`` (the namespace is the target tokenizer's
fingerprint: routers of different targets never mix token ids), one entry per request: ``o``,
the publishing router's id (a router skips its own entries), and ``t``, the token ids as
little-endian uint32. ``XADD ... MAXLEN ~ max_entries`` bounds what Redis keeps.

**Threads.** All Redis I/O runs in two daemon threads, a reader (blocked on ``XREAD`` up to
``poll_s``, so a text arrives as soon as it is written) and a writer (woken by ``publish``); the
router's event loop only appends to the outbox (``publish``) and drains the inbox (``take``),
each under a lock held for a deque operation, never across a Redis call. Delivery is at least
once: a batch whose XADD outcome is unknown (an error) is sent again, and a duplicate text in a
suffix store only counts twice in its frequencies.

**Redis down.** ``publish`` never waits: the outbox keeps the newest ``max_pending`` texts (older
ones dropped and counted), errors are counted and retried with exponential backoff (capped at
``max_backoff_s``), and reading resumes after the last entry read, so what the other routers
published meanwhile arrives too, as long as the stream still keeps it.

**Privacy.** The stream holds users' prompts and outputs (as token ids) for every router on that
Redis to read; sharing is off unless asked for.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Sequence

import redis

log = logging.getLogger(__name__)

DEFAULT_SHARE_PREFIX = "spin:suffix"
"""Prefix of the stream's key (the namespace follows)."""
_PAGE = 256
"""Entries per XREVRANGE / XREAD call."""


def pack(tokens: Sequence[int]) -> bytes:
    """``tokens`` as little-endian uint32."""
    a = array("I", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes) -> list[int]:
    """The inverse of ``pack``."""
    a = array("I")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


class SuffixShare:
    """Publishes this router's finished texts and receives the other routers' (module doc)."""

    def __init__(self, url: str, namespace: str, *, key_prefix: str = DEFAULT_SHARE_PREFIX,
                 max_entries: int = 4096, seed_tokens: int = 65536, max_pending: int = 256,
                 poll_s: float = 0.2, max_backoff_s: float = 5.0, socket_timeout_s: float = 1.0,
                 on_error: Callable[[Exception], None] | None = None,
                 on_texts: Callable[[str, int], None] | None = None) -> None:
        """``max_entries``: the stream's length (approximate: Redis trims whole nodes);
        ``seed_tokens``: tokens read back at start (newest first) and kept in the inbox at most
        (older received texts are dropped: the store would evict them anyway); ``max_pending``:
        texts the outbox keeps while Redis is down; ``poll_s``: how long a read waits for new
        entries; ``on_error(exc)`` for each failed Redis call; ``on_texts(event, n)`` counts texts
        ``published``, ``received`` and ``dropped`` (the counters below, as metrics)."""
        if max_entries < 1 or seed_tokens < 1 or max_pending < 1:
            raise ValueError("max_entries, seed_tokens and max_pending must be >= 1")
        if not 0 < poll_s < socket_timeout_s:
            raise ValueError(f"want 0 < poll_s ({poll_s}) < socket_timeout_s "
                             f"({socket_timeout_s})")
        self.key = f"{key_prefix}:{namespace}"
        self.origin = uuid.uuid4().hex.encode()
        """This router's id in the entries it writes."""
        self.max_entries, self.seed_tokens, self.max_pending = max_entries, seed_tokens, max_pending
        self.poll_s, self.max_backoff_s = poll_s, max(max_backoff_s, poll_s)
        self._on_error, self._on_texts = on_error, on_texts
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s)
        self._lock = threading.Lock()
        self._outbox: deque[bytes] = deque()
        self._inbox: deque[list[int]] = deque()
        self._inbox_tokens = 0
        self._last: bytes | None = None
        """The last stream entry read (None: not seeded yet)."""
        self.published = 0
        """Texts written to the stream (a retried batch counts again)."""
        self.received = 0
        """Other routers' texts read from the stream (the seed's included)."""
        self.dropped = 0
        """Texts dropped: unsent past ``max_pending``, or received past ``seed_tokens``."""
        self.errors = 0
        """Failed Redis calls."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set by ``publish``: the writer sends at once."""
        self._threads = [threading.Thread(target=self._loop, args=(work,), daemon=True,
                                          name=f"suffix-share-{work.__name__.strip('_')}")
                         for work in (self._read, self._write)]
        for t in self._threads:
            t.start()

    # ---- the event loop's side ---------------------------------------------------------------
    def publish(self, tokens: Sequence[int]) -> None:
        """Send a finished request's text to the other routers (never waits)."""
        data = pack(tokens)
        with self._lock:
            self._outbox.append(data)
            over = self._trim_outbox()
        self._count("dropped", over)
        self._wake.set()

    def take(self) -> list[list[int]]:
        """The other routers' texts received since the last call, oldest first."""
        if not self._inbox:  # the common case: a read of a deque's length, no lock
            return []
        with self._lock:
            out = list(self._inbox)
            self._inbox.clear()
            self._inbox_tokens = 0
        return out

    @property
    def pending(self) -> int:
        """Texts waiting to be sent."""
        return len(self._outbox)

    @property
    def seeded(self) -> bool:
        """The stream's history has been read (the first read after start succeeded)."""
        return self._last is not None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the threads, then try once to send what waits (a shutdown with Redis down drops
        it, counted)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout_s)
        try:
            self._send()
        except redis.RedisError as e:
            self._failed(e)
        left = len(self._outbox)
        if left:
            self._outbox.clear()
            self._count("dropped", left)
        self._client.close()

    # ---- the thread's side -------------------------------------------------------------------
    def _loop(self, work: Callable[[], None]) -> None:
        """Run ``work`` until ``close``, backing off while Redis fails."""
        wait = self.poll_s
        while not self._stop.is_set():
            try:
                work()
                wait = self.poll_s
            except redis.RedisError as e:
                self._failed(e)
                self._stop.wait(wait)
                wait = min(2 * wait, self.max_backoff_s)

    def _read(self) -> None:
        """The reader's turn: the history first, then what is new (waiting ``poll_s`` for it)."""
        if self._last is None:
            self._seed()
        self._receive()

    def _write(self) -> None:
        """The writer's turn: what waits, as soon as it is published."""
        self._wake.wait(self.poll_s)
        self._wake.clear()
        self._send()
        if self._outbox:  # more than a page waits
            self._wake.set()

    def _seed(self) -> None:
        """Read the stream's newest entries, as many as fit in ``seed_tokens`` (at least one),
        into the inbox, oldest first."""
        got: list[list[int]] = []
        tokens, newest, before = 0, b"0-0", b"+"
        while tokens < self.seed_tokens:
            page = self._client.xrevrange(self.key, before, "-", count=_PAGE)
            if not page:
                break
            if newest == b"0-0":
                newest = page[0][0]
            for _, fields in page:
                text = unpack(fields[b"t"])
                if got and tokens + len(text) > self.seed_tokens:
                    tokens = self.seed_tokens  # full: no older text fits
                    break
                got.append(text)
                tokens += len(text)
            before = b"(" + page[-1][0]
            if len(page) < _PAGE:
                break
        self._deliver(reversed(got))
        self._last = newest

    def _send(self) -> None:
        with self._lock:
            batch = [self._outbox.popleft() for _ in range(min(_PAGE, len(self._outbox)))]
        if not batch:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for data in batch:
                pipe.xadd(self.key, {"o": self.origin, "t": data}, maxlen=self.max_entries,
                          approximate=True)
            pipe.execute()
        except redis.RedisError:
            with self._lock:  # back in front, to be sent again (at least once)
                self._outbox.extendleft(reversed(batch))
                over = self._trim_outbox()
            self._count("dropped", over)
            raise
        self._count("published", len(batch))

    def _receive(self) -> None:
        assert self._last is not None
        reply = self._client.xread({self.key: self._last}, count=_PAGE,
                                   block=max(1, int(self.poll_s * 1000)))
        texts = []
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self._last = entry_id
                if fields.get(b"o") != self.origin:
                    texts.append(unpack(fields[b"t"]))
        self._deliver(texts)

    def _deliver(self, texts) -> None:
        dropped = received = 0
        with self._lock:
            for text in texts:
                self._inbox.append(text)
                self._inbox_tokens += len(text)
                received += 1
            while self._inbox_tokens > self.seed_tokens and len(self._inbox) > 1:
                self._inbox_tokens -= len(self._inbox.popleft())
                dropped += 1
        self._count("received", received)
        self._count("dropped", dropped)

    def _trim_outbox(self) -> int:
        """Drop the oldest unsent texts past ``max_pending`` (the lock held); how many."""
        over = max(0, len(self._outbox) - self.max_pending)
        for _ in range(over):
            self._outbox.popleft()
        return over

    def _count(self, event: str, n: int) -> None:
        if n:
            setattr(self, event, getattr(self, event) + n)
            if self._on_texts is not None:
                self._on_texts(event, n)

    def _failed(self, e: Exception) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("suffix share: Redis call failed (%d so far): %s", self.errors, e)
        if self._on_error is not None:
            self._on_error(e)
