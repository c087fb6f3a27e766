"""``spin bench engine`` on a tiny configuration: chosen on tuning prompts, timed on evaluation
prompts of other documents, every baseline measured, outputs lossless."""

from pathlib import Path

import pytest

from spin.bench.engine import EngineBenchConfig, run_engine_bench
from spin.bench.engine_baselines import HFBaselines, HFMethod, assist_settings
from spin.zoo.corpus import heldout_prompts, prompt_split
from spin.zoo.report import load_model


@pytest.fixture(scope="module")
def tiny(family_dir: Path) -> dict:
    cfg = EngineBenchConfig(family_dir=family_dir, new_tokens=8, domains=("code",),
                            tuning_prompts=1, evaluation_prompts=1, evaluation_rounds=1,
                            drafts=("draft-code", "draft-prose"), ks=(2,), lookup_tokens=(3,),
                            assistant_tokens=(2, 4), library_assist=False,
                            assist_every_draft=False, batches=(1,), batch_rounds=1)
    return run_engine_bench(cfg)


def test_chosen_on_tuning_timed_on_evaluation(tiny: dict, family_dir: Path) -> None:
    ids = tiny["prompt_ids"]
    assert len(ids["tuning"]["code"]) == len(ids["evaluation"]["code"]) == 1
    assert all(prompt_split(i) == "tuning" for i in ids["tuning"]["code"])
    assert all(prompt_split(i) == "evaluation" for i in ids["evaluation"]["code"])
    docs = {s: {i.rsplit("@", 1)[0] for i in ids[s]["code"]} for s in ids}
    assert not docs["tuning"] & docs["evaluation"]
    row = tiny["domains"]["code"]
    # The only candidates of each kind were tried on tuning and the chosen one comes from there.
    assert set(row["tuning"]["spin"]) == {"draft-code", "draft-prose", "prompt-lookup"}
    assert row["chosen"]["spin"]["k"] == 2
    by_drafter = {n: v["2"]["tok_s"] for n, v in row["tuning"]["spin"].items()}
    assert row["chosen"]["spin"]["drafter"] == max(by_drafter, key=by_drafter.get)
    assert row["chosen"]["hf_prompt_lookup"]["prompt_lookup_num_tokens"] == 3
    # Assisted, drafts then settings: both drafts with the first setting, the faster one with both.
    assisted = row["tuning"]["hf_assisted"]
    probe = {n: v["constant-2"] for n, v in assisted.items()}
    fastest = max(probe, key=probe.get)
    assert set(assisted[fastest]) == {"constant-2", "constant-4"}
    assert set(assisted[min(probe, key=probe.get)]) == {"constant-2"}
    best = max(assisted[fastest], key=assisted[fastest].get)
    assert row["chosen"]["hf_assisted"]["draft"] == fastest
    assert row["chosen"]["hf_assisted"]["name"] == best


def test_every_baseline_measured_and_lossless(tiny: dict) -> None:
    row = tiny["domains"]["code"]
    for key in ("target_alone_tok_s", "spin_tok_s", "hf_generate_tok_s", "hf_prompt_lookup_tok_s",
                "hf_assisted_tok_s"):
        assert row["evaluation"][key] > 0, key
    for key in ("vs_target_alone", "vs_hf_generate", "vs_hf_prompt_lookup", "vs_hf_assisted"):
        assert row["ratios"][key] > 0, key
    assert row["ratios"]["vs_hf_generate"] == pytest.approx(
        row["evaluation"]["spin_tok_s"] / row["evaluation"]["hf_generate_tok_s"])
    assert 1.0 <= row["evaluation"]["spin_tau"] <= 3.0  # k = 2: at most 3 tokens per step
    assert tiny["lossless"] is True and tiny["lossless_mismatches"] == []
    assert isinstance(tiny["hf_lossless"], bool)
    assert tiny["batch"]["1"]["spec_on_tok_s"] > 0


def test_assist_settings_reach_the_assistant(family_dir: Path, tokenizer) -> None:
    """transformers reads the assisted settings from the assistant's generation config: a constant
    2 tokens per step needs more target forwards than a constant 8 with a good draft."""
    settings = {s.name: s for s in assist_settings((2, 8), library=True)}
    assert list(settings) == ["constant-2", "constant-8", "heuristic", "default"]
    target = load_model(family_dir / "target")  # fresh models: the shared ones stay untouched
    row = heldout_prompts(family_dir, ("code",), split="tuning")[0]
    prompt = tuple(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][-64:])
    hf = HFBaselines(target, {"draft-code": load_model(family_dir / "draft-code")},
                     tokenizer.eos_token_id)
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = {}
        for name in ("constant-2", "constant-8"):
            calls.clear()
            out[name] = (hf.generate(HFMethod("assisted", draft="draft-code",
                                              assist=settings[name]), prompt, 24), len(calls))
        calls.clear()
        plain = hf.generate(HFMethod("generate"), prompt, 24)
        assert len(calls) == 24
    finally:
        hook.remove()
    assert out["constant-2"][0] == out["constant-8"][0] == plain
    assert out["constant-8"][1] < out["constant-2"][1] <= 24
