"""``spin profile``: measure verify and draft step times on this machine and fit the cost model.

Verification: one target forward over ``batch`` requests, each scoring ``tokens`` new tokens after a
context of ``context`` tokens (the grid below). Drafting: one drafter call drafting a chain of k for
``batch`` requests after a context (catch-up of the last token included, as in serving). Each point
is the median of a few repetitions. The fitted ``CostModel`` (``timing/cost_model.py``) is written
as JSON with its fit error (MAPE) on the measured points; the router's speculation-length
controller reads it, and its batch-size -> k table comes from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig

from ..engine.drafter import ModelDrafter
from ..engine.kv_cache import BLOCK_SIZE
from ..engine.memory import ModelShape, resolve_device, resolve_dtype
from ..engine.model_runner import ModelRunner, RunnerConfig
from ..engine.quant import Quantization
from ..policy.k_table import k_table
from ..timing.cost_model import CostModel
from ..timing.measure import profile_draft, profile_verify
from ..zoo.report import family_members
from ..zoo.specs import BUILD_DIR, FAMILY_DIR

DEFAULT_COST_MODEL = BUILD_DIR.parent / "cost_model.json"


@dataclass
class ProfileConfig:
    """The measurement grid."""

    family_dir: Path = FAMILY_DIR
    quick: bool = False
    """A smaller grid (about a minute on 2 cores)."""
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tokens: tuple[int, ...] = (1, 3, 5, 9)
    """New tokens scored per request (tree size + 1)."""
    contexts: tuple[int, ...] = (64, 256, 512)
    draft_ks: tuple[int, ...] = (1, 2, 4, 8)
    reps: int = 5
    drafters: list[str] | None = None
    """Draft models of the family to profile (default: all in the family)."""
    target: str | None = None
    """The target's checkpoint (path or name); None: the family's."""
    drafter_models: dict[str, str] | None = None
    """Draft models to profile, name -> checkpoint (path or name); None: the family's."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Device and dtype of the models, as the services run them (the cache is sized here)."""
    threads: int = 0
    """Torch threads while timing verification (0 = torch's default); give what the verifier gets
    in serving (``spin serve`` gives it 2)."""
    drafter_threads: int = 0
    """Torch threads while timing the drafters (0 = torch's default); give what each drafter gets
    in serving (``spin serve`` gives each 1)."""
    drafter_quantize: Quantization = "none"
    """The draft models' weights, as the drafters serve them (``spin drafter --quantize``);
    recorded in the model file."""
    out: Path = field(default_factory=lambda: DEFAULT_COST_MODEL)

    def grid(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
        if self.quick:
            return (1, 4, 16, 32), (1, 5, 9), (64, 384), (1, 4, 8), 3
        return self.batches, self.tokens, self.contexts, self.draft_ks, self.reps


def run_profile(cfg: ProfileConfig) -> dict:
    batches, tokens, contexts, ks, reps = cfg.grid()
    fam = cfg.family_dir
    paths = cfg.drafter_models if cfg.drafter_models is not None else {
        n: str(fam / n) for n in (cfg.drafters if cfg.drafters is not None else family_members(fam))}
    names = sorted(paths)
    # a cache that holds the largest batch at the longest context, whatever the default budget
    room = max(batches) * (max(contexts) + max(max(tokens), max(ks)) + 2 * BLOCK_SIZE)

    def runner(path: str, quantize: Quantization = "none") -> ModelRunner:
        conf = AutoConfig.from_pretrained(path)
        dtype = resolve_dtype(cfg.runner.dtype, resolve_device(cfg.runner.device),
                              getattr(conf, "dtype", None))
        shape = ModelShape.of(conf)
        return replace(cfg.runner, max_seqs=max(batches), quantize=quantize,
                       kv_cache_memory=room * shape.kv_bytes_per_token(dtype)).load(path)

    target = runner(str(cfg.target or fam / "target"))
    drafters = {n: ModelDrafter(n, runner(paths[n], cfg.drafter_quantize)) for n in names}
    total = len(contexts) * len(batches) * (len(tokens) + len(names) * len(ks))
    default_threads = torch.get_num_threads()
    try:
        with tqdm(total=total, desc="profile", unit="point") as bar:
            torch.set_num_threads(cfg.threads or default_threads)
            verify = profile_verify(target, batches, tokens, contexts, reps, bar)
            torch.set_num_threads(cfg.drafter_threads or default_threads)
            draft = [s for n, d in drafters.items()
                     for s in profile_draft(n, d, batches, ks, contexts, reps, bar)]
    finally:
        torch.set_num_threads(default_threads)
    model = CostModel.fit(verify, draft)
    errors = model.mape(verify, draft)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(cfg.out)
    raw = json.loads(cfg.out.read_text())  # keep the fit error beside the coefficients
    raw["fit_mape"] = errors
    raw["drafter_quantize"] = cfg.drafter_quantize
    raw["threads"] = cfg.threads or default_threads
    raw["models"] = {"target": str(cfg.target or fam / "target"), "drafters": paths,
                     "device": cfg.runner.device, "dtype": cfg.runner.dtype}
    cfg.out.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    table = k_table(model, {n: 0.7 for n in names}, batches, max(ks), contexts[0])
    return {"out": str(cfg.out), "mape": errors, "verify_points": len(verify),
            "draft_points": len(draft), "k_table_at_acceptance_0.7": table}
