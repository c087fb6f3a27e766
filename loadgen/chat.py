"""``python -m loadgen.chat``: a multi-turn chat workload with one shared system prompt.

Chat and agent traffic repeats itself: every request of a deployment starts with the same system
prompt (instructions, tool descriptions), and every turn of a conversation repeats the turns
before it. This writes such a workload as a ``--dataset`` file (JSON Lines, one ``prompt`` a
line): ``conversations`` conversations of ``turns`` turns each, every request the system prompt
(``system_tokens`` tokens of the target's tokenizer), the conversation so far (user turns and
fixed assistant replies) and a new user turn. Text comes from a prompt file (by default the
evaluation half of ``benchmarks/datasets/unseen-long.jsonl``: text from outside the demo
corpus), cut at token boundaries. Rows carry ``domain`` ``chat-turn<t>`` and ``conversation``.

    python -m loadgen.chat --out chat.jsonl
    python -m loadgen --dataset chat.jsonl --max-concurrency 32 --num-prompts 96
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from spin.zoo.specs import FAMILY_DIR

from .datasets import DEFAULT_SOURCE, read_prompts, write_jsonl



@dataclass(frozen=True)
class ChatShape:
    """What the workload looks like."""

    system_tokens: int = 500
    """Tokens of the shared system prompt."""
    conversations: int = 48
    turns: int = 2
    """Requests per conversation (turn t repeats turns 1..t-1 and their replies)."""
    user_tokens: int = 60
    """Tokens of each user turn."""
    reply_tokens: int = 40
    """Tokens of each assistant reply written into later turns."""
    seed: int = 0


def make_chat(texts: list[str], tokenizer, shape: ChatShape = ChatShape()) -> list[dict]:
    """The workload's rows (conversation by conversation, turn by turn) from ``texts``."""
    if not texts:
        raise ValueError("no source text")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rng = random.Random(shape.seed)

    def cut(n: int) -> str:
        """``n`` tokens of one source text (from a random start), as text."""
        src = rng.choice([x for x in ids if len(x) >= n] or [max(ids, key=len)])
        start = rng.randrange(max(1, len(src) - n + 1))
        return tokenizer.decode(src[start:start + n]).strip()

    system_ids: list[int] = []
    for x in ids:
        system_ids += x
        if len(system_ids) >= shape.system_tokens:
            break
    if len(system_ids) < shape.system_tokens:
        raise ValueError(f"the source text holds {len(system_ids)} tokens, fewer than the "
                         f"system prompt's {shape.system_tokens}")
    system = "System: " + tokenizer.decode(system_ids[:shape.system_tokens]).strip()
    rows = []
    for c in range(shape.conversations):
        history = system
        for t in range(1, shape.turns + 1):
            prompt = f"{history}\n\nUser: {cut(shape.user_tokens)}\n\nAssistant:"
            rows.append({"prompt": prompt, "domain": f"chat-turn{t}", "conversation": c,
                         "split": "evaluation"})
            history = f"{prompt} {cut(shape.reply_tokens)}"
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON Lines file to write")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                   help="prompt file the text comes from (its evaluation half, where it has one)")
    p.add_argument("--tokenizer", type=Path, default=FAMILY_DIR / "target",
                   help="the target's tokenizer (token counts are its tokens)")
    d = ChatShape()
    for name in ("system_tokens", "conversations", "turns", "user_tokens", "reply_tokens",
                 "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    try:
        texts = [r["prompt"] for r in read_prompts(args.source)
                 if r.get("split", "evaluation") == "evaluation"]
        shape = ChatShape(args.system_tokens, args.conversations, args.turns, args.user_tokens,
                          args.reply_tokens, args.seed)
        rows = make_chat(texts, AutoTokenizer.from_pretrained(args.tokenizer), shape)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} requests ({shape.conversations} conversations x {shape.turns} "
          f"turns) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
