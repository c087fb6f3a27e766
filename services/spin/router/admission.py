"""Admission by KV cache blocks: the router admits a request when the verifier has the blocks for
its context, as the verifier last reported them less what the router admitted since.

The verifier reports its free blocks with every batch (``VerifyResponse.free_blocks``). A request
admitted since is *pending* until its first verification: its context's blocks are counted as
taken, less the blocks of its prompt's prefix that the router sent to the verifier before (likely
in its prefix cache: ``prefix_affinity.py``; shared blocks count once). A request is admitted
while the free blocks, less the pending ones and a small watermark (1% of the cache, as vLLM
keeps), hold its context and one new token; with nothing running it is
admitted whatever the estimate says (another router may have used the blocks, and when it
cannot be served the verifier preempts it: nothing waits forever on a stale count).

The estimate need not be exact: when blocks run out mid-decode the verifier preempts the
youngest requests of the batch and the router requeues them (``scheduler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVBudget:
    """The verifier's KV blocks as the router sees them."""

    block_size: int
    """Tokens per block (0: the verifier reports no blocks; every request is admitted)."""
    num_blocks: int
    free: int
    """Free blocks at the verifier's last report."""
    pending: int = 0
    """Blocks of the requests admitted and not verified yet."""

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size) if self.block_size else 0

    @property
    def watermark(self) -> int:
        return max(1, self.num_blocks // 100)

    def report(self, free: int, num_blocks: int) -> None:
        """A verifier batch's answer: its free blocks now."""
        if num_blocks:
            self.free, self.num_blocks = free, num_blocks

    def try_admit(self, context_tokens: int, running: int, cached_tokens: int = 0
                  ) -> int | None:
        """The blocks a request of ``context_tokens`` is counted for when admitted now, or None
        when it must wait; ``cached_tokens`` of its prefix are likely in the verifier's prefix
        cache already (shared blocks count once)."""
        if not self.block_size:
            return 0
        need = self.blocks_for(context_tokens + 1) - cached_tokens // self.block_size
        if running and need + self.watermark > self.free - self.pending:
            return None
        self.pending += need
        return need

    def verified(self, blocks: int) -> None:
        """A pending request's first verification happened (or it left): its blocks are in the
        verifier's reports from now on."""
        self.pending = max(0, self.pending - blocks)
