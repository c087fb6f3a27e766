"""Cache-aware routing: a new request goes to the replica that already holds its prompt's prefix.

Each verifier and drafter replica keeps full blocks of the contexts it served in its prefix cache
(``engine/prefix_cache.py``). The router does not ask the replicas what they hold; it remembers
where it sent each prompt prefix (SGLang's router keeps such an approximate tree): the prompt's
first ``max_blocks`` blocks of ``block_size`` tokens, each keyed by a hash chained over the
blocks before it (as the replicas key them), map to the replica the request was pinned to, in a
least-recently-used table of at most ``capacity`` keys. A new request's home is the replica of
its longest remembered prefix; it goes there unless that replica holds ``slack`` more requests
than the least loaded one, when load wins (a shared system prompt must not pile every request
onto one replica). A replica that leaves takes its entries with it. Admission also reads the
table: a prompt whose prefix was sent before needs blocks only for the rest (``remembered``).

The table is a guess, never a promise: a replica may have evicted the blocks, and then the
request computes its prefix as it would anywhere. Output never depends on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..obs import metrics


@dataclass(frozen=True)
class AffinityConfig:
    """How prefixes pick replicas."""

    block_size: int = 16
    """Tokens per keyed block (the services' default KV block)."""
    max_blocks: int = 64
    """Blocks of a prompt remembered (its first 1,024 tokens by default)."""
    capacity: int = 1 << 16
    """Prefix keys remembered at most (least recently used forgotten first)."""
    slack: int = 8
    """Requests a home replica may hold beyond the least loaded one and still be chosen."""


class PrefixAffinity:
    """Prompt prefix -> the replica it was last sent to, for one service's replicas."""

    def __init__(self, cfg: AffinityConfig = AffinityConfig()) -> None:
        self.cfg = cfg
        self._home: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._home)

    def keys(self, prompt: Sequence[int]) -> list[int]:
        """Chained keys of the prompt's full blocks (at most ``max_blocks``)."""
        bs, out, parent = self.cfg.block_size, [], None
        for i in range(min(len(prompt) // bs, self.cfg.max_blocks)):
            parent = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            out.append(parent)
        return out

    def choose(self, keys: list[int], load: dict[str, int], kind: str, drafter: str) -> str:
        """The replica (of ``load``: address -> pinned requests, the live ones) for a request
        with prefix ``keys``: its home when not ``slack`` busier than the least loaded, else the
        least loaded (ties by address). ``kind``/``drafter``: the metric's labels."""
        least = min(sorted(load), key=lambda a: load[a])
        if len(load) == 1:
            return least
        for key in reversed(keys):
            home = self._home.get(key)
            if home in load:
                if load[home] <= load[least] + self.cfg.slack:
                    metrics.PREFIX_ROUTING.labels(kind, drafter, "home").inc()
                    return home
                metrics.PREFIX_ROUTING.labels(kind, drafter, "busy").inc()
                return least
        if keys:
            metrics.PREFIX_ROUTING.labels(kind, drafter, "none").inc()
        return least

    def remembered(self, prompt: Sequence[int]) -> int:
        """Tokens of the prompt's longest prefix sent to some replica before (what admission
        may count as cached there: ``admission.py``)."""
        n = 0
        for key in self.keys(prompt):
            if key not in self._home:
                break
            n += self.cfg.block_size
        return n

    def record(self, keys: list[int], address: str) -> None:
        """The request with prefix ``keys`` was pinned to ``address``."""
        for key in keys:
            self._home[key] = address
            self._home.move_to_end(key)
        while len(self._home) > self.cfg.capacity:
            self._home.popitem(last=False)

    def drop(self, address: str) -> None:
        """The replica left: forget what it held."""
        for key in [k for k, a in self._home.items() if a == address]:
            del self._home[key]
