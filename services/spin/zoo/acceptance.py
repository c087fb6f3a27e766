"""Greedy speculative acceptance of a drafter against the target, measured exactly and cheaply.

Greedy verification accepts a drafted token iff it equals the target's argmax at that position, and
the first mismatch ends the step (DESIGN: rejection rule, greedy case). Along a sequence that *is*
the target's greedy continuation, a draft's rollout stays on that sequence for as long as it is
accepted, so its proposals equal its teacher-forced argmaxes there. One forward of each model over
the whole sequence therefore gives every step of a speculative decode (``walk_steps``); the tests
check this against a literal draft-then-verify loop.

On human text the continuation is not the target's, so there the drafts roll out for real
(``human_window_acceptance``): contexts are windows of held-out text, the draft proposes k tokens
greedily, and the target scores context + proposals in one forward.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..engine.prompt_lookup import PROMPT_LOOKUP, prompt_lookup  # noqa: F401 (re-export)
from .distill import greedy_continue


@torch.inference_mode()
def teacher_forced_argmax(model: PreTrainedModel, seqs: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 -> [B, T] int64: argmax next token after each prefix ``seqs[:, :j + 1]``."""
    return model(input_ids=seqs).logits.argmax(-1)


def walk_steps(seq: list[int], target_argmax: list[int], prompt_len: int, k: int,
               draft_argmax: list[int] | None = None) -> list[int]:
    """Accepted draft tokens of every verification step of a greedy speculative decode.

    ``seq`` is prompt + the target's greedy continuation; ``target_argmax[j]`` the target's argmax
    after ``seq[:j + 1]``. ``draft_argmax`` likewise for a draft model; ``None`` means prompt lookup.
    Each step proposes ``min(k, remaining)`` tokens, accepts the longest prefix that matches the
    target (and stays on ``seq``), and emits accepted + 1 tokens.
    """
    steps: list[int] = []
    c = prompt_len
    while c < len(seq):
        k_eff = min(k, len(seq) - c)
        if draft_argmax is None:
            proposal = prompt_lookup(seq[:c], k_eff)
        else:
            proposal = draft_argmax[c - 1:c - 1 + k_eff]
        accepted = 0
        for i, tok in enumerate(proposal):
            if tok != target_argmax[c - 1 + i] or seq[c + i] != target_argmax[c - 1 + i]:
                break
            accepted += 1
        steps.append(accepted)
        c += accepted + 1
    return steps


def human_window_acceptance(target: PreTrainedModel, draft: PreTrainedModel | None,
                            windows: torch.Tensor, k: int) -> list[int]:
    """Accepted tokens of one greedy step from each human-text context window.

    windows: [W, L] int64 contexts. The draft (or prompt lookup when ``draft`` is None) proposes k
    tokens; the target scores context + proposals in one forward; returns W accepted counts.
    """
    if draft is None:
        proposals = [prompt_lookup(w.tolist(), k) for w in windows]
    else:
        proposals = greedy_continue(draft, windows, k).tolist()
    out = []
    length = windows.shape[1]
    # Prompt-lookup proposals differ in length: score each window with its own proposal.
    for start in range(0, windows.shape[0], 32):
        rows = proposals[start:start + 32]
        width = max((len(p) for p in rows), default=0)
        padded = torch.tensor([p + [0] * (width - len(p)) for p in rows], dtype=torch.long)
        seqs = torch.cat([windows[start:start + 32], padded.view(len(rows), width)], dim=1)
        argmax = teacher_forced_argmax(target, seqs)[:, length - 1:length - 1 + width]
        for row, prop in zip(argmax.tolist(), rows):
            accepted = 0
            for tok, want in zip(prop, row):
                if tok != want:
                    break
                accepted += 1
            out.append(accepted)
    return out
