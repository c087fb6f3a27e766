import io

import pytest
import torch

from spin.zoo.demo import demo, stream_text, stream_tokens
from spin.zoo.distill import greedy_continue


def test_greedy_stream_equals_greedy_continuation(tokenizer, target) -> None:
    prompt = tokenizer("The file is opened", add_special_tokens=False)["input_ids"]
    streamed = list(stream_tokens(target, prompt, 16))
    assert streamed == greedy_continue(target, torch.tensor([prompt]), 16)[0].tolist()


def test_seeded_sampling_is_reproducible(tokenizer, target) -> None:
    prompt = tokenizer("import", add_special_tokens=False)["input_ids"]
    a = list(stream_tokens(target, prompt, 24, temperature=1.0, seed=11))
    assert a == list(stream_tokens(target, prompt, 24, temperature=1.0, seed=11))
    assert a != list(stream_tokens(target, prompt, 24, temperature=1.0, seed=12))


def test_bad_prompts_are_refused(target) -> None:
    with pytest.raises(ValueError, match="empty"):
        next(stream_tokens(target, [], 4))
    with pytest.raises(ValueError, match="context"):
        next(stream_tokens(target, [1] * 1000, 100))


def test_stream_text_never_splits_a_character(tokenizer) -> None:
    text = "naïve 日本語 🙂 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = list(stream_text(tokenizer, iter(ids + [tokenizer.eos_token_id, 5])))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_demo_streams_every_domain(family_dir) -> None:
    out = io.StringIO()
    demo(family_dir, max_tokens=8, out=out)
    text = out.getvalue()
    for domain in ("code", "prose", "structured"):
        assert f"=== {domain}:" in text
    assert text.count("accepted tokens per step at k=4") == 3
    assert "prompt-lookup" in text
