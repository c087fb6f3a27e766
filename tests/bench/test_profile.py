"""``spin profile`` on a tiny grid: measured points, a loadable cost model, its fit error."""

from __future__ import annotations

import json
from pathlib import Path

from spin.bench.profile import ProfileConfig, run_profile
from spin.engine import quant
from spin.timing.cost_model import CostModel


class TinyGrid(ProfileConfig):
    def grid(self):
        return (1, 2), (1, 3), (16, 48), (1, 2), 1


def test_profile_writes_a_loadable_cost_model(tmp_path: Path, family_dir: Path) -> None:
    out = tmp_path / "cost.json"
    weights = quant.resolve("auto")  # int8 where this torch has the kernels
    r = run_profile(TinyGrid(family_dir=family_dir, drafters=["draft-structured"], out=out,
                             drafter_quantize=weights, threads=1))
    # chains at every point, and trees of as many tokens (3 = the last token + two branches of
    # one) or levels (k = 2) beside them
    assert r["verify_points"] == 2 * 2 * (2 + 1) and r["draft_points"] == 2 * 2 * (2 + 1)
    model = CostModel.load(out)
    assert model.tree_verify_s >= 0 and "draft-structured" in model.tree_draft_s
    assert model.has_drafter("draft-structured") and not model.has_drafter("draft-code")
    assert model.predict_verify(2, 6, 96) > 0 and model.predict_draft("draft-structured", 1, 2, 16) > 0
    raw = json.loads(out.read_text())
    assert raw["drafter_quantize"] == weights and raw["threads"] == 1  # recorded
    mape = raw["fit_mape"]
    assert set(mape) >= {"verify", "draft-structured", "overall"}
    assert all(v >= 0 for v in mape.values())
