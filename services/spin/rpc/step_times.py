"""A service's own step times: measured on itself at start (or loaded from the cache of an
earlier start) and reported in its ``ModelInfo``, so that every router fits its cost model from
what its replicas report. No profile step anywhere: ``spin serve`` and the Helm chart alike.

The verifier times target forwards over a grid of (batch, new tokens, context), a drafter its
draft calls over (batch, k, context): ``spin profile --quick``'s grid (``timing/measure.py``),
with the threads, cores, device, dtype and weights the service serves with, in its own process.
Points the KV cache cannot hold at once are left out. The measurement takes tens of seconds on
a CPU and is cached under ``$XDG_CACHE_HOME/spin/step-times/`` (``~/.cache`` without it), keyed
by everything it depends on (the model's files, device, dtype, weights, threads, cores, torch's
version, the grid), so a restart loads it. Services sharing that directory (``spin serve``'s,
all on one machine) measure one at a time, under a lock file there: measured at once, each
would time the others' work too (``spin bench policy --quick`` on 2 cores: the verifier's fit
error 31% so, 8.7% one at a time; the learned policy 237 against 256 tokens/s).

A cached grid is a prior, not the truth: a start that loads it first times one point of the
grid again (``_check_grid``, under the same lock) and measures the whole grid afresh when the
cache ran slower than now by more than ``STALE`` (it was measured while something else loaded
the cores: another process only ever makes a call slower, so the faster is the machine's own).
Where now is the slower, the cache is kept; the router's online calibration follows the load
of the moment (``policy/calibration.py``). Found so: an entry measured beside a busy machine
(the target's verification at batch 1 of 5 tokens 39.3 ms against 14.0 ms idle) was loaded by
every later start, and the controller drafted shorter chains all day.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from ..engine.drafter import ModelDrafter
from ..engine.head_runner import HeadRunner
from ..engine.model_runner import ModelRunner
from ..timing.cost_model import DraftSample, VerifySample
from ..timing.measure import STEADY_TOLERANCE, profile_draft, profile_head, profile_verify
from ..v1 import model_info_pb2

log = logging.getLogger(__name__)

StepTimesMode = Literal["auto", "measure", "off"]
"""auto: load from the cache, else measure and cache; measure: always measure; off: none (the
router then needs a cost model file, or plans k from its batch-size table)."""


@dataclass(frozen=True)
class Grid:
    """What a service measures (``spin profile --quick``'s grid)."""

    batches: tuple[int, ...] = (1, 4, 16, 32)
    tokens: tuple[int, ...] = (1, 5, 9)
    """New tokens per request of a verification forward."""
    ks: tuple[int, ...] = (1, 4, 8)
    """Levels of a draft call."""
    contexts: tuple[int, ...] = (64, 384)
    reps: int = 3


MEASURE_VERSION = 4
"""What the measurement measures (2: tree points beside the chains; 3: one service at a time;
4: each point the fastest of timings that agree, ``timing.measure.steady_time``);
part of the cache key."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spin" / "step-times"


def _key(role: str, runner: ModelRunner, model_path: str, grid: Grid, quantized: bool) -> str:
    """What the measurement depends on, hashed."""
    path = Path(model_path)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                   for p in path.iterdir() if p.is_file()) if path.is_dir() else model_path
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [MEASURE_VERSION, role, str(path.resolve()) if path.exists() else model_path, files,
             str(runner.device), str(runner.dtype), quantized, torch.get_num_threads(), cores,
             torch.__version__, asdict(grid)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


STALE = (1 + STEADY_TOLERANCE) ** 2
"""A cached grid is measured again when every point timed again at start ran slower in the
cache than now by more than this: two measurements of one call, each its fastest of timings that
agree within ``STEADY_TOLERANCE``, differ by at most about that much on a quiet machine."""


def _check_grid(grid: Grid) -> Grid:
    """The point a start times again against its cache: the grid's first batch and context and
    its middle token count or k (a chain and, where the grid times one there, a tree)."""
    return Grid(batches=grid.batches[:1], tokens=(grid.tokens[len(grid.tokens) // 2],),
                ks=(grid.ks[len(grid.ks) // 2],), contexts=grid.contexts[:1], reps=grid.reps)


def _point(row: dict) -> tuple:
    """A measured row's grid point (everything but its time and its drafter's name)."""
    return tuple(sorted((k, v) for k, v in row.items() if k not in ("seconds", "drafter")))


def slower_than_now(cached: list[dict], now: list[dict]) -> float | None:
    """How much slower the cache timed the points ``now`` timed again: the smallest ratio of
    cached to current seconds over the points both hold (None where they share none)."""
    old = {_point(r): r["seconds"] for r in cached}
    ratios = [old[_point(r)] / r["seconds"] for r in now
              if _point(r) in old and r["seconds"] > 0]
    return min(ratios) if ratios else None


def _load(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("step times in %s unreadable (%s): measuring again", path, e)
        return None


Timed = Callable[[Grid, tqdm], list]
"""Times a grid's points (``timing/measure.py``), advancing a progress bar: the samples."""


def _cached(key: str, timed: Timed, grid: Grid, points: int, what: str, mode: StepTimesMode,
            cache: Path | None) -> list[dict]:
    """The rows of ``grid`` (``points`` of them; ``what`` names them on the progress bar): from
    the cache where its check point timed now finds it no slower than now beyond ``STALE``,
    else measured and cached."""
    path = (cache or cache_dir()) / f"{key}.json"
    with _one_at_a_time(path.parent):
        rows = _load(path) if mode == "auto" else None
        if rows is not None:
            now = [asdict(s) for s in timed(_check_grid(grid), tqdm(disable=True))]
            ratio = slower_than_now(rows, now)
            if ratio is None or ratio <= STALE:
                return rows
            log.warning("step times cached in %s ran %.2fx slower than this machine now (measured"
                        " while something else loaded it): measuring again", path, ratio)
        with tqdm(total=points, desc=f"measuring {what}", unit="point", file=sys.stderr,
                  mininterval=2.0) as bar:
            rows = [asdict(s) for s in timed(grid, bar)]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(path)
        except OSError as e:  # a read-only home: measured each start, served all the same
            log.warning("cannot cache step times in %s: %s", path, e)
    return rows


@contextlib.contextmanager
def _one_at_a_time(directory: Path) -> Iterator[None]:
    """Hold the machine's measurement lock (a lock file in ``directory``; none where it cannot
    be made: then measure anyway)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".measure.lock", "a+")
    except OSError:
        yield
        return
    with lock:
        try:
            import fcntl

            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another service on this machine to finish measuring")
                fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (not POSIX): measure anyway
            pass
        yield  # closing the file releases the lock


def verifier_times(runner: ModelRunner, model_path: str, mode: StepTimesMode = "auto",
                   cache: Path | None = None, grid: Grid = Grid()) -> list[VerifySample]:
    """The verifier's forwards over the grid (measured or cached; [] with mode off)."""
    if mode == "off":
        return []

    rows = _cached(_key("verifier", runner, model_path, grid, False),
                   lambda g, bar: profile_verify(runner, g.batches, g.tokens, g.contexts, g.reps,
                                                 bar),
                   grid, len(grid.contexts) * len(grid.batches) * len(grid.tokens),
                   "verify steps", mode, cache)
    return [VerifySample(**r) for r in rows]


def drafter_times(drafter: ModelDrafter, model_path: str, mode: StepTimesMode = "auto",
                  cache: Path | None = None, grid: Grid = Grid(), quantized: bool = False,
                  ) -> list[DraftSample]:
    """The drafter's calls over the grid (measured or cached; [] with mode off)."""
    return _draft_times(
        drafter.name, "drafter", drafter.runner, model_path, mode, cache, grid, quantized,
        f"{drafter.name}'s draft steps",
        lambda g, bar: profile_draft(drafter.name, drafter, g.batches, g.ks, g.contexts, g.reps,
                                     bar))


def head_times(head: HeadRunner, target: ModelRunner, model_path: str,
               mode: StepTimesMode = "auto", cache: Path | None = None, grid: Grid = Grid()
               ) -> list[DraftSample]:
    """A draft head's drafts inside the verifier of ``target`` over the grid (measured or
    cached; [] with mode off)."""
    c = head.head.config
    return _draft_times(
        head.name, "head", target, model_path, mode, cache, grid, False,
        f"head {head.name}'s drafts",
        lambda g, bar: profile_head(head.name, head, len(c.aux_layers) * c.target_hidden_size,
                                    g.batches, g.ks, g.contexts, g.reps, bar))


def _draft_times(name: str, role: str, runner: ModelRunner, model_path: str,
                 mode: StepTimesMode, cache: Path | None, grid: Grid, quantized: bool,
                 what: str, profile: Timed) -> list[DraftSample]:
    """Draft calls of drafter or head ``name`` (``profile`` times them over a grid, ``what``
    names them on the progress bar), measured or cached."""
    if mode == "off":
        return []
    rows = _cached(_key(role, runner, model_path, grid, quantized), profile, grid,
                   len(grid.contexts) * len(grid.batches) * len(grid.ks), what, mode, cache)
    return [DraftSample(**{**r, "drafter": name}) for r in rows]


def to_proto(samples: list[VerifySample] | list[DraftSample]) -> list[model_info_pb2.StepTime]:
    """Samples as ``ModelInfo.step_times`` (tokens: new tokens scored, or k)."""
    return [model_info_pb2.StepTime(
        batch=s.batch, tokens=s.scored_tokens if isinstance(s, VerifySample) else s.k,
        context_tokens=s.context_tokens, seconds=s.seconds, tree=s.tree) for s in samples]


def verify_from_proto(info: model_info_pb2.ModelInfo) -> list[VerifySample]:
    return [VerifySample(t.batch, t.tokens, t.context_tokens, t.seconds, t.tree)
            for t in info.step_times if t.batch > 0 and t.seconds > 0 and t.tokens >= t.batch]


def draft_from_proto(name: str, info: model_info_pb2.ModelInfo | model_info_pb2.HeadStepTimes
                     ) -> list[DraftSample]:
    return [DraftSample(name, t.batch, t.tokens, t.context_tokens, t.seconds, t.tree)
            for t in info.step_times if t.batch > 0 and t.seconds > 0 and t.tokens >= 0]
