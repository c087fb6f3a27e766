"""Predicted Outputs' alignment (``engine/prediction.py``): the prediction's next tokens where the
output stands in it, through an exact copy, an insertion, a deletion, a replacement, a repeat
and a prediction unrelated to the output; incremental and whole-output alike."""

from __future__ import annotations

import random

from spin.engine.prediction import PREDICTION, PredictionAligner, prediction_draft

PRED = tuple(range(100, 140))
"""A prediction of 40 distinct tokens (each occurs once: an alignment is unambiguous)."""


def _walk(prediction: tuple[int, ...], output: list[int], k: int = 4) -> list[list[int]]:
    """The draft before each output token, taking the output in one token at a time."""
    a, drafts = PredictionAligner(prediction), []
    for i in range(len(output)):
        a.extend(output[:i])
        drafts.append(a.propose(k))
    return drafts


def test_the_name_and_the_start_before_any_output() -> None:
    assert PREDICTION == "prediction"
    assert prediction_draft(PRED, [], 5) == list(PRED[:5])
    assert prediction_draft((), [], 5) == [] and prediction_draft(PRED, [], 0) == []


def test_an_exact_copy_is_drafted_all_the_way_and_scores_every_position() -> None:
    out = list(PRED)
    drafts = _walk(PRED, out, 4)
    assert all(d == out[i:i + 4] for i, d in enumerate(drafts))
    a = PredictionAligner(PRED)
    a.extend(out)
    assert a.propose(4) == [] and not a.has_draft()  # at the prediction's end
    assert a.score(0, 1000) == (40, 40) and a.score(30, 1000) == (10, 10)
    assert a.score(0, 8) == (8, 8)  # the last max_positions only


def test_an_insertion_pauses_the_draft_and_rejoining_resumes_it() -> None:
    out = list(PRED[:10]) + [1, 2, 3] + list(PRED[10:])
    a = PredictionAligner(PRED)
    a.extend(out[:10])
    assert a.propose(3) == list(PRED[10:13])
    a.extend(out[:11])  # the inserted span begins: nothing to draft, the pointer stays
    assert a.propose(3) == [] and a.pointer == 10 and not a.aligned
    a.extend(out[:13])
    assert a.propose(3) == []
    a.extend(out[:14])  # back on the prediction where it left it
    assert a.propose(3) == list(PRED[11:14]) and a.aligned
    a.extend(out)
    assert a.score(0, 1000) == (39, 43)  # not predicted: the 3 inserted tokens and the
    # token that rejoined (no draft while off the prediction)


def test_a_deletion_skips_ahead_to_where_the_output_goes_on() -> None:
    out = list(PRED[:10]) + list(PRED[18:])  # the output leaves 8 tokens out
    assert prediction_draft(PRED, out[:11], 3) == list(PRED[19:22])
    far = list(PRED[:5]) + list(PRED[30:])  # 25 left out: past a single token's reach
    assert prediction_draft(PRED, far[:6], 3) == []
    assert prediction_draft(PRED, far[:7], 3) == list(PRED[32:35])  # two tokens re-align


def test_a_replacement_realigns_after_the_replaced_token() -> None:
    out = list(PRED[:10]) + [7] + list(PRED[11:])
    assert prediction_draft(PRED, out[:11], 3) == []
    assert prediction_draft(PRED, out[:12], 3) == list(PRED[12:15])


def test_the_longest_tail_wins_and_ties_prefer_ahead_of_the_pointer() -> None:
    pred = (1, 2, 3, 9, 4, 5, 2, 3, 8, 6, 2, 3, 7)
    # after "... 5 2 3" the pointer is at 8; the output goes "5 2 3 7" instead: "2 3 7" occurs
    # at the end only (the longest tail), and "7" follows
    assert prediction_draft(pred, [1, 2, 3, 9, 4, 5, 2, 3, 7], 2) == []  # at the end
    # "2 3" occurs three times: from the pointer's place the nearest ahead wins
    a = PredictionAligner(pred)
    a.extend([1, 2, 3, 9, 4, 5])
    a.extend([1, 2, 3, 9, 4, 5, 0, 2, 3])  # an inserted 0, then "2 3": the one at 6..7
    assert a.propose(2) == [8, 6]
    b = PredictionAligner(pred)
    b.extend([1, 2, 3, 9, 4, 5, 2, 3, 8, 6, 2, 3, 7, 0, 2, 3])  # past the end: the last one
    assert b.propose(2) == [7]


def test_an_unrelated_prediction_drafts_nothing() -> None:
    rng = random.Random(0)
    out = [rng.randrange(0, 90) for _ in range(60)]
    drafts = _walk(PRED, out, 4)
    assert drafts[0] == list(PRED[:4])  # before any output it is the only guess
    assert all(d == [] for d in drafts[1:])
    a = PredictionAligner(PRED)
    a.extend(out)
    assert a.score(0, 1000) == (0, 60)


def test_incremental_and_whole_output_agree() -> None:
    rng = random.Random(1)
    pred = tuple(rng.randrange(0, 30) for _ in range(200))  # repeats: ambiguous alignments
    out = list(pred[:50]) + [rng.randrange(0, 30) for _ in range(5)] + list(pred[70:150])
    a = PredictionAligner(pred)
    for i in range(len(out) + 1):
        a.extend(out[:i])
        assert a.propose(6) == prediction_draft(pred, out[:i], 6), i
    assert a.seen == len(out) and len(a.hits) == len(out)
