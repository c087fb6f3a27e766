"""``spin demo``: the demo family generating text in this process, no services needed.

The target streams a continuation of one held-out prompt per domain (greedy or sampled, token by
token), then the demo shows how many tokens per step each drafter would have had accepted: the
selection problem the SPIN policy solves. ``spin serve`` + ``spin generate`` do it for real.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .acceptance import PROMPT_LOOKUP, teacher_forced_argmax, walk_steps
from .corpus import heldout_prompts
from .report import family_members, load_model
from .specs import DOMAINS


@torch.inference_mode()
def stream_tokens(model: PreTrainedModel, prompt_ids: list[int], max_tokens: int,
                  temperature: float = 0.0, seed: int | None = None,
                  eos_id: int | None = None) -> Iterator[int]:
    """Yield generated token ids one by one (greedy when ``temperature`` is 0)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"the model's context of {limit} tokens")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = DynamicCache()
    logits = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True).logits
    for _ in range(max_tokens):
        last = logits[0, -1]  # [V]
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        else:
            nxt = int(last.argmax())
        yield nxt
        if nxt == eos_id:
            return
        logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits


def stream_text(tok: PreTrainedTokenizerBase, ids: Iterator[int]) -> Iterator[str]:
    """Text deltas of a token stream; holds back partial UTF-8 characters."""
    out: list[int] = []
    shown = ""
    for i in ids:
        if i == tok.eos_token_id:
            break
        out.append(i)
        text = tok.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown):]
            shown = text


def demo(family_dir: Path, max_tokens: int = 96, k: int = 4, out: TextIO = sys.stdout) -> None:
    """One held-out prompt per domain: stream the target's continuation, then per-drafter acceptance."""
    tok = AutoTokenizer.from_pretrained(family_dir / "target")
    target = load_model(family_dir / "target")
    drafts = {n: load_model(family_dir / n) for n in family_members(family_dir)}
    for domain in DOMAINS:
        row = heldout_prompts(family_dir, (domain,))[0]
        prompt_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"][-96:]
        out.write(f"\n=== {domain}: {row['id']} ===\n{tok.decode(prompt_ids)}")
        out.write("\033[1m")
        gen: list[int] = []
        for delta in stream_text(tok, _collect(stream_tokens(target, prompt_ids, max_tokens,
                                                             eos_id=tok.eos_token_id), gen)):
            out.write(delta)
            out.flush()
        out.write("\033[0m\n")
        seq = prompt_ids + gen
        t_arg = teacher_forced_argmax(target, torch.tensor([seq]))[0].tolist()
        cells = []
        for name in [*drafts, PROMPT_LOOKUP]:
            d_arg = (teacher_forced_argmax(drafts[name], torch.tensor([seq]))[0].tolist()
                     if name in drafts else None)
            steps = walk_steps(seq, t_arg, len(prompt_ids), k, d_arg)
            cells.append(f"{name} {sum(steps) / len(steps):.2f}")
        out.write(f"--- accepted tokens per step at k={k}: " + ", ".join(cells) + "\n")


def _collect(stream: Iterator[int], into: list[int]) -> Iterator[int]:
    for i in stream:
        into.append(i)
        yield i
