"""Predicted Outputs in the router: the proposer (drafts only for requests with a prediction),
the request checks, the learned policy's first-step candidate, the scheduler over fake replicas
(lossless, and the usage it reports), and the embedded deployment over gRPC: a prediction that
is the target's own output is accepted, an edited one still gives the target's output."""

from __future__ import annotations

import asyncio

import pytest
from router.test_scheduler import FakeDrafter, events, expected, request, scheduler, steps
from service_helpers import collect
from service_helpers import request as grpc_request

from spin.engine.prediction import PREDICTION
from spin.engine.sampling import SamplingParams
from spin.engine.suffix_decoding import SUFFIX_DECODING
from spin.policy.base import PROMPT_LOOKUP, FixedPolicy, RequestView, StepChoice
from spin.policy.learned import LearnedPolicy
from spin.router.config import SchedulerConfig
from spin.router.prediction_proposer import PredictedOutputs
from spin.router.requests import RequestParams, RouterRequest
from spin.router.validation import MAX_PREDICTION_CHARS, ClientRequest, SpeculationRequest, validate
from spin.router_main import local_proposers
from spin.stats.store import DrafterStats
from spin.timing.cost_model import CostModel
from spin.v1 import generation_pb2


def _req(rid: str, prediction: tuple[int, ...] = (), generated: list[int] = ()) -> RouterRequest:
    r = RouterRequest(RequestParams(rid, (1, 2, 3), 64, SamplingParams(), prediction=prediction))
    r.generated = list(generated)
    return r


def _draft(p: PredictedOutputs, r: RouterRequest, k: int) -> tuple[int, ...] | None:
    tree = asyncio.run(p.propose([(r, StepChoice(PREDICTION, k))], 1.0)).trees.get(r.request_id)
    return None if tree is None else tree.tokens


# ---- the proposer -------------------------------------------------------------------------------
def test_it_drafts_only_for_requests_with_a_prediction() -> None:
    p = PredictedOutputs()
    assert p.name == PREDICTION and p.model_free and p.available
    plain = _req("a")
    assert p.matches(plain) == 0 and _draft(p, plain, 4) is None
    r = _req("b", prediction=(10, 11, 12, 13, 14, 15))
    assert p.matches(r) == 1 and _draft(p, r, 4) == (10, 11, 12, 13)  # from its first step
    r.generated = [10, 11]
    tree = asyncio.run(p.propose([(r, StepChoice(PREDICTION, 3))], 1.0)).trees["b"]
    assert tree.tokens == (12, 13, 14) and tree.parents == (-1, 0, 1)  # a chain
    r.generated = [10, 11, 99]  # off the prediction: no match, nothing drafted
    assert p.matches(r) == 0 and _draft(p, r, 3) is None
    r.generated = [10, 11, 99, 14]  # back on it, past the replaced token
    assert p.matches(r) == 1 and _draft(p, r, 3) == (15,)


def test_it_scores_the_output_since_the_last_round_and_forgets_on_release() -> None:
    p = PredictedOutputs()
    r = _req("s", prediction=(10, 11, 12, 13, 14, 15), generated=[10, 11, 7, 13])
    score = asyncio.run(p.score([(r, StepChoice(None, 0))], 1.0)).scores["s"]
    assert (score.drafter, score.matches, score.positions) == (PREDICTION, 2, 4)
    r.generated += [14, 15]
    score = asyncio.run(p.score([(r, StepChoice(None, 0))], 1.0)).scores["s"]
    assert (score.matches, score.positions) == (2, 2)  # 13 re-aligned: 14 and 15 predicted
    plain = _req("n")
    assert asyncio.run(p.score([(plain, StepChoice(None, 0))], 1.0)).scores["n"].positions == 0
    p.release("s")
    again = _req("s", prediction=(20, 21, 22))  # the same id, another request
    assert _draft(p, again, 2) == (20, 21)


def test_it_is_a_local_proposer_by_default_and_can_be_turned_off() -> None:
    names = [q.name for q in local_proposers(SchedulerConfig())]
    assert PREDICTION in names and PROMPT_LOOKUP in names
    assert PREDICTION not in [q.name for q in local_proposers(
        SchedulerConfig(predicted_outputs=False))]


# ---- the request checks -------------------------------------------------------------------------
def _validate(**kw) -> RouterRequest:
    return validate(ClientRequest(prompt="ab", max_tokens=4, **kw),
                    lambda text: [ord(c) % 100 for c in text], 64, 100,
                    lambda: {PROMPT_LOOKUP, PREDICTION})


def test_the_prediction_is_tokenized_like_the_prompt_and_checked() -> None:
    assert _validate(prediction="xyz").params.prediction == (20, 21, 22)
    assert _validate().params.prediction == ()
    assert len(_validate(prediction="x" * MAX_PREDICTION_CHARS).params.prediction) == \
        MAX_PREDICTION_CHARS  # longer than the context is fine: it is only drafted from
    with pytest.raises(ValueError, match=f"prediction has {MAX_PREDICTION_CHARS + 1} "
                                         f"characters; at most {MAX_PREDICTION_CHARS}"):
        _validate(prediction="x" * (MAX_PREDICTION_CHARS + 1))
    named = SpeculationRequest(mode="drafter", drafter=PREDICTION, k=4)
    assert _validate(prediction="xyz", speculation=named).params.drafter == PREDICTION
    with pytest.raises(ValueError, match="drafts from the request's prediction"):
        _validate(speculation=named)


# ---- the learned policy -------------------------------------------------------------------------
def test_the_learned_policy_offers_it_from_the_first_step_only_with_a_prediction() -> None:
    cost = CostModel(verify=(0.010, 0.0, 1e-4, 0.0, 0.0),
                     draft={"draft-code": (0.0, 0.001, 0.0, 0.0)})
    stats = DrafterStats(drafts=100, draft_tokens=400, accepted_tokens=380, draft_seconds=0.4,
                         verify_seconds=1.1)
    policy = LearnedPolicy(cost=cost, population=lambda: {PREDICTION: stats})
    available = {"draft-code", PROMPT_LOOKUP, SUFFIX_DECODING, PREDICTION}
    try:
        view = RequestView("p", 200, 0, 100, True, lookup_match=False,
                           free_branches=((SUFFIX_DECODING, 0), (PREDICTION, 1)))
        (c,) = policy.choose([view], available)
        assert c.drafter == PREDICTION and c.k > 0
        none = RequestView("q", 200, 0, 100, True, lookup_match=False,
                           free_branches=((SUFFIX_DECODING, 0), (PREDICTION, 0)))
        (c,) = policy.choose([none], available)
        assert c.drafter is None  # no prediction (no other match): no model-free draft
    finally:
        policy.close()


# ---- the scheduler over fake replicas (the toy target goes on +1) -------------------------------
@pytest.mark.parametrize("edit", ["exact", "insertion", "deletion"])
def test_the_scheduler_drafts_the_prediction_losslessly_and_reports_its_usage(edit) -> None:
    prompt, n = (11, 12, 13, 14), 30
    want = expected(prompt, n)
    prediction = {"exact": want, "insertion": want[:10] + want[16:],  # the output has 6 more
                  "deletion": want[:10] + [1, 2, 3] + want[10:]}[edit]
    sched = scheduler(FixedPolicy(PREDICTION, 4), drafters={"fake": FakeDrafter(2)},
                      local=(PredictedOutputs(),))
    r = request("p", prompt, max_tokens=n, prediction=tuple(prediction))
    plain = request("q", prompt, max_tokens=n)

    async def go() -> None:
        sched.submit(r)
        sched.submit(plain)
        await steps(sched)
    asyncio.run(go())
    assert r.generated == plain.generated == want  # lossless
    t = r.tally.drafters[PREDICTION]
    last = events(r)[-1]
    assert last.usage.accepted_prediction_tokens == t.accepted_tokens > 0
    assert last.usage.rejected_prediction_tokens == t.draft_tokens - t.accepted_tokens
    if edit == "exact":
        assert t.accepted_tokens == t.draft_tokens == 24 and t.steps == 6  # 6 x (4 + 1) = 30
    else:
        assert t.accepted_tokens >= 16
    assert PREDICTION not in plain.tally.drafters  # nothing to draft from
    assert events(plain)[-1].usage.accepted_prediction_tokens == 0


# ---- the embedded deployment (the shared ``serving`` fixture) -----------------------------------
PROMPT = "class Table:\n    def __init__(self, rows):\n        # predicted outputs test\n"


def _usage(last: generation_pb2.GenerateResponse) -> tuple[int, int]:
    return last.usage.accepted_prediction_tokens, last.usage.rejected_prediction_tokens


def test_a_prediction_of_the_output_is_accepted_and_changes_nothing(serving) -> None:
    off, text, last_off = collect(serving.endpoint, grpc_request(
        PROMPT, max_tokens=40, mode="off", ignore_eos=True))
    assert len(off) == 40 and text and _usage(last_off) == (0, 0)
    # mode auto first: no request has drafted from a prediction yet, so the drafter is new to
    # the policy (an optimistic prior: it is tried)
    auto, _, last = collect(serving.endpoint, grpc_request(
        PROMPT, max_tokens=40, ignore_eos=True, prediction=text))
    assert auto == off
    accepted, rejected = _usage(last)
    assert accepted > 0, last.speculation
    mine = [d for d in last.speculation.drafters if d.drafter == PREDICTION]
    assert (accepted, rejected) == (mine[0].accepted_tokens,
                                    mine[0].draft_tokens - mine[0].accepted_tokens)
    named, _, last = collect(serving.endpoint, grpc_request(
        PROMPT, max_tokens=40, mode="drafter", drafter=PREDICTION, k=8, ignore_eos=True,
        prediction=text))
    assert named == off
    accepted, rejected = _usage(last)
    assert accepted >= 30 and rejected <= 8, last  # most of the output came from the prediction
    assert [d.drafter for d in last.speculation.drafters] == [PREDICTION]


def test_an_edited_prediction_still_gives_the_targets_output(serving) -> None:
    prompt = PROMPT + "        # edited\n"
    off, text, _ = collect(serving.endpoint, grpc_request(prompt, max_tokens=40, mode="off",
                                                          ignore_eos=True))
    third = len(text) // 3
    edited = text[:third] + " inserted words here " + text[third + 5:]  # and 5 characters less
    for mode, drafter in (("drafter", PREDICTION), ("auto", "")):
        ids, _, last = collect(serving.endpoint, grpc_request(
            prompt, max_tokens=40, mode=mode, drafter=drafter, k=6 if drafter else 0,
            ignore_eos=True, prediction=edited))
        assert ids == off, mode
        if drafter:
            accepted, rejected = _usage(last)
            assert accepted > 0 and accepted + rejected == last.speculation.draft_tokens


def test_a_too_long_prediction_and_a_named_drafter_without_one_are_invalid(serving) -> None:
    import grpc

    for req, message in ((grpc_request("x", max_tokens=4, prediction="y" * (
            MAX_PREDICTION_CHARS + 1)), "prediction has"),
                         (grpc_request("x", max_tokens=4, mode="drafter", drafter=PREDICTION),
                          "has none")):
        with pytest.raises(grpc.RpcError) as err:
            collect(serving.endpoint, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()


def test_spin_generate_names_the_drafter_and_reads_the_prediction_from_a_file(
        serving, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from spin.cli import main

    prompt = PROMPT + "        # from the command line\n"
    off, text, _ = collect(serving.endpoint, grpc_request(prompt, max_tokens=24, mode="off"))
    path = tmp_path / "predicted.txt"
    path.write_text(text)
    assert main(["generate", prompt, "--max-tokens", "24", "--endpoint", serving.endpoint,
                 "--speculation", PREDICTION, "--k", "8", "--prediction", f"@{path}"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == text.rstrip("\n") and f"drafters: {PREDICTION} (" in err
    assert main(["generate", prompt, "--prediction", f"@{tmp_path / 'none.txt'}"]) == 2
    assert "--prediction @" in capsys.readouterr().err
