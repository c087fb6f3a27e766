"""The drafters and the verifier as the scheduler sees them: plain tasks in, plain results out.

The scheduler (``scheduler.py``) works on engine types only: a draft is an ``engine.tree.TokenTree``,
sampling an ``engine.sampling.SamplingParams``, and a call to a service takes the tasks below and
answers the results below. ``VerifierClient`` and ``DrafterClient`` are the one place the router
turns them into ``spin.v1`` batches and back (with ``rpc/convert.py``), over a ``ReplicaPool``
(replicas, pinning, releases per replica: ``pool.py``) of bidi streams (``clients.py``).

A drafter's probability rows (sampling requests) are not decoded on the way through: the tree
comes back as a ``convert.ReceivedTree`` and goes to the verifier with its rows as they came.
A malformed tree costs its request the step's draft (the rest of the batch drafts and verifies).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..engine import token_mask
from ..engine.head_runner import HeadAsk
from ..engine.sampling import SamplingParams
from ..engine.tree import TokenTree
from ..engine.logprobs import TokenLogprobs
from ..rpc.convert import logprobs_from_proto, sampling_to_proto, tree_from_wire, tree_to_wire
from ..v1 import drafter_pb2, verifier_pb2
from .clients import ServiceDown
from .pool import ReplicaPool

log = logging.getLogger(__name__)
__all__ = ["DraftReply", "DraftResult", "DraftTask", "Drafter", "DrafterClient", "DrafterClients",
           "ServiceDown", "Verifier", "VerifierClient", "VerifyReply", "VerifyResult",
           "VerifyTask"]


# ---- drafting -----------------------------------------------------------------------------------
@dataclass
class DraftTask:
    """One request's part of a draft call."""

    request_id: str
    keep: int
    """Context tokens the drafter keeps of what it holds (``keep``'s answer)."""
    context_delta: list[int]
    """The context after ``keep``: what the drafter lacks."""
    k: int
    """Tree depth to draft; 0 = only take in the context (and score, with ``score``)."""
    sampling: SamplingParams
    branching: tuple[int, ...] = ()
    """Children per node per level; () = a chain."""
    traceparent: str = ""
    tracestate: str = ""
    score: bool = False
    """Also score how well the drafter predicts the context from ``score_from`` on."""
    score_from: int = 0
    stop_below: float = 0.0
    """Stop the chain once its probability falls below this (0 = always ``k``)."""
    context_probs: list[float] = field(default_factory=list)
    """With ``score`` on a sampling request: the target's probability of each ``context_delta``
    token (0 = unknown), for the drafter's acceptance estimate; empty otherwise."""


@dataclass
class DraftResult:
    """A drafter's answer for one task."""

    request_id: str
    tree: TokenTree | None = None
    """The draft; None when there is none (k = 0, a scoring task, nothing drafted)."""
    resync: bool = False
    """The drafter does not hold the ``keep`` tokens: send the whole context next time."""
    score_matches: int = 0
    score_positions: int = 0
    """Of ``score_positions`` context tokens scored, the drafter predicted ``score_matches``."""
    score_acceptance: float = 0.0
    score_acceptance_positions: int = 0
    """With ``context_probs``: the draft tokens a sampled draft would get accepted, estimated
    over ``score_acceptance_positions`` scored tokens (0: no estimate)."""


@dataclass
class DraftReply:
    """A draft call's answer: one result per task, in task order."""

    results: list[DraftResult]
    draft_seconds: float = 0.0
    """The drafter's own time for the batch (its slowest replica's)."""


# ---- verification -------------------------------------------------------------------------------
@dataclass
class VerifyTask:
    """One request's part of a verification call."""

    request_id: str
    keep: int
    """Context tokens the verifier keeps of what it holds (``keep``'s answer)."""
    context_delta: list[int]
    """The context after ``keep``: what the verifier lacks."""
    tree: TokenTree | None
    """The step's draft; None = the target's own next token only."""
    sampling: SamplingParams
    traceparent: str = ""
    tracestate: str = ""
    logprobs: int | None = None
    """Log-probabilities to return (``engine/logprobs.py``; None: none)."""
    head: HeadAsk | None = None
    """A draft head's part (its stored draft as the tree, a draft for the next step)."""
    allowed: torch.Tensor | None = None
    """Structured output: [len(tree) + 1, W] int32, the tokens the grammar allows at each row
    (``engine/token_mask.py``); None: every token."""
    steps: int = 1
    """Plain decoding steps the verifier runs for it in this call (more than one only without
    a tree, head or ``allowed``: ``SchedulerConfig.plain_steps``)."""
    stop_ids: tuple[int, ...] = ()
    """Tokens after which a multi-step task stops (its end-of-sequence token)."""


@dataclass
class VerifyResult:
    """The verifier's verdict on one task."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    """The accepted draft tokens and the target's own token after them."""
    num_accepted: int = 0
    """Draft tokens among ``tokens``."""
    resync: bool = False
    """The verifier does not hold the ``keep`` tokens: nothing was verified; send the whole
    context next time."""
    preempted: bool = False
    """No KV blocks for the request this step: its cache was dropped, its context kept; nothing
    was verified."""
    logprobs: list[TokenLogprobs] | None = None
    """One per ``tokens``, when the task asked."""
    token_probs: list[float] = field(default_factory=list)
    """Sampling requests: one per ``tokens``, its probability under the processed target row it
    was emitted from (empty when greedy)."""
    head_draft: list[int] = field(default_factory=list)
    """The task's head's chain for the request's next step (``HeadAsk.k``)."""


@dataclass
class VerifyReply:
    """A verification call's answer: one result per task, in task order."""

    results: list[VerifyResult]
    verify_seconds: float = 0.0
    """The verifier's own time for the batch."""
    free_blocks: int = 0
    num_blocks: int = 0
    """The verifier's KV blocks free and in all after the batch (0 = not reported)."""
    head_seconds: dict[str, float] = field(default_factory=dict)
    """Of ``verify_seconds``, each draft head's drafting."""


# ---- what the scheduler calls -------------------------------------------------------------------
class Service(Protocol):
    """Either kind of service: one logical drafter or verifier over its replicas, and its record
    of what it holds of each request (``pool.py``)."""

    @property
    def available(self) -> bool:
        """Some replica is up, or due for another try."""
        ...

    def keep(self, request_id: str, prompt: Sequence[int] = ()) -> int:
        """Pin the request to a replica (a new pin: where its ``prompt``'s prefix went, load
        permitting); the context tokens to keep (0 on a replica new to it)."""
        ...

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        """Tokens of the prompt's prefix the service likely caches (sent there before)."""
        ...

    def hold(self, request_id: str, tokens: int) -> None:
        """After a call: the request's replica holds ``tokens`` context tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The replica's state of the request is unknown: the whole context next time."""
        ...

    def release(self, request_ids: set[str] | list[str]) -> None:
        """Done with the requests: freed with the next call (or ``flush``)."""
        ...

    @property
    def pending_releases(self) -> bool:
        ...

    async def flush(self) -> None:
        """Send the pending releases alone."""
        ...


class Verifier(Service, Protocol):
    async def verify(self, tasks: list[VerifyTask], timeout_s: float | None = None
                     ) -> VerifyReply:
        """Verify the tasks (pending releases ride along); ServiceDown when it cannot."""
        ...


class Drafter(Service, Protocol):
    async def draft(self, tasks: list[DraftTask], timeout_s: float | None = None) -> DraftReply:
        """Draft the tasks (pending releases ride along); ServiceDown when it cannot."""
        ...


class _PoolFacade:
    """What both facades forward to their ``ReplicaPool``."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    @property
    def available(self) -> bool:
        return self.pool.available

    def keep(self, request_id: str, prompt: Sequence[int] = ()) -> int:
        return self.pool.keep(request_id, prompt)

    def hold(self, request_id: str, tokens: int) -> None:
        self.pool.hold(request_id, tokens)

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        return self.pool.affinity.remembered(prompt)

    def forget(self, request_id: str) -> None:
        self.pool.forget(request_id)

    def release(self, request_ids: set[str] | list[str]) -> None:
        self.pool.release(request_ids)

    @property
    def pending_releases(self) -> bool:
        return self.pool.pending_releases

    async def flush(self) -> None:
        await self.pool.flush()


class VerifierClient(_PoolFacade):
    """The verifier's replicas (``ReplicaPool``) behind ``Verifier``."""

    async def verify(self, tasks: list[VerifyTask], timeout_s: float | None = None
                     ) -> VerifyReply:
        batch = verifier_pb2.VerifyRequest(tasks=[_verify_task(t) for t in tasks])
        resp = await self.pool.call(batch, timeout_s)
        return VerifyReply([VerifyResult(r.request_id, list(r.tokens), r.num_accepted, r.resync,
                                         r.preempted, logprobs_from_proto(r.logprobs) if r.logprobs
                                         else None, list(r.token_probs), list(r.head_draft))
                            for r in resp.results],
                           resp.verify_seconds, resp.free_blocks, resp.num_blocks,
                           dict(resp.head_seconds))


class DrafterClient(_PoolFacade):
    """One drafter's replicas (``ReplicaPool``) behind ``Drafter``."""

    async def draft(self, tasks: list[DraftTask], timeout_s: float | None = None) -> DraftReply:
        batch = drafter_pb2.SpeculateRequest(tasks=[_draft_task(t) for t in tasks])
        resp = await self.pool.call(batch, timeout_s)
        return DraftReply([self._result(r) for r in resp.results], resp.draft_seconds)

    def _result(self, res: drafter_pb2.DraftResult) -> DraftResult:
        tree = None
        if len(res.tree.tokens):
            try:
                tree = tree_from_wire(res.tree)
            except ValueError as e:  # the verifier would refuse the whole batch for it
                log.warning("drafter %s: request %s: dropping a malformed draft: %s",
                            self.pool.name, res.request_id, e)
        return DraftResult(res.request_id, tree, res.resync, res.score_matches,
                           res.score_positions, res.score_acceptance,
                           res.score_acceptance_positions)


class DrafterClients(Mapping[str, DrafterClient]):
    """A ``DrafterClient`` per drafter pool, live over the router's dict of pools (discovery adds
    drafters to it, the tokenizer checks remove them)."""

    def __init__(self, pools: dict[str, ReplicaPool]) -> None:
        self.pools = pools
        self._clients: dict[str, DrafterClient] = {}

    def __getitem__(self, name: str) -> DrafterClient:
        pool = self.pools[name]
        client = self._clients.get(name)
        if client is None or client.pool is not pool:
            client = self._clients[name] = DrafterClient(pool)
        return client

    def __iter__(self) -> Iterator[str]:
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)


def _verify_task(t: VerifyTask) -> verifier_pb2.VerifyTask:
    tree: Any = tree_to_wire(t.tree) if t.tree is not None else None
    return verifier_pb2.VerifyTask(request_id=t.request_id, keep=t.keep,
                                   context_delta=t.context_delta, tree=tree,
                                   sampling=sampling_to_proto(t.sampling),
                                   traceparent=t.traceparent, tracestate=t.tracestate,
                                   logprobs=t.logprobs,
                                   head=verifier_pb2.HeadAsk(name=t.head.name, k=t.head.k,
                                                             stored=t.head.stored)
                                   if t.head is not None else None,
                                   allowed=verifier_pb2.TokenMask(
                                       bits=token_mask.to_bytes(t.allowed),
                                       words_per_row=t.allowed.shape[1])
                                   if t.allowed is not None else None,
                                   steps=t.steps, stop_token_ids=t.stop_ids)


def _draft_task(t: DraftTask) -> drafter_pb2.DraftTask:
    return drafter_pb2.DraftTask(request_id=t.request_id, keep=t.keep,
                                 context_delta=t.context_delta, k=t.k, branching=t.branching,
                                 sampling=sampling_to_proto(t.sampling),
                                 traceparent=t.traceparent, tracestate=t.tracestate,
                                 score=t.score, score_from=t.score_from, stop_below=t.stop_below,
                                 context_probs=t.context_probs)
