"""``spin zoo train``: rebuild the corpus, tokenizer and every model of the family from scratch.

Stages run in order and each is skipped when its output already exists (``force`` redoes them), so
an interrupted build resumes where it stopped:

1. ``corpus``    documents from the machine's own files, split train/held-out by hash;
2. ``tokenizer`` byte-level BPE on a balanced sample, then token arrays of every split;
3. ``target``    the target model;
4. ``distill``   the target's greedy continuations of training prompts;
5. ``drafts``    every draft model (human text + distillation data, per its recipe);
6. ``prompts``   the held-out prompt set committed with the family (``heldout_prompts.jsonl``);
7. ``head``      an EAGLE-3 draft head for the target (``head.py``), measured against the best
   general draft on the tuning prompts (last: it needs the drafts and the prompts).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .corpus import build_corpus, sample_excerpts
from .distill import build_distill_data
from .head import HeadSpec
from .specs import DOMAINS, HELDOUT_PROMPTS, FamilySpec
from .tokenizer import encode_corpus, train_tokenizer
from .train import train_model

STAGES = ("corpus", "tokenizer", "target", "distill", "drafts", "prompts", "head")
PROMPTS_PER_DOMAIN = 48
PROMPT_CHARS = 360
REFERENCE_CHARS = 480


def build_family(family: FamilySpec, family_dir: Path, build_dir: Path,
                 stages: tuple[str, ...] = STAGES, force: bool = False,
                 log: Callable[[str], None] = print, head: HeadSpec | None = None) -> None:
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
    if todo("head", family_dir / "eagle" / "training.json"):
        if not (corpus_dir / "manifest.json").exists():
            log(f"[zoo] head: no corpus in {corpus_dir}, building it ...")
            build_corpus(family, corpus_dir)
        _head(family_dir, corpus_dir, build_dir / "head", head or HeadSpec(), log)


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


def _head(family_dir: Path, corpus_dir: Path, data_dir: Path, spec: HeadSpec,
          log: Callable[[str], None]) -> None:
    """Train the target's EAGLE-3 head into ``family_dir / "eagle"`` (via a scratch directory),
    measure it and the general draft on the tuning prompts, and record it all."""
    from ..engine.eagle import EagleHead, default_aux_layers
    from .head import (default_device, draft_vocab, head_drafter, model_drafter, new_head,
                       save_head, train_head, tuning_acceptance)
    from .report import load_model

    target = load_model(family_dir / "target").to(default_device())
    tokenizer = AutoTokenizer.from_pretrained(family_dir / "target")
    layers = target.config.num_hidden_layers
    data, data_s = head_data(target, tokenizer, corpus_dir, data_dir, spec,
                             default_aux_layers(layers))
    ids = draft_vocab(data["tokens"][:, spec.prompt_tokens:], target.config.vocab_size,
                      spec.draft_vocab)
    head = new_head(target.cpu(), ids, spec.seed)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    record = train_head(head, data, embed, lm_head, spec)
    scratch, final = family_dir / ".eagle.partial", family_dir / "eagle"
    shutil.rmtree(scratch, ignore_errors=True)
    save_head(head, scratch)
    loaded = EagleHead.load(scratch, layers)
    general = load_model(family_dir / "draft-general")
    drafters = {"eagle": head_drafter(loaded, embed, 4), "draft-general": model_drafter(general, 4)}
    target.cpu()
    record["acceptance"] = tuning_acceptance(target, tokenizer, family_dir, drafters,
                                             loaded.config.aux_layers)
    last = data["last"][-spec.val_seqs:, spec.prompt_tokens:].float()            # [n, T, Dt]
    argmax = (last @ lm_head.detach().T).argmax(-1)
    record = {"spec": asdict(spec), "data_s": data_s, "draft_vocab_size": len(ids),
              "draft_vocab_coverage": round(loaded.t2d[argmax].float().mean().item(), 4),
              "weights_dtype": "bfloat16", "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "command": f"spin zoo train --stages head --force --head-budget-s {spec.budget_s:g}",
              **record}
    (scratch / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    scratch.rename(final)
    log(f"[zoo] eagle: {record['steps']} steps in {record['train_s']} s; accepted per step "
        f"(k=4) {json.dumps({m: record['acceptance'][m] for m in ('greedy', 'sampled')})}")


def head_data(target, tokenizer, corpus_dir: Path, data_dir: Path, spec: HeadSpec,
              aux: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], float]:
    """The head's training data (``head.build_data``), cached in ``data_dir`` for its recipe;
    returns it and the seconds its build took."""
    from .head import build_data, training_prompts

    recipe = {k: v for k, v in asdict(spec).items() if k in (
        "prompts", "prompt_tokens", "new_tokens", "sampled_share", "temperature", "seed")}
    cache = data_dir / "data.pt"
    if cache.exists():
        saved = torch.load(cache)
        if saved["recipe"] == {**recipe, "aux": list(aux)}:
            return saved["data"], saved["seconds"]
    started = time.perf_counter()
    data = build_data(target, training_prompts(corpus_dir, tokenizer, spec), spec, aux)
    seconds = round(time.perf_counter() - started, 1)
    data_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"recipe": {**recipe, "aux": list(aux)}, "data": data, "seconds": seconds}, cache)
    return data, seconds
