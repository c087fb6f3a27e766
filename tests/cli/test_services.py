"""``spin router``'s configuration: from its flags, or whole from ``--config FILE`` (the JSON of a
``RouterConfig``, as ``spin serve`` writes it), which reads back to an equal config."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from spin.cli import parser
from spin.cli.services import router_config
from spin.engine.prompt_lookup import PROMPT_LOOKUP
from spin.router.config import RouterConfig, SchedulerConfig, from_json, to_json
from spin.router.discovery import KubernetesDiscoveryConfig

DEFAULTS = RouterConfig("127.0.0.1:50061", "models/demo/target")
EVERY = RouterConfig(
    verifier="10.0.0.7:7000", tokenizer="org/model", default_k=7, policy="fixed",
    drafters={"draft-code": "127.0.0.1:1", "draft-prose": "127.0.0.1:2"},
    default_drafter="draft-code", redis_url="redis://:secret@127.0.0.1:6380/1",
    cost_model="/tmp/cost model.json", policy_config={"score_rounds": 2, "selector": {"ucb_c": 0.1}},
    kubernetes=KubernetesDiscoveryConfig("app.kubernetes.io/instance=spin", "serving",
                                         "http://127.0.0.1:8001", watch_timeout_s=60,
                                         retry_s=0.5),
    scheduler=SchedulerConfig(max_batch=8, max_queue=9, draft_timeout_s=0.25, micro_batches=2,
                              plain_steps=2,
                              prompt_lookup=False, suffix_decoding=False,
                              suffix_store_tokens=1000, suffix_share=True,
                              suffix_share_entries=99, grammar_drafts=False,
                              predicted_outputs=False, verifier_outage_s=12.5,
                              verify_timeout_s=9.0,
                              step_trace="/var/log/spin/steps.jsonl"),
    stats_spill="/var/lib/spin/stats pending.json", http_port=0, rpc_overhead_s=0.002,
    chat_template=str(Path(__file__).resolve().parents[2] / "models/demo/target/chat_template.jinja"),
    served_model_name="my-model")
CONFIGS = {
    "defaults": DEFAULTS,
    "every field": EVERY,
    "kubernetes": RouterConfig(None, "/models/target",
                               kubernetes=KubernetesDiscoveryConfig("app=spin")),
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


def config_file(tmp_path: Path, cfg: RouterConfig | str) -> str:
    path = tmp_path / "router.json"
    path.write_text(cfg if isinstance(cfg, str) else to_json(cfg))
    return str(path)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_config_file_reads_back_to_an_equal_config(name: str, tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    assert parse(["--config", config_file(tmp_path, cfg)]) == cfg


def test_every_field_travels_in_the_file(tmp_path: Path) -> None:
    """Every field, nested ones too, differs from its default in ``EVERY`` and comes back: a
    new field travels with no list of flags to extend (the key excepted: it is a secret)."""
    pairs = [(EVERY, DEFAULTS), (EVERY.scheduler, SchedulerConfig()),
             (EVERY.kubernetes, KubernetesDiscoveryConfig(EVERY.kubernetes.label_selector))]
    for cfg, default in pairs:
        same = {f.name for f in fields(cfg) if getattr(cfg, f.name) == getattr(default, f.name)}
        assert same <= {"label_selector", "api_key"}, (type(cfg).__name__, same)
    assert EVERY.default_drafter != PROMPT_LOOKUP
    assert from_json(to_json(EVERY)) == EVERY


def test_the_api_key_stays_out_of_the_file(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = replace(DEFAULTS, api_key="s3cret")
    assert "s3cret" not in to_json(cfg)
    monkeypatch.setenv("SPIN_API_KEY", "s3cret")  # spin serve passes it in the environment
    assert parse(["--config", config_file(tmp_path, cfg)]) == cfg


def test_the_flags_give_the_config_they_name() -> None:
    """Every router setting that has a flag (the file carries the others too)."""
    assert parse([
        "--verifier", "10.0.0.7:7000", "--tokenizer", "org/model", "--default-k", "7",
        "--policy", "fixed", "--drafter", "draft-code=127.0.0.1:1", "--drafter",
        "draft-prose=127.0.0.1:2", "--default-drafter", "draft-code", "--redis-url",
        "redis://:secret@127.0.0.1:6380/1", "--cost-model", "/tmp/cost model.json",
        "--policy-config", json.dumps(EVERY.policy_config), "--discovery", "kubernetes",
        "--label-selector", "app.kubernetes.io/instance=spin", "--namespace", "serving",
        "--kube-api", "http://127.0.0.1:8001", "--max-batch", "8", "--max-queue", "9",
        "--draft-timeout", "0.25", "--micro-batches", "2", "--plain-steps", "2",
        "--no-prompt-lookup",
        "--no-suffix-decoding", "--suffix-store-tokens", "1000", "--suffix-share",
        "--suffix-share-entries", "99", "--no-grammar-drafts",
        "--no-predicted-outputs",
        "--verifier-outage", "12.5", "--step-trace", "/var/log/spin/steps.jsonl",
        "--stats-spill", "/var/lib/spin/stats pending.json",
        "--http-port", "0", "--chat-template", EVERY.chat_template, "--served-model-name",
        "my-model"]) == replace(
            EVERY, rpc_overhead_s=DEFAULTS.rpc_overhead_s,
            kubernetes=KubernetesDiscoveryConfig("app.kubernetes.io/instance=spin", "serving",
                                                 "http://127.0.0.1:8001"),
            scheduler=replace(EVERY.scheduler, verify_timeout_s=120.0))


def test_a_config_file_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="leave out --max-batch, --no-http"):
        parse(["--config", config_file(tmp_path, DEFAULTS), "--max-batch", "3", "--no-http"])
    with pytest.raises(ValueError, match="unknown key scheduler.max_bath"):
        parse(["--config", config_file(tmp_path, '{"scheduler": {"max_bath": 3}}')])
    with pytest.raises(ValueError, match="default_k must be int, got '4'"):
        parse(["--config", config_file(tmp_path, '{"default_k": "4"}')])
    with pytest.raises(ValueError, match="router.json: not JSON"):
        parse(["--config", config_file(tmp_path, "{")])
    with pytest.raises(ValueError, match="--config .*nope.json: No such file"):
        parse(["--config", str(tmp_path / "nope.json")])
    with pytest.raises(ValueError, match="--verifier HOST:PORT is required"):  # the flags' checks
        parse(["--config", config_file(tmp_path, '{"tokenizer": "t"}')])
    with pytest.raises(ValueError, match="unknown learned-policy setting 'nope'"):
        parse(["--config", config_file(tmp_path, replace(DEFAULTS, policy_config={"nope": 1}))])


def test_a_default_drafter_is_checked_against_the_drafters_and_the_verifiers() -> None:
    from spin.router.config import unknown_default_drafter

    cfg = parse(["--tokenizer", "t", "--verifier", "h:1", "--drafter", "a=h:2",
                 "--default-drafter", "d"])  # parses: the verifier may serve d
    assert unknown_default_drafter(cfg, ["d"]) is None
    assert unknown_default_drafter(replace(cfg, default_drafter="a")) is None
    assert unknown_default_drafter(replace(cfg, default_drafter="prompt-lookup")) is None
    assert unknown_default_drafter(cfg, ["eagle"]) == (
        "--default-drafter 'd' is not one of the drafters ['a', 'grammar', 'prediction', "
        "'prompt-lookup', 'suffix']; inside the verifier: ['eagle']")


def test_the_router_parser_refuses_what_it_always_did() -> None:
    with pytest.raises(ValueError, match="NAME=HOST:PORT"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--drafter", "draft-code"])
    with pytest.raises(ValueError, match="--verifier HOST:PORT is required"):
        parse(["--tokenizer", "t"])
    with pytest.raises(ValueError, match="needs --label-selector"):
        parse(["--tokenizer", "t", "--discovery", "kubernetes"])
    with pytest.raises(ValueError, match="--policy-config: not JSON"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--policy-config", "{x"])
    with pytest.raises(ValueError, match="--suffix-share needs --redis-url"):
        parse(["--tokenizer", "t", "--verifier", "h:1", "--suffix-share"])


def test_the_redis_password_is_filled_in(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setenv("SPIN_REDIS_PASSWORD", "p@ss")
    cfg = parse(["--tokenizer", "t", "--verifier", "h:1", "--redis-url", "redis://r:6379/0"])
    assert cfg.redis_url == "redis://:p%40ss@r:6379/0"
    assert parse(["--config", config_file(tmp_path, cfg)]) == cfg  # a URL with one keeps it
    bare = replace(cfg, redis_url="redis://r:6379/0")
    assert parse(["--config", config_file(tmp_path, bare)]) == cfg  # filled in from the file too


def test_a_missing_chat_template_is_refused_at_once(tmp_path) -> None:
    with pytest.raises(ValueError, match="--chat-template .*: no such file"):
        parse(["--verifier", "127.0.0.1:9", "--tokenizer", "t", "--chat-template",
               str(tmp_path / "nope.jinja")])
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    assert parse(["--verifier", "127.0.0.1:9", "--tokenizer", "t", "--chat-template",
                  str(template)]).chat_template == str(template)
