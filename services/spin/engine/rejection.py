"""Verification of a drafted token tree against the target: the lossless acceptance rule.

Rows of the target's output: row 0 is the target's distribution after the last context token
(it scores the tree's first level); row ``i + 1`` the distribution after node i.

Greedy: walk from the root, following the child whose token equals the target's argmax; the first
level without such a child emits the argmax (the correction), a leaf emits the argmax after it
(the bonus token). The output equals target-alone greedy decoding, token for token.

Stochastic (multi-step speculative sampling, SpecInfer; for a chain it is the rule of Leviathan et
al. / Chen et al. as in gpt-fast): at each level, with residual r = p (the target row), try the
children in order; child x drafted from q is accepted with probability min(1, r(x) / q(x)); on
rejection r <- norm(max(0, r - q)). When every child is rejected the level emits a sample of r; a
leaf emits a sample of the target row after it. This keeps the target distribution exactly when the
children of a node are independent draws from q. Tokens chosen deterministically (argmax, top-b,
prompt lookup) are verified as one-hot drafts, q = delta(x): acceptance probability r(x), and a
rejection removes x from r — also exact (for any draft token independent of the target's draws,
so a draft drawn from a distribution the verifier does not see is exact as a one-hot draft too).

Each request draws a fixed number of uniforms from its own generator per step (one per
(level, child slot) and one for the emitted sample, drawn by inverting the CDF), so a seeded
request draws the same numbers whatever shares its batch. On an accelerator the walk runs on the
device without reading a value back (``stochastic_path``: a fixed loop over the tree's levels and
a node's children, with masks); on the CPU, where there is nothing to wait for, the same walk
runs with Python control flow (``walk_host``: a few tensor ops per child instead of a dozen).
``verify_batch`` decides a whole batch and copies the decisions to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .logprobs import TokenLogprobs
from .sampling import SamplingParams, probs_from_logits
from .transfer import to_device
from .tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one request's tree."""

    accepted: tuple[int, ...]
    """Accepted node indices, from the root down (a path of the tree)."""
    tokens: tuple[int, ...]
    """Emitted tokens: the accepted nodes' tokens, then the correction or bonus token."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """The target's log-probabilities of ``tokens``, when the request asked (``logprobs.py``)."""
    token_probs: tuple[float, ...] | None = None
    """Sampling only: each of ``tokens``' probability under the processed target row it was
    emitted from (temperature, top-k, top-p applied). The router sends them with a scoring call,
    so a drafter can estimate its acceptance on the request's sampled output
    (``ModelDrafter.score``)."""
    head_draft: tuple[int, ...] = ()
    """The chain a head drafted for the request's next step, when the task asked
    (``head_runner.py``)."""

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


def walk_greedy(tree: TokenTree, argmax: list[int]) -> Verdict:
    """argmax: the target's argmax of each row, [N + 1] (rows as in the module docstring)."""
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        want = argmax[row]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            tokens = tuple(tree.tokens[i] for i in accepted) + (want,)
            return Verdict(tuple(accepted), tokens)
        accepted.append(nxt)
        node, row = nxt, nxt + 1


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """target_logits: [N + 1, V] (rows as in the module docstring)."""
    return walk_greedy(tree, target_logits.argmax(-1).tolist())


def _children_table(tree: TokenTree) -> tuple[list[list[int]], int, int]:
    """Children of the root (row 0) and of every node (row i + 1), padded with -1 to the widest;
    the width and the depth of the tree."""
    kids: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, p in enumerate(tree.parents):
        kids[p + 1].append(i)
    width = max(1, max(len(k) for k in kids))
    depth = max(tree.depths(), default=0)
    return [k + [-1] * (width - len(k)) for k in kids], width, depth


def _sample(row: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token of the distribution ``row`` [V] (normalised or not) from one uniform ``u`` []."""
    cdf = row.cumsum(-1)                                                                # [V]
    return torch.searchsorted(cdf, (u * cdf[-1])[None], right=True)[0].clamp(max=row.shape[-1] - 1)


def stochastic_path(tree: TokenTree, target_probs: torch.Tensor, uniforms: torch.Tensor,
                    ) -> torch.Tensor:
    """The stochastic rule on the device: [depth + 1] long, the accepted node of each level (-1
    once the walk stopped), then the emitted token. ``target_probs`` [N + 1, V] processed target
    rows; ``uniforms`` [depth * width + 1] (``num_uniforms``)."""
    dev, v = target_probs.device, target_probs.shape[-1]
    table, width, depth = _children_table(tree)
    kids = to_device(table, dev)                                                       # [N + 1, W]
    tokens = to_device(list(tree.tokens) or [0], dev)                                  # [N]
    q_all = None
    if tree.draft_probs is not None and len(tree):
        q_all = tree.draft_probs.to(dev).float()                                       # [N, Vd]
        q_all = q_all / q_all.sum(-1, keepdim=True)
        if q_all.shape[-1] < v:  # a draft vocabulary without the target's padding rows
            q_all = F.pad(q_all, (0, v - q_all.shape[-1]))
    cur = torch.zeros((), dtype=torch.long, device=dev)  # row of the node whose children are tried
    done = torch.zeros((), dtype=torch.bool, device=dev)
    final = torch.zeros((), dtype=torch.long, device=dev)
    path = []
    for d in range(depth):
        r = target_probs[cur]                                                           # [V]
        chosen = torch.full((), -1, dtype=torch.long, device=dev)
        for j in range(width):
            c = kids[cur, j]
            live = (c >= 0) & ~done & (chosen < 0)
            cc = c.clamp(min=0)
            x = tokens[cc]
            q = q_all[cc] if q_all is not None else F.one_hot(x, v).to(r.dtype)        # [V]
            qx, rx = q[x], r[x]
            ratio = torch.where(qx > 0, rx / qx.clamp(min=1e-30), torch.zeros_like(rx))
            accept = live & (uniforms[d * width + j] < ratio)
            chosen = torch.where(accept, cc, chosen)
            rest = (r - q).clamp(min=0.0)
            total = rest.sum()
            # total == 0 only when r == q up to rounding; q then had to be accepted
            rest = torch.where(total > 0, rest / total.clamp(min=1e-30), target_probs[cur])
            r = torch.where(live & ~accept, rest, r)
        step = ~done & (chosen >= 0)
        path.append(torch.where(step, chosen, -1))
        stop = ~done & ~step  # every child rejected, or a leaf: emit a sample of the residual
        final = torch.where(stop, _sample(r, uniforms[-1]), final)
        done = done | stop
        cur = torch.where(step, chosen + 1, cur)
    final = torch.where(done, final, _sample(target_probs[cur], uniforms[-1]))
    return torch.stack(path + [final])


def walk_host(tree: TokenTree, target_probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """``stochastic_path`` with Python control flow (CPU tensors): the same decisions from the
    same uniforms."""
    v = target_probs.shape[-1]
    q_all = None
    if tree.draft_probs is not None and len(tree):
        q_all = tree.draft_probs.float()
        q_all = q_all / q_all.sum(-1, keepdim=True)                                    # [N, Vd]
    _, width, depth = _children_table(tree)
    path: list[int] = []
    node = -1
    for d in range(depth):
        kids = tree.children(node)
        if not kids:
            break
        r = target_probs[node + 1]                                                      # [V]
        chosen = None
        for j, c in enumerate(kids):
            x = tree.tokens[c]
            qx = float(q_all[c, x]) if q_all is not None and x < q_all.shape[-1] else (
                0.0 if q_all is not None else 1.0)
            rx = float(r[x])
            if uniforms[d * width + j] < (rx / qx if qx > 0 else 0.0):
                chosen = c
                break
            if q_all is None:
                rest = r.clone()
                rest[x] = 0.0
            else:
                q = q_all[c] if q_all.shape[-1] == v else F.pad(q_all[c], (0, v - q_all.shape[-1]))
                rest = (r - q).clamp(min=0.0)
            total = float(rest.sum())
            # total == 0 only when r == q up to rounding; q then had to be accepted
            r = rest / total if total > 0 else target_probs[node + 1]
        if chosen is None:
            return path + [int(_sample(r, torch.tensor(uniforms[-1])))]
        path.append(chosen)
        node = chosen
    return path + [int(_sample(target_probs[node + 1], torch.tensor(uniforms[-1])))]


def num_uniforms(tree: TokenTree) -> int:
    """Uniforms the stochastic rule draws for ``tree``: one per (level, child slot), one to emit."""
    _, width, depth = _children_table(tree)
    return depth * width + 1


def _verdict(tree: TokenTree, path: list[int]) -> Verdict:
    """A walk's output (accepted nodes, -1 padding allowed, then the emitted token)."""
    accepted = tuple(int(n) for n in path[:-1] if n >= 0)
    return Verdict(accepted, tuple(tree.tokens[n] for n in accepted) + (int(path[-1]),))


def _decide(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator,
            ) -> torch.Tensor | list[int]:
    """The stochastic walk of one request: on the host for CPU tensors (a list), else on the
    device (a tensor, read back with the batch)."""
    u = torch.rand(num_uniforms(tree), generator=generator, device=generator.device)
    if target_probs.device.type == "cpu":
        return walk_host(tree, target_probs, u.tolist())
    return stochastic_path(tree, target_probs, u.to(target_probs.device))


def verify_stochastic(tree: TokenTree, target_probs: torch.Tensor,
                      generator: torch.Generator) -> Verdict:
    """target_probs: [N + 1, V] processed target distributions (``probs_from_logits``).

    ``tree.draft_probs`` ([N, V'], each node's draft distribution, normalised here) is used when
    present; otherwise every node is a one-hot draft."""
    path = _decide(tree, target_probs, generator)
    return _verdict(tree, path if isinstance(path, list) else path.tolist())


def emitted_probs(target_probs: torch.Tensor, tree: TokenTree, path: torch.Tensor,
                  ) -> torch.Tensor:
    """[D + 1] float: the processed target probability of each token a walk emits, from its
    ``path`` ([D + 1], as ``stochastic_path`` returns it: accepted nodes, -1 once the walk
    stopped, then the emitted token). Emitted token ``j`` is the ``j``-th accepted node's token
    (row 0 for ``j = 0``, the row after the node before it later), then the last entry of
    ``path``; entries past the tokens emitted are padding. On the path's device, no copy."""
    dev = path.device
    nodes = path[:-1]                                                                  # [D]
    final = path[-1:]                                                                  # [1]
    tokens = to_device(list(tree.tokens) or [0], dev)                                  # [N]
    emitted = torch.cat([torch.where(nodes >= 0, tokens[nodes.clamp(min=0)], final), final])
    rows = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), nodes + 1]).clamp(min=0)
    return target_probs[rows, emitted]                                                 # [D + 1]


@dataclass
class PendingVerdicts:
    """A batch's decisions on their way to the host: the device work is queued, the one
    device-to-host copy is non-blocking into pinned memory (on CUDA), and ``verdicts()``
    waits for it (an event) and reads it. Between the two the host may prepare and queue the
    next batch while the device computes this one."""

    trees: list[TokenTree]
    starts: list[int]
    spans: list[tuple[int, int] | tuple[list[int], list[float]] | None]
    """Per request: None (greedy: its argmax rows), (lo, hi) of its sampled path in the copy,
    or a path decided on the host and its token probabilities."""
    lq: int
    host: torch.Tensor
    """The copy (int64) of the argmax rows, sampled paths and probability bits."""
    done: torch.cuda.Event | None = None
    """Recorded after the copy (CUDA); None: the copy is complete already."""

    def ready(self) -> bool:
        """Whether ``verdicts()`` would return without waiting."""
        return self.done is None or self.done.query()

    def verdicts(self) -> list[Verdict]:
        if self.done is not None:
            self.done.synchronize()
        host = self.host.tolist()
        out = []
        for i, (tree, span) in enumerate(zip(self.trees, self.spans)):
            if span is None:
                row0 = i * self.lq + self.starts[i]
                out.append(walk_greedy(tree, host[row0:row0 + len(tree) + 1]))
                continue
            if isinstance(span[0], list):
                path, probs_out = span
            else:
                lo, hi = span
                path = host[lo:hi]
                probs_out = torch.tensor(host[hi:2 * hi - lo], dtype=torch.int32).view(
                    torch.float32).tolist()
            verdict = _verdict(tree, path)
            out.append(replace(verdict, token_probs=tuple(probs_out[:len(verdict.tokens)])))
        return out


def decide_batch(logits: torch.Tensor, starts: list[int], trees: list[TokenTree],
                 sampling: list[SamplingParams], generators: list[torch.Generator],
                 ) -> PendingVerdicts:
    """Queue the decisions of every request of a batch: ``logits`` [B, Lq, V] of one target
    forward, request i's rows from ``starts[i]`` (its last context token) on,
    ``len(trees[i]) + 1`` of them. One copy of the decisions (and of a sampled request's
    ``Verdict.token_probs``, float32 bits in the same long tensor) to the host."""
    argmax = logits.argmax(-1)                                                          # [B, Lq]
    parts, spans = [argmax.flatten()], []
    offset = argmax.numel()
    for i, (tree, params, gen) in enumerate(zip(trees, sampling, generators)):
        if params.greedy:
            spans.append(None)
            continue
        rows = logits[i, starts[i]:starts[i] + len(tree) + 1]                           # [N + 1, V]
        probs = probs_from_logits(rows, params)                                         # [N + 1, V]
        path = _decide(tree, probs, gen)                                                # [D + 1]
        if isinstance(path, list):  # decided on the host: the rows are host memory too
            spans.append((path, emitted_probs(probs, tree, torch.tensor(path)).tolist()))
            continue
        bits = emitted_probs(probs, tree, path).float().view(torch.int32).long()        # [D + 1]
        parts += [path, bits]
        spans.append((offset, offset + len(path)))
        offset += 2 * len(path)
    flat = torch.cat(parts)
    done = None
    if flat.device.type == "cuda":  # the one device-to-host copy, non-blocking
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        host = flat
    return PendingVerdicts(trees, starts, spans, logits.shape[1], host, done)


def verify_batch(logits: torch.Tensor, starts: list[int], trees: list[TokenTree],
                 sampling: list[SamplingParams], generators: list[torch.Generator],
                 ) -> list[Verdict]:
    """``decide_batch``, then its verdicts."""
    return decide_batch(logits, starts, trees, sampling, generators).verdicts()
