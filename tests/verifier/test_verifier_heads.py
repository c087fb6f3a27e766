"""A verifier serving a draft head (``--head``), driven with spin.v1 messages: the head drafts
with the verdicts, its stored drafts verify losslessly, it reports its step times, and a task
that asks what it cannot have is refused with the request named."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from transformers import AutoConfig, AutoTokenizer

from spin.engine.eagle import random_head
from spin.engine.model_runner import RunnerConfig
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.rpc.convert import sampling_to_proto, tree_to_proto
from spin.rpc.step_times import Grid, head_times
from spin.v1 import verifier_pb2
from spin.verifier.server import BatchRejected, VerifierService
from spin.zoo.specs import FAMILY_DIR

PATH = FAMILY_DIR / "target"
PROMPT = "def parse(path):\n    with open(path) as f:\n        for line in f:\n"


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("head") / "rh"
    random_head(AutoConfig.from_pretrained(PATH), draft_vocab_size=1000, seed=3).save(out)
    return out


@pytest.fixture(scope="module")
def service(head_dir: Path) -> VerifierService:
    cfg = RunnerConfig(device="cpu", max_seqs=4, kv_cache_memory=32 << 20)
    return VerifierService(PATH, cfg, heads={"rh": str(head_dir)})


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return AutoTokenizer.from_pretrained(PATH).encode(PROMPT, add_special_tokens=False)


def _task(rid: str, keep: int, delta=(), tree: TokenTree | None = None, head=None,
          sampling: SamplingParams = SamplingParams()) -> verifier_pb2.VerifyTask:
    return verifier_pb2.VerifyTask(request_id=rid, keep=keep, context_delta=list(delta),
                                   tree=tree_to_proto(tree or TokenTree((), ())),
                                   sampling=sampling_to_proto(sampling), head=head)


def _decode(service: VerifierService, rid: str, prompt: list[int], n: int, k: int,
            sampling: SamplingParams = SamplingParams()) -> tuple[list[int], int]:
    """``n`` tokens, each step verifying the head's last draft (k = 0: plain steps); the
    draft tokens accepted."""
    out: list[int] = []
    draft: list[int] = []
    accepted = 0
    while len(out) < n:
        keep = len(prompt) + len(out) if out else 0
        head = verifier_pb2.HeadAsk(name="rh", k=k, stored=len(draft)) if k else None
        resp = service.run_batch(verifier_pb2.VerifyRequest(tasks=[_task(
            rid, keep, () if keep else prompt, TokenTree.chain(draft), head, sampling)]))
        (res,) = resp.results
        out += res.tokens
        accepted += res.num_accepted
        draft = list(res.head_draft)
        if k:
            assert len(draft) == k and set(resp.head_seconds) == {"rh"}
    service.run_batch(verifier_pb2.VerifyRequest(release=[rid]))
    return out[:n], accepted


def test_info_names_the_head(service: VerifierService) -> None:
    assert list(service.info().heads) == ["rh"]


def test_greedy_steps_with_head_drafts_equal_plain_steps(service, prompt) -> None:
    plain, _ = _decode(service, "plain", prompt, 20, 0)
    with_head, _ = _decode(service, "head", prompt, 20, 3)
    assert with_head == plain
    assert service.verifier.heads["rh"].cache.blocks.free_seqs == 4  # released with the request


def test_seeded_sampled_steps_with_head_drafts_repeat(service, prompt) -> None:
    sp = SamplingParams(temperature=0.8, seed=11)
    first, _ = _decode(service, "s1", prompt, 16, 2, sp)
    assert _decode(service, "s2", prompt, 16, 2, sp)[0] == first


@pytest.mark.parametrize("bad", ["name", "k", "stored"])
def test_a_task_asking_what_the_head_cannot_give_is_refused(service, prompt, bad: str) -> None:
    head = verifier_pb2.HeadAsk(name="nope" if bad == "name" else "rh",
                                k=17 if bad == "k" else 2, stored=1 if bad == "stored" else 0)
    with pytest.raises(BatchRejected) as e:
        service.run_batch(verifier_pb2.VerifyRequest(tasks=[_task("bad", 0, prompt, head=head)]))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(e.value).startswith("bad: ")
    assert "rh" in str(e.value) or bad != "name"  # it says which heads there are
    assert service.verifier.runner.cache.blocks.free_seqs == 4  # nothing ran


def test_head_step_times_cover_the_grid(service, tmp_path: Path) -> None:
    grid = Grid(batches=(1, 4), ks=(1, 4), contexts=(32,), reps=1)
    samples = head_times(service.verifier.heads["rh"], service.verifier.runner,
                         str(tmp_path), "measure", tmp_path, grid)
    assert sorted((s.batch, s.k) for s in samples) == [(1, 1), (1, 4), (4, 1), (4, 4)]
    assert all(s.drafter == "rh" and s.seconds > 0 for s in samples)
    assert service.verifier.heads["rh"].cache.blocks.free_seqs == 4
