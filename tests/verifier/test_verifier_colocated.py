"""A verifier serving a draft model inside it (``--colocate``), driven with spin.v1 messages: the
drafter drafts with the verdicts, its stored drafts verify losslessly, it is listed and timed
like a draft head, and a drafter that cannot load is refused with the reason."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from spin.engine.colocated import Colocated, load_colocated
from spin.engine.model_runner import RunnerConfig
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.rpc import step_times
from spin.rpc.convert import sampling_to_proto, tree_to_proto
from spin.v1 import verifier_pb2
from spin.verifier import server
from spin.verifier.server import VerifierService
from spin.zoo.specs import FAMILY_DIR

PATH = FAMILY_DIR / "target"
DRAFTER = "draft-code"
PROMPT = "def parse(path):\n    with open(path) as f:\n        for line in f:\n"
RUNNER = RunnerConfig(device="cpu", max_seqs=4, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def service() -> VerifierService:
    return VerifierService(PATH, RUNNER, colocated=Colocated({DRAFTER: str(FAMILY_DIR / DRAFTER)},
                                                             "int8"))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return AutoTokenizer.from_pretrained(PATH).encode(PROMPT, add_special_tokens=False)


def _decode(service: VerifierService, rid: str, prompt: list[int], n: int, k: int,
            sampling: SamplingParams = SamplingParams()) -> tuple[list[int], int]:
    """``n`` tokens, each step verifying the drafter's last chain (k = 0: plain steps); the
    drafted tokens accepted."""
    out: list[int] = []
    draft: list[int] = []
    accepted = 0
    while len(out) < n:
        keep = len(prompt) + len(out) if out else 0
        ask = verifier_pb2.HeadAsk(name=DRAFTER, k=k, stored=len(draft)) if k else None
        task = verifier_pb2.VerifyTask(request_id=rid, keep=keep,
                                       context_delta=[] if keep else prompt,
                                       tree=tree_to_proto(TokenTree.chain(draft)),
                                       sampling=sampling_to_proto(sampling), head=ask)
        resp = service.run_batch(verifier_pb2.VerifyRequest(tasks=[task]))
        (res,) = resp.results
        out += res.tokens
        accepted += res.num_accepted
        draft = list(res.head_draft)
        if k:
            assert 1 <= len(draft) <= k and set(resp.head_seconds) == {DRAFTER}
    service.run_batch(verifier_pb2.VerifyRequest(release=[rid]))
    return out[:n], accepted


def test_info_lists_the_drafter_with_the_heads(service: VerifierService) -> None:
    assert list(service.info().heads) == [DRAFTER]


def test_greedy_steps_with_colocated_drafts_equal_plain_steps(service, prompt) -> None:
    plain, _ = _decode(service, "plain", prompt, 32, 0)
    drafted, accepted = _decode(service, "drafted", prompt, 32, 4)
    assert drafted == plain
    assert accepted > 0  # the family's code drafter guesses code
    drafter = service.verifier.heads[DRAFTER].drafter
    assert len(drafter.seqs) == 0 and drafter.runner.cache.blocks.free_seqs == 4  # released


def test_seeded_sampled_steps_with_colocated_drafts_repeat(service, prompt) -> None:
    sp = SamplingParams(temperature=0.8, seed=11)
    first, _ = _decode(service, "s1", prompt, 16, 3, sp)
    assert _decode(service, "s2", prompt, 16, 3, sp)[0] == first


def test_its_step_times_are_reported_as_a_heads(service, monkeypatch, tmp_path: Path) -> None:
    grid = step_times.Grid(batches=(1, 2), tokens=(1,), ks=(1, 4), contexts=(32,), reps=1)
    monkeypatch.setattr(server, "verifier_times",
                        partial(step_times.verifier_times, cache=tmp_path, grid=grid))
    monkeypatch.setattr(server, "drafter_times",
                        partial(step_times.drafter_times, cache=tmp_path, grid=grid))
    service.measure_step_times("measure")
    (reported,) = service.info().head_step_times
    assert reported.head == DRAFTER
    # chains and, at k = 4, a tree: what a drafter service reports
    assert sorted({(s.batch, s.tokens) for s in reported.step_times}) == [(1, 1), (1, 4),
                                                                          (2, 1), (2, 4)]
    assert all(s.seconds > 0 for s in reported.step_times)


def test_a_drafter_that_cannot_load_is_refused_with_the_path(tmp_path: Path) -> None:
    target = RUNNER.load(PATH)
    with pytest.raises(ValueError, match=f"colocated drafter d: no checkpoint at {tmp_path}"):
        load_colocated("d", tmp_path, target, None, RunnerConfig(device="cpu"))
