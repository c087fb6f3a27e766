import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spin.zoo.distill import build_distill_data, greedy_continue
from spin.zoo.specs import DEMO_FAMILY, FamilySpec, ModelSpec
from spin.zoo.train import WindowSampler, train_model

TINY = ModelSpec("tiny", "draft", layers=1, hidden=32, intermediate=64, heads=2,
                 mix={"code": 1.0, "prose": 1.0}, distill=0.0, tokens=40 * 4 * 64, lr=5e-3,
                 batch=4, seq_len=64, seed=0)


@pytest.fixture()
def data_dir(tmp_path: Path, tokenizer) -> Path:
    """Token arrays of a highly regular text, so that a tiny model learns it in 40 steps."""
    text = "".join(f"def f{i % 10}(x):\n    return x + {i % 10}\n" for i in range(400))
    ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.uint16)
    for domain in ("code", "prose", "structured"):
        for split in ("train", "heldout"):
            np.save(tmp_path / f"{domain}.{split}.npy", ids)
    return tmp_path


def test_training_lowers_loss_and_saves_a_loadable_checkpoint(tmp_path: Path, data_dir: Path,
                                                              tokenizer) -> None:
    family = FamilySpec(models=(TINY,))
    record = train_model(TINY, family, tokenizer, data_dir, None, tmp_path / "out",
                         device=torch.device("cpu"))
    curve = record["curve"]
    assert curve[-1]["heldout"]["code"] < curve[0]["heldout"]["code"] - 1.0
    saved = json.loads((tmp_path / "out" / "training.json").read_text())
    assert saved["steps"] == 40 and saved["tokens"] == TINY.tokens
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16  # stored compact; loaders ask for fp32 on CPU
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab == tokenizer.vocab


def test_same_seed_same_weights(tmp_path: Path, data_dir: Path, tokenizer) -> None:
    family = FamilySpec(models=(TINY,))
    spec = ModelSpec(**{**TINY.__dict__, "tokens": 3 * 4 * 64})
    for run in ("a", "b"):
        train_model(spec, family, tokenizer, data_dir, None, tmp_path / run, torch.device("cpu"))
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_distilled_spec_needs_distillation_data(data_dir: Path) -> None:
    spec = ModelSpec(**{**TINY.__dict__, "distill": 0.5})
    with pytest.raises(ValueError, match="distill_dir"):
        WindowSampler(spec, data_dir, None)


def test_distillation_rows_are_prompt_plus_target_greedy(tmp_path: Path, data_dir: Path, target,
                                                         tokenizer) -> None:
    family = FamilySpec(models=DEMO_FAMILY.models, distill_prompts={"code": 3},
                        distill_prompt_tokens=16, distill_new_tokens=8)
    counts = build_distill_data(family, target, data_dir, tmp_path, tokenizer.eos_token_id)
    rows = np.load(tmp_path / "code.npy").reshape(3, 16 + 8 + 1)
    assert counts == {"code": rows.size}
    assert (rows[:, -1] == tokenizer.eos_token_id).all()
    prompts = torch.from_numpy(rows[:, :16].astype(np.int64))
    expected = torch.from_numpy(rows[:, 16:24].astype(np.int64))
    assert torch.equal(greedy_continue(target, prompts, 8), expected)
