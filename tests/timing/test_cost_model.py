"""CostModel: fitting, prediction, persistence and the Synergy batch-size → k table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spin.policy.base import PROMPT_LOOKUP
from spin.timing.cost_model import CostModel, DraftSample, VerifySample, nnls

TRUE_V = (2e-3, 1e-5, 2e-5, 1e-7, 1e-9, 3e-3)
TRUE_D = {"small": (5e-4, 3e-4, 2e-6, 1e-9, 1e-4), "big": (1e-3, 8e-4, 5e-6, 3e-9, 0.0)}
TRUE_PL = 2e-5


def _tv(b: int, s: int, c: int) -> float:
    c0, c1, c2, c3, c4, c5 = TRUE_V
    return c0 + c1 * b + c2 * s + c3 * c + c4 * s * c / b + c5 * (s > 1)


def _td(name: str, b: int, k: int, c: int) -> float:
    if name == PROMPT_LOOKUP:
        return TRUE_PL * b
    d0, d1, d2, d3, d4 = TRUE_D[name]
    return d0 + k * (d1 + d2 * b + d3 * c + d4 * np.log2(b))


def _samples(n: int = 150, noise: float = 0.0,
             seed: int = 0) -> tuple[list[VerifySample], list[DraftSample]]:
    rng = np.random.default_rng(seed)
    vs, ds = [], []
    for i in range(n):
        b = 1 if i % 10 == 0 else int(rng.integers(1, 65))  # some lone-token forwards
        s = b + (0 if i % 20 == 0 else int(rng.integers(0, 8 * b + 1)))
        c = b * int(rng.integers(10, 4000))
        vs.append(VerifySample(b, s, c, _tv(b, s, c) * (1 + noise * rng.standard_normal())))
        for name in [*TRUE_D, PROMPT_LOOKUP]:
            k = int(rng.integers(1, 9))
            t = _td(name, b, k, c) * (1 + noise * rng.standard_normal())
            ds.append(DraftSample(name, b, k, c, t))
    return vs, ds


def test_fit_recovers_exact_coefficients() -> None:
    vs, ds = _samples()
    m = CostModel.fit(vs, ds)
    np.testing.assert_allclose(m.verify, TRUE_V, rtol=1e-6)
    for name, coef in TRUE_D.items():
        np.testing.assert_allclose(m.draft[name], coef, rtol=1e-6)
    assert m.prompt_lookup_s == pytest.approx(TRUE_PL, rel=1e-9)
    assert m.verify_samples == 150
    assert m.draft_samples == {"big": 150, PROMPT_LOOKUP: 150, "small": 150}
    err = m.mape(vs, ds)
    assert set(err) == {"verify", "small", "big", PROMPT_LOOKUP, "overall"}
    assert max(err.values()) < 1e-9


def test_fit_with_noise_has_small_mape() -> None:
    vs, ds = _samples(noise=0.01, seed=1)
    m = CostModel.fit(vs, ds)
    assert all(x >= 0 for x in m.verify)
    for part, e in m.mape(vs, ds).items():
        assert e < 0.02, part
    fresh_v, fresh_d = _samples(n=50, noise=0.01, seed=2)  # held out
    assert m.mape(fresh_v, fresh_d)["overall"] < 0.02


def test_fit_is_non_negative() -> None:
    # Data generated with a negative per-request term: the fit clips it to 0 and stays close.
    rng = np.random.default_rng(3)
    vs = []
    for _ in range(100):
        b = int(rng.integers(1, 33))
        s = b * int(rng.integers(1, 6))
        c = b * 500
        vs.append(VerifySample(b, s, c, 1e-2 - 1e-5 * b + 1e-4 * s))
    m = CostModel.fit(vs)
    assert min(m.verify) >= 0.0
    assert m.verify[1] == 0.0
    assert m.mape(vs)["verify"] < 0.05


def test_nnls_matches_unconstrained_when_feasible_and_clips_otherwise() -> None:
    rng = np.random.default_rng(4)
    a = rng.random((40, 3))
    x_true = np.array([0.5, 2.0, 1.0])
    np.testing.assert_allclose(nnls(a, a @ x_true), x_true, rtol=1e-10)
    x = nnls(a, a @ np.array([1.0, -1.0, 0.5]))
    assert (x >= 0).all() and x[1] == 0.0


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CostModel.fit([], [])
    with pytest.raises(ValueError, match="invalid"):
        CostModel.fit([VerifySample(2, 2, 10, 0.0)])
    with pytest.raises(ValueError, match="invalid"):
        CostModel.fit([VerifySample(1, 1, 10, 1.0)], [DraftSample("x", 0, 1, 1, 1.0)])


def test_draft_samples_with_k0_are_ignored() -> None:
    vs, ds = _samples(n=20)
    m = CostModel.fit(vs, [*ds, DraftSample("small", 4, 0, 100, 5.0)])
    assert m.draft_samples["small"] == 20
    np.testing.assert_allclose(m.draft["small"], TRUE_D["small"], rtol=1e-6)


def _model() -> CostModel:
    return CostModel(verify=TRUE_V, draft=dict(TRUE_D))


def test_predictions() -> None:
    m = _model()
    assert m.predict_verify(4, 12, 4000) == pytest.approx(_tv(4, 12, 4000))
    assert m.predict_verify(0, 0, 0) == 0.0
    assert m.predict_draft("small", 4, 3, 4000) == pytest.approx(_td("small", 4, 3, 4000))
    assert m.predict_draft("small", 4, 0, 4000) == 0.0
    assert m.predict_draft(PROMPT_LOOKUP, 8, 5, 10_000) == pytest.approx(8e-5)  # default 1e-5/req
    assert m.predict_draft(PROMPT_LOOKUP, 8, 0, 10_000) == 0.0
    with pytest.raises(KeyError, match="nope"):
        m.predict_draft("nope", 1, 1, 1)
    assert m.has_drafter(PROMPT_LOOKUP) and m.has_drafter("big") and not m.has_drafter("nope")


def test_a_forward_over_more_than_one_row_pays_the_step_once() -> None:
    """c5: one request scoring one token is the lone cheap forward; a second token, or a
    second request, pays the step once, and more of either do not pay it again."""
    m = _model()
    c5 = TRUE_V[5]
    linear = CostModel(verify=TRUE_V[:5])  # a model file from before the term: c5 = 0
    assert linear.verify == (*TRUE_V[:5], 0.0)
    assert m.predict_verify(1, 1, 300) == pytest.approx(linear.predict_verify(1, 1, 300))
    for b, s in ((1, 2), (1, 5), (2, 2), (2, 4), (8, 8)):
        assert m.predict_verify(b, s, 300 * b) == pytest.approx(
            linear.predict_verify(b, s, 300 * b) + c5)
    scored = np.array([1.0, 2.0, 5.0])  # the controller's arrays of scored tokens
    np.testing.assert_allclose(m.predict_verify(1, scored, 300),
                               linear.predict_verify(1, scored, 300) + c5 * (scored > 1))


def test_fit_finds_the_multi_row_step() -> None:
    """Fitted on a lone request's 1, 5 and 9 tokens and batches of 4 (the services' start-up
    grid), the step lands on c5, not on every token: 2 tokens are predicted within 1%."""
    vs = [VerifySample(b, b * n, b * c, _tv(b, b * n, b * c))
          for b in (1, 4, 16) for n in (1, 5, 9) for c in (64, 384)]
    m = CostModel.fit(vs)
    assert m.verify[5] == pytest.approx(TRUE_V[5], rel=1e-3)
    assert m.predict_verify(1, 2, 300) == pytest.approx(_tv(1, 2, 300), rel=0.01)


def test_a_padded_forward_costs_every_request_the_longest_rows_and_context() -> None:
    m = CostModel(verify=(0.01, 1e-3, 1e-4, 1e-6, 1e-8))
    # 3 requests padded to 200 new tokens and 500 of context: 600 rows over 1500 context tokens
    assert m.predict_padded_verify(3, 200, 500) == pytest.approx(m.predict_verify(3, 600, 1500))
    assert m.predict_padded_verify(3, 200, 500) == pytest.approx(
        0.01 + 3e-3 + 600e-4 + 1500e-6 + 600 * 500e-8)
    assert isinstance(m.predict_padded_verify(1, 1, 1), float)


def test_ragged_draft_reduces_to_uniform() -> None:
    m = _model()
    ctx = [100, 2000, 700]
    assert m.predict_draft_ragged("big", [3, 3, 3], ctx) == pytest.approx(
        m.predict_draft("big", 3, 3, sum(ctx)))
    # Levels 1..2 over three requests, level 3 over one: cheaper than everyone at 3.
    assert m.predict_draft_ragged("small", [3, 3, 3], ctx) == pytest.approx(
        m.predict_draft("small", 3, 3, sum(ctx)))
    d0, d1, d2, d3, _ = TRUE_D["big"]
    want = d0 + 3 * d1 + d2 * (2 + 2 + 3) + d3 * (2 * 100 + 2 * 2000 + 3 * 700)
    assert m.predict_draft_ragged("big", [2, 2, 3], ctx) == pytest.approx(want)
    # The log term counts the requests in the call, at the call's largest k.
    d0, d1, d2, d3, d4 = TRUE_D["small"]
    want = d0 + 3 * (d1 + d4 * np.log2(2)) + d2 * (3 + 1) + d3 * (3 * 100 + 1 * 700)
    assert m.predict_draft_ragged("small", [3, 0, 1], ctx) == pytest.approx(want)
    assert m.predict_draft_ragged("big", [0, 0, 0], ctx) == 0.0
    assert m.predict_draft_ragged(PROMPT_LOOKUP, [0, 4, 1], ctx) == pytest.approx(2e-5)


def test_predict_monotone_in_batch_and_tokens() -> None:
    m = _model()
    ctx, k = 1500, 3
    verify = [m.predict_verify(b, b * (k + 1), b * ctx) for b in range(1, 129)]
    assert all(x < y for x, y in zip(verify, verify[1:]))
    scored = [m.predict_verify(8, s, 8 * ctx) for s in range(8, 80)]
    assert all(x < y for x, y in zip(scored, scored[1:]))
    context = [m.predict_verify(8, 32, c) for c in range(0, 80_000, 1000)]
    assert all(x < y for x, y in zip(context, context[1:]))
    for name in TRUE_D:
        by_b = [m.predict_draft(name, b, k, b * ctx) for b in range(1, 129)]
        by_k = [m.predict_draft(name, 8, kk, 8 * ctx) for kk in range(0, 9)]
        assert all(x < y for x, y in zip(by_b, by_b[1:]))
        assert all(x < y for x, y in zip(by_k, by_k[1:]))


def test_save_load_round_trip(tmp_path: Path) -> None:
    vs, ds = _samples(n=30, noise=0.01)
    m = CostModel.fit(vs, ds)
    p = tmp_path / "cost.json"
    m.save(p)
    raw = json.loads(p.read_text())
    assert raw["version"] == 1
    assert raw["samples"] == {"verify": 30, "draft": {"big": 30, PROMPT_LOOKUP: 30, "small": 30}}
    back = CostModel.load(p)
    assert back == m
    assert back.predict_verify(3, 9, 3000) == m.predict_verify(3, 9, 3000)


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    ("{not json", "not JSON"),
    (b"\xff\xfe\x00garbage", "unreadable or not JSON"),
    ("[1, 2]", "malformed"),
    ('{"version": 2, "verify": [0, 0, 0, 0, 0]}', "version"),
    ('{"version": 1}', "malformed"),
    ('{"version": 1, "verify": [1, 2, 3]}', "6 coefficients"),
    ('{"version": 1, "verify": [0, 0, 0, 0, 0], "draft": {"x": [1]}}', "5 coefficients"),
    ('{"version": 1, "verify": [0, 0, 0, 0, "a"]}', "malformed"),
    ('{"version": 1, "verify": [0, 0, 0, 0, NaN]}', "non-finite"),
])
def test_load_errors_name_the_path(tmp_path: Path, content: str | bytes | None,
                                   match: str) -> None:
    p = tmp_path / "cost.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        CostModel.load(p)
    assert str(p) in str(e.value)


def test_tree_terms_are_fitted_on_what_trees_cost_beyond_chains(tmp_path: Path) -> None:
    """Tree samples (as many tokens or levels as their chains) fit what a tree adds: seconds
    per token scored, and per node a drafter re-feeds; the chain fit ignores them."""
    from spin.engine.tree import fed

    grid = [(b, n, b * ctx) for b in (1, 4, 16) for n in (1, 5, 9) for ctx in (64, 384)]
    chains = [VerifySample(b, b * n, c, _tv(b, b * n, c)) for b, n, c in grid]
    trees = [VerifySample(b, b * n, c, _tv(b, b * n, c) + 2e-4 * b * n, tree=True)
             for b, n, c in grid if n > 1]
    drafts = [DraftSample("small", b, k, b * c, _td("small", b, k, b * c))
              for b in (1, 4) for k in (1, 4, 8) for c in (64, 384)]
    tree_drafts = [DraftSample("small", b, k, b * c,
                               _td("small", b, k, b * c) + 5e-4 * b * (fed((2,), k) - fed((), k)),
                               tree=True) for b in (1, 4) for k in (4, 8) for c in (64, 384)]
    m = CostModel.fit(chains + trees, drafts + tree_drafts)
    assert m.tree_verify_s == pytest.approx(2e-4, rel=1e-3)
    assert m.tree_draft_s["small"] == pytest.approx(5e-4, rel=1e-3)
    assert m.predict_verify(4, 20, 1536) == pytest.approx(_tv(4, 20, 1536), rel=1e-3)
    assert m.mape(chains + trees)["verify"] < 1e-3  # the tree samples are not the chain's
    m.save(tmp_path / "m.json")
    back = CostModel.load(tmp_path / "m.json")
    assert (back.tree_verify_s, back.tree_draft_s) == (m.tree_verify_s, m.tree_draft_s)
    assert CostModel.fit(chains, drafts).tree_verify_s == 0.0  # no tree samples: no tree cost
