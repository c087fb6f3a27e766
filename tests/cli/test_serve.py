"""``spin serve``'s flags become one ``ServeConfig`` whose router settings are a ``RouterConfig``
(the router child gets them back through ``router_argv``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spin.cli import parser
from spin.cli.serve import serve_config
from spin.cli.services import router_argv, router_config
from spin.engine.model_runner import RunnerConfig
from spin.router.config import RouterConfig, SchedulerConfig


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPIN_REDIS_URL", raising=False)
    monkeypatch.delenv("SPIN_REDIS_PASSWORD", raising=False)


def test_serve_defaults_are_the_routers() -> None:
    cfg = serve_config(parser().parse_args(["serve"]))
    assert cfg.router == RouterConfig() and cfg.runner == RunnerConfig()
    assert (cfg.port, cfg.metrics_port, cfg.redis, cfg.cpus) == (50051, 0, True, "shared")


def test_serve_flags_reach_the_router_child() -> None:
    cfg = serve_config(parser().parse_args([
        "serve", "--default-drafter", "none", "--default-k", "3", "--max-batch", "8",
        "--max-queue", "9", "--micro-batches", "2", "--policy", "fixed",
        "--policy-config", '{"score_rounds": 2}', "--drafter", "d=/models/d",
        "--kv-cache-memory", "64MiB", "--no-redis", "--cpus", "split"]))
    assert cfg.router == RouterConfig(default_drafter=None, default_k=3, policy="fixed",
                                      policy_config={"score_rounds": 2},
                                      scheduler=SchedulerConfig(max_batch=8, max_queue=9,
                                                                micro_batches=2))
    assert cfg.drafter_models == {"d": "/models/d"} and cfg.runner.kv_cache_memory == 64 << 20
    assert (cfg.redis, cfg.cpus) == (False, "split")
    child = replace(cfg.router, verifier="127.0.0.1:1", tokenizer="/models/t",
                    drafters={"d": "127.0.0.1:2"}, cost_model="build/cost_model.json")
    assert router_config(parser().parse_args(["router", *router_argv(child)])) == child


def test_serve_refuses_a_bad_policy_config_or_drafter() -> None:
    with pytest.raises(ValueError, match="unknown learned-policy setting"):
        serve_config(parser().parse_args(["serve", "--policy-config", '{"nope": 1}']))
    with pytest.raises(ValueError, match="--drafter wants NAME=PATH_OR_NAME"):
        serve_config(parser().parse_args(["serve", "--drafter", "d"]))
