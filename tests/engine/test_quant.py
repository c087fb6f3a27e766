"""Int8 draft weights: close to fp32, refused where they cannot run, and lossless in the engine."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spin.engine import quant
from spin.engine.drafter import ModelDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ForwardItem, ModelRunner
from spin.engine.verifier import Verifier
from spin.zoo.corpus import heldout_prompts
from spin.zoo.distill import greedy_continue

pytestmark = pytest.mark.skipif(not quant.available(), reason="no int8 CPU kernels in this torch")
KV = 8 << 20  # KV cache budget of a draft runner here


def test_int8_linear_is_within_its_quantization_error() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.05, torch.randn(96)                         # [N, K], [N]
    x = torch.randn(3, 5, 64)                                                  # [B, L, K]
    want = F.linear(x, w, b)
    got = quant.Int8Linear(w, b)(x)
    assert got.shape == want.shape
    # int8 weights (per row) and int8 activations (per call): a few percent of the output scale
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.03
    assert quant.linear(x, w, b).equal(want)  # an unquantized weight goes through F.linear


def test_resolve_and_bad_settings(family_dir: Path) -> None:
    assert quant.resolve("auto") == "int8" and quant.resolve("none") == "none"
    with pytest.raises(ValueError, match="'auto', 'none' or 'int8'"):
        quant.resolve("int4")
    # auto takes int8 only where it runs: the CPU in float32 ('auto' is float32 there)
    assert quant.resolve("auto", "cpu", "auto") == "int8"
    for device, dtype in (("cpu", "bfloat16"), ("cpu", torch.float16), ("cuda", "auto"),
                          ("cuda:1", torch.float32)):
        assert quant.resolve("auto", device, dtype) == "none"
        assert quant.resolve("none", device, dtype) == "none"
        with pytest.raises(ValueError, match="int8 weights need device='cpu' and dtype=float32"):
            quant.resolve("int8", device, dtype)
    with pytest.raises(ValueError, match="quantize must be"):
        ModelRunner(family_dir / "draft-structured", max_seqs=1, quantize="fp8")
    for dtype in (torch.bfloat16, "float16"):
        with pytest.raises(ValueError, match="float32"):
            ModelRunner(family_dir / "draft-structured", max_seqs=1, dtype=dtype,
                        quantize="int8")


def test_int8_drafter_predicts_what_fp32_predicts_mostly(family_dir: Path, tokenizer) -> None:
    """Greedy next-token predictions over held-out text: int8 agrees with fp32 on nearly all
    (96.5% of 1159 positions when written)."""
    fp32 = ModelRunner(family_dir / "draft-code", max_seqs=1, kv_cache_bytes=KV)
    int8 = ModelRunner(family_dir / "draft-code", max_seqs=1, kv_cache_bytes=KV, quantize="int8")
    agree = total = 0
    for row in heldout_prompts(family_dir)[:12]:
        ids = tuple(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][:100])
        preds = []
        for runner in (fp32, int8):
            seq = runner.cache.blocks.admit("r")
            preds.append(runner.forward([ForwardItem(seq, ids)])[0].argmax(-1))  # [L]
            runner.cache.blocks.free(seq)
            assert runner.cache.blocks.free_blocks == runner.cache.blocks.num_blocks
        agree += int((preds[0] == preds[1]).sum())
        total += len(ids)
    assert agree / total > 0.9, f"{agree}/{total}"


def test_int8_drafters_keep_greedy_output_lossless(family_dir: Path, tokenizer, target) -> None:
    drafters = {n: ModelDrafter(n, ModelRunner(family_dir / n, max_seqs=8, kv_cache_bytes=KV,
                                               quantize="int8"))
                for n in ("draft-code", "draft-prose")}
    engine = SpecEngine(Verifier(ModelRunner(family_dir / "target", max_seqs=8,
                                             kv_cache_bytes=32 << 20)), drafters, eos_id=None)
    rows = heldout_prompts(family_dir)[::25][:8]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][:40] for r in rows]
    prompts = [p for p in prompts if len(p) == 40]
    ref = greedy_continue(target, torch.tensor(prompts), 24).tolist()
    reqs = [GenerationRequest(f"q{i}", tuple(p), 24, drafter=("draft-code", "draft-prose")[i % 2],
                              k=(2, 4, 8)[i % 3], branching=(2,) if i % 4 == 0 else ())
            for i, p in enumerate(prompts)]
    results = engine.generate(reqs)
    assert [r.tokens for r in results] == ref
    assert sum(r.accepted for r in results) > 0  # the int8 drafts were accepted, not bypassed
