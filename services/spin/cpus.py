"""Which CPU cores a service process runs on (``--cpus``), and its torch threads to match.

On a CPU-only machine the verifier and the drafters compete for the same cores. Unpipelined that
is harmless: they take turns. Pipelined (``--micro-batches 2``) one micro-batch is drafted while
the other is verified, so both run at once, and a verifier whose OpenMP threads span every core
waits at each operator's barrier for the thread a drafter displaced: on 2 cores, with 9 requests
in flight, the verifier took 26-27 ms for a half batch against 28-30 ms for the whole one.
Giving the verifier its own cores and the drafters and router the others makes the two stages
overlap for real, as a GPU verifier beside CPU-side drafting does. Linux only
(``sched_setaffinity``); in Kubernetes the kubelet's CPU manager does this for Guaranteed pods.

Measured by ``spin bench policy --quick`` (2 cores, 32 concurrent requests, draft-code k=4, three
runs): split, two micro-batches step in 1.05-1.10x max(draft, verify) of one micro-batch, at
323-345 tokens/s against 253-275 with one. On 2 cores the verifier's single core is then the
bottleneck, so the split is no throughput win over shared cores (256-356 tokens/s with one
micro-batch, noisy); with more cores the verifier keeps three quarters of them.
"""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> list[int]:
    """``"0"``, ``"1,3"``, ``"2-5"`` or ``"0,2-3"`` -> sorted core numbers; ValueError with a
    message for anything else or for cores this process may not use."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a core number or a range "
                             "like 2-5") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a range of cores")
        cpus.update(range(first, last + 1))
    allowed = available_cpus()
    if not cpus <= set(allowed):
        raise ValueError(f"CPU list {spec!r}: cores {sorted(cpus - set(allowed))} are not "
                         f"available to this process (it may use {format_cpus(allowed)})")
    return sorted(cpus)


def available_cpus() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def format_cpus(cpus: list[int]) -> str:
    """[0, 2, 3, 4] -> ``"0,2-4"`` (the form ``parse_cpus`` reads)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def pin(cpus: list[int]) -> None:
    """Run every thread of this process, and those it starts later, on ``cpus``."""
    for tid in os.listdir("/proc/self/task"):  # threads started before this call
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    os.sched_setaffinity(0, cpus)


def split(cpus: list[int]) -> tuple[list[int], list[int]]:
    """The cores of a pipelined deployment on one machine: (drafters and router, verifier).
    A quarter (at least one) drafts and routes; the verifier, the bottleneck, gets the rest."""
    if len(cpus) < 2:
        raise ValueError(f"splitting cores needs at least 2, this process has {format_cpus(cpus)}")
    n = max(1, len(cpus) // 4)
    return cpus[:n], cpus[n:]
