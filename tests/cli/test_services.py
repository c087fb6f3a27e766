"""``router_argv`` is the exact inverse of ``spin router``'s parser (``router_config``)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from spin.cli import parser
from spin.cli.services import _FLAGGED, router_argv, router_config, unflagged
from spin.engine.prompt_lookup import PROMPT_LOOKUP
from spin.router.config import RouterConfig, SchedulerConfig
from spin.router.discovery import KubernetesDiscoveryConfig

DEFAULTS = RouterConfig("127.0.0.1:50061", "models/demo/target")
EVERY = RouterConfig(
    verifier="10.0.0.7:7000", tokenizer="org/model", default_k=7, policy="fixed",
    drafters={"draft-code": "127.0.0.1:1", "draft-prose": "127.0.0.1:2"},
    default_drafter="draft-code", redis_url="redis://:secret@127.0.0.1:6380/1",
    cost_model="/tmp/cost model.json", policy_config={"score_rounds": 2, "selector": {"ucb_c": 0.1}},
    kubernetes=KubernetesDiscoveryConfig("app.kubernetes.io/instance=spin", "serving",
                                         "http://127.0.0.1:8001"),
    scheduler=SchedulerConfig(max_batch=8, max_queue=9, draft_timeout_s=0.25, micro_batches=2,
                              prompt_lookup=False, verifier_outage_s=12.5),
    stats_spill="/var/lib/spin/stats pending.json", http_port=0,
    chat_template=str(Path(__file__).resolve().parents[2] / "models/demo/target/chat_template.jinja"),
    served_model_name="my-model")
CONFIGS = {
    "defaults": DEFAULTS,
    "every field": EVERY,
    "kubernetes": RouterConfig(None, "/models/target",
                               kubernetes=KubernetesDiscoveryConfig("app=spin")),
    "kubernetes, namespace and API": RouterConfig(
        None, "/models/target", default_drafter=None,
        kubernetes=KubernetesDiscoveryConfig("app=spin", "ns", "http://127.0.0.1:8001")),
    "no speculation by default": RouterConfig("127.0.0.1:9", "t", default_drafter=None),
    "a drafter by default": RouterConfig("127.0.0.1:9", "t", {"d": "127.0.0.1:3"}, "d", 2),
    "no HTTP API": RouterConfig("127.0.0.1:9", "t", http_port=None),
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser's defaults read these; the round trip is about the flags alone."""
    monkeypatch.delenv("SPIN_REDIS_URL", raising=False)
    monkeypatch.delenv("SPIN_REDIS_PASSWORD", raising=False)


def parse(argv: list[str]) -> RouterConfig:
    return router_config(parser().parse_args(["router", *argv]))


@pytest.mark.parametrize("name", CONFIGS)
def test_router_argv_parses_back_to_an_equal_config(name: str) -> None:
    cfg = CONFIGS[name]
    assert parse(router_argv(cfg)) == cfg


def test_every_flagged_field_is_changed_in_the_round_trip() -> None:
    pairs = [(EVERY, DEFAULTS), (EVERY.scheduler, SchedulerConfig()),
             (EVERY.kubernetes, KubernetesDiscoveryConfig(EVERY.kubernetes.label_selector))]
    for cfg, default in pairs:
        changed = {f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)}
        assert changed >= _FLAGGED[type(cfg)] - {"label_selector"}, type(cfg).__name__
    assert EVERY.default_drafter != PROMPT_LOOKUP


def test_the_fields_without_flags_are_known() -> None:
    """A new config field gets a flag (and a place in ``router_argv``) or is listed here."""
    without = {cls: {f.name for f in fields(cls)} - flagged for cls, flagged in _FLAGGED.items()}
    # api_key: a secret, read from --api-key or $SPIN_API_KEY and passed in the environment,
    # never written on a command line
    assert without == {RouterConfig: {"rpc_overhead_s", "api_key"},
                       SchedulerConfig: {"verify_timeout_s"},
                       KubernetesDiscoveryConfig: {"watch_timeout_s", "retry_s"}}
    for cls, flagged in _FLAGGED.items():
        assert flagged <= {f.name for f in fields(cls)}, cls.__name__


def test_a_field_without_a_flag_is_refused_not_dropped() -> None:
    cfg = RouterConfig("127.0.0.1:9", "t", rpc_overhead_s=0.01,
                       scheduler=SchedulerConfig(verify_timeout_s=1.0),
                       kubernetes=KubernetesDiscoveryConfig("app=spin", retry_s=9.0))
    assert unflagged(cfg) == ["rpc_overhead_s", "scheduler.verify_timeout_s",
                              "kubernetes.retry_s"]
    with pytest.raises(ValueError, match="no flags for .*rpc_overhead_s"):
        router_argv(cfg)


def test_the_router_parser_refuses_what_it_always_did() -> None:
    with pytest.raises(ValueError, match="NAME=HOST:PORT"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--drafter", "draft-code"])
    with pytest.raises(ValueError, match="--verifier HOST:PORT is required"):
        parse(["--tokenizer", "t"])
    with pytest.raises(ValueError, match="needs --label-selector"):
        parse(["--tokenizer", "t", "--discovery", "kubernetes"])
    with pytest.raises(ValueError, match=r"'d' is not one of the drafters \['prompt-lookup'\]"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--default-drafter", "d"])
    with pytest.raises(ValueError, match="--policy-config: not JSON"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--policy-config", "{x"])


def test_the_redis_password_is_filled_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIN_REDIS_PASSWORD", "p@ss")
    cfg = parse(["--tokenizer", "t", "--verifier", "h:1", "--redis-url", "redis://r:6379/0"])
    assert cfg.redis_url == "redis://:p%40ss@r:6379/0"
    assert parse(router_argv(cfg)) == cfg  # a URL with a password keeps it


def test_a_missing_chat_template_is_refused_at_once(tmp_path) -> None:
    with pytest.raises(ValueError, match="--chat-template .*: no such file"):
        parse(["--verifier", "127.0.0.1:9", "--tokenizer", "t", "--chat-template",
               str(tmp_path / "nope.jinja")])
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    assert parse(["--verifier", "127.0.0.1:9", "--tokenizer", "t", "--chat-template",
                  str(template)]).chat_template == str(template)
