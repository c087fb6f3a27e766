"""Model drafters inside the verifier: a draft model that costs no round trip of its own.

A drafter service is one gRPC call a step before the verifier's: on a CPU or a fast GPU that
call's wire, queues and wake-ups cost about as much as a small model's draft (``spin bench
services``). A *colocated* drafter is the same ``ModelDrafter`` (its own weights, its own paged
KV cache) loaded in the verifier's process, and it drafts the way a draft head does
(``head_runner.py``): right after a step's verdict, for the requests whose task asked it
(``HeadAsk``), from the context the verifier already holds; the chain waits here, its tokens
travel to the router, and the next step the router sends them back as the tree
(``HeadAsk.stored``), verified with the distributions they were drawn from. So the router sees
one more drafter in the verifier (``ModelInfo.heads``), and a step is one call.

The drafter holds each request's context as a drafter service does (``sequences.py``): before a
draft it is brought to the verifier's context (``keep``: the tokens both hold, the rest fed as
catch-up, a chain it drafted kept where it was accepted). Its randomness is its own stream
(``Sequences`` seed offset 1), so sampled output keeps the target's distribution as with any
drafter. It must share the target's vocabulary (``vocab.incompatibility``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .drafter import DraftRequest, ModelDrafter
from .head_runner import DraftTask, FeatureLog, HeadDraft, InVerifierDrafter
from .memory import ModelShape
from .quant import Quantization
from .vocab import TokenizerId, incompatibility, load_identity

if TYPE_CHECKING:
    from .model_runner import ModelRunner, RunnerConfig


@dataclass(frozen=True)
class Colocated:
    """Draft models served inside the verifier (``spin verifier --colocate``)."""

    models: dict[str, str] = field(default_factory=dict)
    """Name -> checkpoint directory."""
    quantize: Quantization = "none"
    """Their weights (``RunnerConfig.quantize``: int8 on the CPU in float32)."""

    def runner(self, target: RunnerConfig) -> RunnerConfig:
        """How they load: the target's device, dtype and graphs, their own weights (their KV
        cache is sized by ``load_colocated``)."""
        return replace(target, quantize=self.quantize)


class ColocatedDrafter(InVerifierDrafter):
    """A ``ModelDrafter`` drafting inside the verifier, as a draft head does
    (``Verifier.heads``)."""

    def __init__(self, drafter: ModelDrafter) -> None:
        super().__init__(drafter.name)
        self.drafter = drafter

    def release(self, request_id: str) -> None:
        """Forget the request (idempotent)."""
        self.drafter.release(request_id)
        self.drafts.pop(request_id, None)

    def rollback(self, request_id: str, valid: int) -> None:
        """Nothing to do: the next draft compares the drafter's context with the verifier's."""

    def _keep(self, request_id: str, context: list[int]) -> int:
        """Context tokens the drafter holds that are the verifier's too."""
        if request_id not in self.drafter.seqs:
            return 0
        held = self.drafter.seqs[request_id].context
        n = min(len(held), len(context))
        if held[:n] == context[:n]:  # the usual case: the verifier's context only grew
            return n
        return next(i for i, (a, b) in enumerate(zip(held, context)) if a != b)

    def draft(self, tasks: list[DraftTask], log: FeatureLog) -> dict[str, HeadDraft]:
        """Each task's chain of ``k`` tokens after its context (one the drafter has no cache
        blocks for gets none). ``log`` is unused: a draft model reads tokens, not states."""
        requests = []
        for t in tasks:
            keep = self._keep(t.request_id, t.context)
            requests.append(DraftRequest(t.request_id, t.context[keep:], t.k,
                                         sampling=t.sampling, keep=keep))
        out = {}
        for t, tree in zip(tasks, self.drafter.propose(requests)):
            if not len(tree):
                self.drafts.pop(t.request_id, None)
                continue
            out[t.request_id] = self.drafts[t.request_id] = HeadDraft(
                len(t.context), tree.tokens, tree.draft_probs)
        return out


def load_colocated(name: str, path: str | Path, target: ModelRunner,
                   target_tokenizer: TokenizerId | None, runner: RunnerConfig) -> ModelDrafter:
    """The draft model at ``path`` beside ``target`` (``runner``: its device, dtype and
    weights), with a KV cache of as many positions as the target's, for requests as long as the
    target's (or its own context, if shorter). ValueError when its vocabulary is not the
    target's (``target_tokenizer``)."""
    from transformers import AutoConfig

    try:
        shape = ModelShape.of(AutoConfig.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as e:
        raise ValueError(f"colocated drafter {name}: no checkpoint at {path} ({e})") from e
    blocks = target.cache.blocks
    positions = blocks.num_blocks * blocks.block_size
    cfg = replace(runner, kv_cache_memory=shape.kv_bytes_per_token(target.dtype) * positions,
                  max_model_len=min(target.max_len, shape.max_position_embeddings),
                  block_size=blocks.block_size)
    identity = load_identity(path)
    drafter = ModelDrafter(name, cfg.load(path, vocab_limit=identity.size if identity else None))
    why = incompatibility(target_tokenizer, target.vocab_size, identity,
                          drafter.runner.vocab_size)
    if why is not None:
        raise ValueError(f"colocated drafter {name} ({path}) cannot draft for this target: {why}")
    return drafter
