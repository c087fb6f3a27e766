"""``spin zoo train``: rebuild the corpus, tokenizer and every model of the family from scratch.

Stages run in order and each is skipped when its output already exists (``force`` redoes them), so
an interrupted build resumes where it stopped:

1. ``corpus``    documents from the machine's own files, split train/held-out by hash;
2. ``tokenizer`` byte-level BPE on a balanced sample, then token arrays of every split;
3. ``target``    the target model;
4. ``distill``   the target's greedy continuations of training prompts;
5. ``drafts``    every draft model (human text + distillation data, per its recipe);
6. ``prompts``   the held-out prompt set committed with the family (``heldout_prompts.jsonl``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .corpus import build_corpus, sample_excerpts
from .distill import build_distill_data
from .specs import DOMAINS, HELDOUT_PROMPTS, FamilySpec
from .tokenizer import encode_corpus, train_tokenizer
from .train import train_model

STAGES = ("corpus", "tokenizer", "target", "distill", "drafts", "prompts")
PROMPTS_PER_DOMAIN = 48
PROMPT_CHARS = 360
REFERENCE_CHARS = 480


def build_family(family: FamilySpec, family_dir: Path, build_dir: Path,
                 stages: tuple[str, ...] = STAGES, force: bool = False,
                 log: Callable[[str], None] = print) -> None:
    """Run the requested stages; outputs go to ``family_dir`` (models) and ``build_dir`` (data)."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; expected some of {STAGES}")
    corpus_dir, data_dir = build_dir / "corpus", build_dir / "tokens"
    tok_dir, distill_dir = build_dir / "tokenizer", build_dir / "distill"

    def todo(stage: str, output: Path) -> bool:
        if stage not in stages:
            return False
        if output.exists() and not force:
            log(f"[zoo] {stage}: {output} exists, skipped (--force redoes it)")
            return False
        log(f"[zoo] {stage} ...")
        return True

    if todo("corpus", corpus_dir / "manifest.json"):
        log(json.dumps(build_corpus(family, corpus_dir)))
    if todo("tokenizer", data_dir / "manifest.json"):
        tok = train_tokenizer(family, corpus_dir, tok_dir)
        log(json.dumps(encode_corpus(tok, corpus_dir, data_dir)))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if tok_dir.exists() else None

    target_dir = family_dir / family.target.name
    if todo("target", target_dir / "training.json"):
        _train(family.target.name, family, tokenizer, data_dir, None, family_dir, log)
    if todo("distill", distill_dir / "done.json"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
        counts = build_distill_data(family, target, data_dir, distill_dir, tokenizer.eos_token_id)
        (distill_dir / "done.json").write_text(json.dumps(counts))
        log(json.dumps(counts))
    for spec in family.drafts:
        if todo("drafts", family_dir / spec.name / "training.json"):
            _train(spec.name, family, tokenizer, data_dir, distill_dir, family_dir, log)
    if todo("prompts", family_dir / HELDOUT_PROMPTS):
        with open(family_dir / HELDOUT_PROMPTS, "w") as f:
            for domain in DOMAINS:
                for ex in sample_excerpts(corpus_dir / f"{domain}.heldout.jsonl", PROMPTS_PER_DOMAIN,
                                          PROMPT_CHARS, REFERENCE_CHARS, family.seed):
                    f.write(json.dumps({"domain": domain, **ex}) + "\n")


def _train(name: str, family: FamilySpec, tokenizer, data_dir: Path, distill_dir: Path | None,
           family_dir: Path, log: Callable[[str], None]) -> None:
    """Train into a scratch directory, then move into place, so a partial model is never loaded."""
    spec = family.get(name)
    final = family_dir / name
    scratch = family_dir / f".{name}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    record = train_model(spec, family, tokenizer, data_dir, distill_dir, scratch)
    shutil.rmtree(final, ignore_errors=True)
    scratch.rename(final)
    log(f"[zoo] {name}: {record['tokens']:,} tokens in {record['wall_s']} s, "
        f"held-out loss {record['final_heldout_loss']}")
