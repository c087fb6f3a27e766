"""The fast acceptance measurement equals a literal draft-then-verify speculative decode."""

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from spin.engine.prompt_lookup import prompt_lookup
from spin.zoo.acceptance import (PROMPT_LOOKUP, human_window_acceptance, teacher_forced_argmax,
                                 walk_steps)
from spin.zoo.distill import greedy_continue
from spin.zoo.corpus import heldout_prompts


@torch.inference_mode()
def literal_speculative_decode(target: PreTrainedModel, draft: PreTrainedModel | None,
                               prompt: list[int], n_new: int, k: int) -> tuple[list[int], list[int]]:
    """Reference greedy speculative decoding, no caches: returns (new tokens, accepted per step)."""
    seq, steps = list(prompt), []
    while len(seq) - len(prompt) < n_new:
        k_eff = min(k, n_new - (len(seq) - len(prompt)))
        if draft is None:
            proposal = prompt_lookup(seq, k_eff)
        else:
            proposal = []
            for _ in range(k_eff):
                logits = draft(input_ids=torch.tensor([seq + proposal])).logits
                proposal.append(int(logits[0, -1].argmax()))
        verify = target(input_ids=torch.tensor([seq + proposal])).logits[0, len(seq) - 1:].argmax(-1)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == int(verify[accepted]):
            accepted += 1
        seq += proposal[:accepted] + [int(verify[accepted])]
        steps.append(accepted)
    return seq[len(prompt):len(prompt) + n_new], steps


@pytest.mark.parametrize("domain", ["code", "prose", "structured"])
@pytest.mark.parametrize("k", [1, 4])
def test_walk_steps_equals_literal_decode(family_dir, tokenizer: PreTrainedTokenizerBase,
                                          target: PreTrainedModel,
                                          drafts: dict[str, PreTrainedModel], domain: str,
                                          k: int) -> None:
    row = heldout_prompts(family_dir, (domain,))[0]
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][-64:]
    n_new = 40
    cont = greedy_continue(target, torch.tensor([prompt]), n_new)[0].tolist()
    seq = prompt + cont
    t_arg = teacher_forced_argmax(target, torch.tensor([seq]))[0].tolist()
    for name in [*drafts, PROMPT_LOOKUP]:
        draft = drafts.get(name)
        out, literal_steps = literal_speculative_decode(target, draft, prompt, n_new, k)
        assert out == cont, f"{name}: speculative output differs from target-alone greedy"
        d_arg = teacher_forced_argmax(draft, torch.tensor([seq]))[0].tolist() if draft else None
        assert walk_steps(seq, t_arg, len(prompt), k, d_arg) == literal_steps, name


def test_target_drafting_for_itself_accepts_everything(family_dir, tokenizer, target) -> None:
    row = heldout_prompts(family_dir, ("prose",))[0]
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][-48:]
    seq = prompt + greedy_continue(target, torch.tensor([prompt]), 20)[0].tolist()
    t_arg = teacher_forced_argmax(target, torch.tensor([seq]))[0].tolist()
    assert walk_steps(seq, t_arg, len(prompt), 4, t_arg) == [4, 4, 4, 4]  # 4 steps x 5 tokens
    windows = torch.tensor([prompt, prompt[::-1]])
    assert human_window_acceptance(target, target, windows, 3) == [3, 3]


def test_walk_steps_stops_accepting_at_first_mismatch() -> None:
    seq = [0, 1, 2, 3, 4, 5, 6]
    target_argmax = [1, 2, 3, 4, 5, 6, 0]  # the target's greedy path is seq itself
    draft_argmax = [1, 2, 9, 4, 5, 6, 0]   # wrong at position 2
    # step 1 from c=1: proposals d[0..3] = 1,2,9,4 -> accepts 1,2 -> c = 4
    # step 2 from c=4: proposals d[3..5] = 4,5,6 (3 left) -> accepts 3 -> done
    assert walk_steps(seq, target_argmax, 1, 4, draft_argmax) == [2, 3]
