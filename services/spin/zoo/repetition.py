"""How repetitive a token sequence is: distinct-token share and the share of tokens in exact loops.

``spin zoo report`` measures both on the target's greedy continuations of the held-out prompts and
on the human text that follows the same prompts, so a reader sees how far the target's output (what
speculative decoding, and prompt lookup above all, is measured on) is from human text.

Definitions (pure functions of token ids):

- **distinct share**: distinct token ids / tokens.
- **in a loop**: for a period ``p`` (1 to ``max_period``), the token at position ``j`` is a *copy*
  if ``j >= p`` and ``tokens[j] == tokens[j - p]``. A maximal run of consecutive copies at period
  ``p``, positions ``[c, e)``, makes ``tokens[c - p:e]`` a periodic span. The span is a loop if the
  run covers at least one whole unit (``e - c >= p``: the unit of ``p`` tokens occurs at least
  twice in a row) and the span has at least ``min_span`` tokens (so a doubled token, such as
  ``))``, is no loop). The copies ``[c, e)`` are in the loop; the unit's first occurrence is not
  (it is new text, what follows it is predictable by copying). A token is in a loop if it is at
  any period. So ``[1, 2, 3, 1, 2, 3, 1, 2, 3]`` has 6 of 9 tokens in a loop, ``[1, 2, 3, 4]``
  none, ``[1, 2, 3, 1, 2, 4]`` none (the second unit differs in one token).
- **loop share**: tokens in a loop / tokens.

Per request, then averaged over requests (each request weighs the same).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_PERIOD = 32
MIN_SPAN = 4


def distinct_share(tokens: Sequence[int]) -> float:
    """Distinct token ids / tokens (0 for an empty sequence)."""
    return len(set(tokens)) / len(tokens) if tokens else 0.0


def loop_mask(tokens: Sequence[int], max_period: int = MAX_PERIOD,
              min_span: int = MIN_SPAN) -> list[bool]:
    """For each token, whether it lies in an exact loop (module docstring)."""
    n = len(tokens)
    mask = [False] * n
    for p in range(1, min(max_period, n // 2) + 1):
        j = p
        while j < n:
            if tokens[j] != tokens[j - p]:
                j += 1
                continue
            c = j  # a run of copies at period p: [c, e)
            while j < n and tokens[j] == tokens[j - p]:
                j += 1
            if j - c >= p and j - c + p >= min_span:
                mask[c:j] = [True] * (j - c)
    return mask


def loop_share(tokens: Sequence[int], max_period: int = MAX_PERIOD,
               min_span: int = MIN_SPAN) -> float:
    """Tokens in a loop / tokens (0 for an empty sequence)."""
    return sum(loop_mask(tokens, max_period, min_span)) / len(tokens) if tokens else 0.0


def repetition_stats(sequences: Sequence[Sequence[int]]) -> dict:
    """Mean distinct share and loop share over non-empty sequences, with their count and tokens."""
    seqs = [s for s in sequences if s]
    if not seqs:
        return {"distinct_share": 0.0, "loop_share": 0.0, "requests": 0, "tokens": 0}
    return {"distinct_share": round(sum(map(distinct_share, seqs)) / len(seqs), 4),
            "loop_share": round(sum(map(loop_share, seqs)) / len(seqs), 4),
            "requests": len(seqs), "tokens": sum(map(len, seqs))}


def compare_with_human(generated: dict[str, list[list[int]]], human: dict[str, list[list[int]]]
                       ) -> dict:
    """``repetition_stats`` per domain and overall (every request of every domain) of the target's
    output and of the human text after the same prompts.

    ``generated[domain][i]`` and ``human[domain][i]`` belong to one prompt; both are cut to the
    shorter of the two, so the distinct share (lower for longer text) compares like with like.
    """
    out: dict = {"target": {}, "human": {}}
    pooled: dict[str, list[list[int]]] = {"target": [], "human": []}
    for domain, gen in generated.items():
        pairs = [(g[:min(len(g), len(h))], h[:min(len(g), len(h))])
                 for g, h in zip(gen, human[domain], strict=True)]
        for i, side in enumerate(("target", "human")):
            seqs = [pair[i] for pair in pairs]
            out[side][domain] = repetition_stats(seqs)
            pooled[side] += seqs
    for side, seqs in pooled.items():
        out[side]["overall"] = repetition_stats(seqs)
    return out


def markdown(rep: dict) -> str:
    """The repetition table as Markdown: one row per domain and overall."""
    lines = [("| domain | distinct share (target) | distinct share (human) | in loops (target) "
              "| in loops (human) | tokens compared |"), "|---|---|---|---|---|---|"]
    for domain, t in rep["target"].items():
        h = rep["human"][domain]
        lines.append(f"| {domain} | {t['distinct_share']:.3f} | {h['distinct_share']:.3f} | "
                     f"{t['loop_share']:.3f} | {h['loop_share']:.3f} | {t['tokens']} |")
    lines += ["", ("Target: its greedy continuation of each held-out prompt (up to EOS); human: "
                   "the text that follows the prompt, both cut to the shorter. Distinct share = "
                   "distinct token ids / tokens; in loops = share of tokens that copy the token p "
                   f"back inside a run repeating a unit of p <= {MAX_PERIOD} tokens at least twice "
                   f"in a row (span >= {MIN_SPAN} tokens; the unit's first occurrence not "
                   "counted); means over requests.")]
    return "\n".join(lines)
