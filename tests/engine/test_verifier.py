"""The verifier and drafters under churn: random admit / draft / verify / rollback / free."""

import random
from pathlib import Path

import torch

from spin.engine.drafter import DraftRequest, ModelDrafter, PromptLookupDrafter
from spin.engine.model_runner import ModelRunner
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest

SLOTS = 4


def test_random_operations_leak_no_slot_and_keep_outputs_equal(family_dir: Path, target) -> None:
    rng = random.Random(3)
    verifier = Verifier(ModelRunner(family_dir / "target", num_slots=SLOTS, max_len=192))
    drafters = {"code": ModelDrafter("code", ModelRunner(family_dir / "draft-code", num_slots=SLOTS)),
                "lookup": PromptLookupDrafter()}
    live: dict[str, list[int]] = {}
    checked = 0
    for op_index in range(1000):
        op = rng.choice(["admit", "step", "step", "step", "rollback", "free"])
        if op == "admit" and len(live) < SLOTS:
            live[f"r{op_index}"] = [rng.randrange(1, 4000) for _ in range(rng.randint(1, 12))]
        elif op == "rollback" and live:  # the context shrinks (e.g. a client edits history)
            rid = rng.choice(sorted(live))
            live[rid] = live[rid][:rng.randint(1, len(live[rid]))]
        elif op == "free" and live:
            rid = rng.choice(sorted(live))
            del live[rid]
            verifier.release(rid)
            for d in drafters.values():
                d.release(rid)
        elif op == "step" and live:
            batch = rng.sample(sorted(live), rng.randint(1, len(live)))
            trees = {}
            for rid in batch:
                name = rng.choice(["code", "lookup", None])
                k = rng.randint(1, 4)
                if name and len(live[rid]) + k + 1 < 192:
                    req = DraftRequest(rid, tuple(live[rid]), k, (2,) if rng.random() < 0.3 else ())
                    trees[rid] = drafters[name].propose([req])[0]
                else:
                    trees[rid] = TokenTree((), ())
            verdicts = verifier.verify([VerifyRequest(rid, tuple(live[rid]), trees[rid]) for rid in batch])
            for rid, v in zip(batch, verdicts):
                ctx = list(live[rid])
                with torch.inference_mode():
                    for tok in v.tokens:  # every emitted token is the target's greedy choice
                        assert tok == int(target(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
                        ctx.append(tok)
                        checked += 1
                live[rid] = ctx if len(ctx) < 150 else ctx[:20]
        in_use = SLOTS - verifier.runner.cache.free_slots
        assert in_use == len(verifier.slots) <= len(live)
        assert SLOTS - drafters["code"].runner.cache.free_slots == len(drafters["code"].slots)
    for rid in list(live):
        verifier.release(rid)
        drafters["code"].release(rid)
    assert verifier.runner.cache.free_slots == SLOTS
    assert drafters["code"].runner.cache.free_slots == SLOTS
    assert checked > 300
