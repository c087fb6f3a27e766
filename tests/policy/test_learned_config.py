"""The learned policy's settings: JSON overrides, and the errors that name a bad one."""

from __future__ import annotations

import pytest

from spin.policy.learned_config import learned_config


def test_learned_config_takes_json_overrides_and_names_bad_ones() -> None:
    cfg = learned_config({"score_rounds": 2, "score_trials": 3, "selector": {"ucb_c": 0.1},
                          "controller": {"k_max": 6}}, fallback=False)
    assert (cfg.score_rounds, cfg.score_trials, cfg.fallback) == (2, 3, False)
    assert cfg.selector.ucb_c == 0.1 and cfg.selector.prior_strength == 3.0  # the rest kept
    assert cfg.controller.k_max == 6 and cfg.controller.margin == 0.10
    for bad, match in (({"nope": 1}, "unknown learned-policy setting 'nope'"),
                       ({"selector": {"x": 1}}, r"unknown selector setting\(s\) \['x'\]"),
                       ({"selector": 3}, "takes an object"),
                       ({"score_rounds": "2"}, "takes int values"),
                       ({"fallback": [True]}, "takes bool values"),
                       ({"score_after": True}, "takes int values"),
                       ({"selector": {"ucb_c": "0.1"}}, "selector setting 'ucb_c' takes float")):
        with pytest.raises(ValueError, match=match):
            learned_config(bad)
