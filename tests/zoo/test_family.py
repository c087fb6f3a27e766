"""The committed demo family: shapes the issue fixes, loadable offline, trained, deterministic."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from spin.zoo.distill import greedy_continue
from spin.zoo.specs import DEMO_FAMILY


def test_every_model_loads_offline_with_auto_classes(family_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in DEMO_FAMILY.models:
        model = AutoModelForCausalLM.from_pretrained(family_dir / spec.name)
        tok = AutoTokenizer.from_pretrained(family_dir / spec.name)
        cfg = model.config
        assert cfg.model_type == "llama"
        assert (cfg.num_hidden_layers, cfg.hidden_size) == (spec.layers, spec.hidden)
        assert cfg.vocab_size == len(tok)


def test_family_shape() -> None:
    target, drafts = DEMO_FAMILY.target, DEMO_FAMILY.drafts
    assert target.layers >= 8 and target.hidden >= 384
    assert len(drafts) >= 3
    assert len({(d.layers, d.hidden) for d in drafts}) >= 3  # sizes differ
    assert len({tuple(sorted(d.mix)) for d in drafts}) >= 3  # training mixes differ


def test_committed_weights_fit_the_budget(family_dir: Path) -> None:
    total = sum(p.stat().st_size for p in family_dir.rglob("*.safetensors"))
    assert total <= 60 * 1024 * 1024, f"{total / 2**20:.1f} MiB of weights"


def test_models_are_trained(family_dir: Path) -> None:
    """Held-out loss far below chance (ln 4096 = 8.3) on every domain a model was trained on."""
    for spec in DEMO_FAMILY.models:
        record = json.loads((family_dir / spec.name / "training.json").read_text())
        assert record["spec"]["mix"] == spec.mix, f"{spec.name} was trained with another recipe"
        first, final = record["curve"][0]["heldout"], record["final_heldout_loss"]
        for domain in spec.mix:
            assert final[domain] < 5.0 and final[domain] < first[domain] - 3, (spec.name, domain)


def test_greedy_generation_is_deterministic_and_matches_generate(
        tokenizer: PreTrainedTokenizerBase, target: PreTrainedModel) -> None:
    prompt = tokenizer(["import os\n\ndef main():\n    "], return_tensors="pt")["input_ids"]
    a = greedy_continue(target, prompt, 24)
    b = greedy_continue(target, prompt, 24)
    assert torch.equal(a, b)
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=24, min_new_tokens=24, pad_token_id=tokenizer.eos_token_id)
    assert torch.equal(a, ref[:, prompt.shape[1]:])
    text = tokenizer.decode(a[0])
    assert len(text.strip()) > 10


@pytest.mark.parametrize("domain", ["code", "prose", "structured"])
def test_target_predicts_heldout_text(family_dir: Path, tokenizer: PreTrainedTokenizerBase,
                                      target: PreTrainedModel, domain: str) -> None:
    rows = [r for r in map(json.loads, (family_dir / "heldout_prompts.jsonl").open())
            if r["domain"] == domain][:4]
    ids = [tokenizer(r["prompt"] + r["reference"], add_special_tokens=False)["input_ids"][:128]
           for r in rows]
    batch = torch.tensor(ids)
    with torch.inference_mode():
        logits = target(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert float(loss) < 5.0, f"{domain} held-out loss {float(loss):.2f}"
