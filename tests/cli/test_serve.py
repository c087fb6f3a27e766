"""``spin serve``'s flags become one ``ServeConfig`` whose router settings are a ``RouterConfig``
(the router child reads it back whole from its config file), and drafter weights that cannot
run are refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spin.cli import parser
from spin.cli.serve import serve_config
from spin.cli.services import router_config
from spin.engine import quant
from spin.engine.model_runner import RunnerConfig
from spin.router.config import RouterConfig, SchedulerConfig, to_json
from spin.serve import drafter_quantization


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPIN_REDIS_URL", raising=False)
    monkeypatch.delenv("SPIN_REDIS_PASSWORD", raising=False)


def test_serve_defaults_are_the_routers() -> None:
    cfg = serve_config(parser().parse_args(["serve"]))
    assert cfg.router == RouterConfig() and cfg.runner == RunnerConfig()
    assert (cfg.port, cfg.metrics_port, cfg.redis, cfg.cpus) == (50051, 0, True, "shared")
    assert cfg.step_times == "auto"


def test_serve_flags_reach_the_router_child(tmp_path) -> None:
    cfg = serve_config(parser().parse_args([
        "serve", "--default-drafter", "none", "--default-k", "3", "--max-batch", "8",
        "--max-queue", "9", "--micro-batches", "2", "--policy", "fixed",
        "--policy-config", '{"score_rounds": 2}', "--drafter", "d=/models/d",
        "--kv-cache-memory", "64MiB", "--no-redis", "--cpus", "split",
        "--step-trace", "steps.jsonl", "--no-suffix-decoding", "--suffix-store-tokens", "500",
        "--step-times", "off"]))
    # the router child runs elsewhere: a relative trace path is made absolute here
    assert cfg.router == RouterConfig(default_drafter=None, default_k=3, policy="fixed",
                                      policy_config={"score_rounds": 2},
                                      scheduler=SchedulerConfig(
                                          max_batch=8, max_queue=9, micro_batches=2,
                                          step_trace=str(Path.cwd() / "steps.jsonl"),
                                          suffix_decoding=False, suffix_store_tokens=500))
    assert cfg.drafter_models == {"d": "/models/d"} and cfg.runner.kv_cache_memory == 64 << 20
    assert (cfg.redis, cfg.cpus, cfg.step_times) == (False, "split", "off")
    child = replace(cfg.router, verifier="127.0.0.1:1", tokenizer="/models/t",
                    drafters={"d": "127.0.0.1:2"}, cost_model="build/cost_model.json")
    (tmp_path / "router.json").write_text(to_json(child))
    args = parser().parse_args(["router", "--config", str(tmp_path / "router.json")])
    assert router_config(args) == child


def test_serve_refuses_a_bad_policy_config_or_drafter() -> None:
    with pytest.raises(ValueError, match="unknown learned-policy setting"):
        serve_config(parser().parse_args(["serve", "--policy-config", '{"nope": 1}']))
    with pytest.raises(ValueError, match="--drafter wants NAME=PATH_OR_NAME"):
        serve_config(parser().parse_args(["serve", "--drafter", "d"]))
    with pytest.raises(ValueError, match="--suffix-share shares through Redis: leave out "
                                         "--no-redis"):
        serve_config(parser().parse_args(["serve", "--suffix-share", "--no-redis"]))


def test_serve_passes_suffix_sharing_to_the_router() -> None:
    cfg = serve_config(parser().parse_args(["serve", "--suffix-share",
                                            "--suffix-share-entries", "77"]))
    assert (cfg.router.scheduler.suffix_share, cfg.router.scheduler.suffix_share_entries) == (
        True, 77)


@pytest.mark.parametrize("flags,weights", [
    ([], "int8"), (["--dtype", "float32"], "int8"), (["--dtype", "bfloat16"], "none"),
    (["--dtype", "float16", "--device", "cpu"], "none"), (["--drafter-quantize", "none"], "none"),
    (["--drafter-quantize", "int8", "--dtype", "auto"], "int8"),
])
def test_drafter_weights_follow_the_device_and_dtype(flags: list[str], weights: str) -> None:
    """auto is int8 only where it runs (the CPU in float32), on the drafters' device here."""
    if not quant.available():
        weights = "none" if "int8" not in flags else weights
    cfg = serve_config(parser().parse_args(["serve", "--device", "cpu", *flags]))
    assert drafter_quantization(cfg) == weights
    if "int8" not in flags:
        assert drafter_quantization(cfg, torch.device("cuda")) == "none"  # a plan's device


def test_int8_drafters_where_they_cannot_run_are_refused_naming_the_flags() -> None:
    for flags in (["--dtype", "bfloat16"], ["--device", "cuda", "--dtype", "float32"]):
        cfg = serve_config(parser().parse_args(["serve", "--drafter-quantize", "int8", *flags]))
        with pytest.raises(ValueError, match="--drafter-quantize int8 needs --device cpu and "
                                             "--dtype float32"):
            drafter_quantization(cfg, torch.device(flags[flags.index("--device") + 1]
                                                   if "--device" in flags else "cpu"))


def test_spin_serve_refuses_int8_with_bfloat16_before_starting_anything(tmp_path) -> None:
    """The defect of issue 36 item 7: the refusal comes at once, with the flags named, and no
    child (or log) is started."""
    r = subprocess.run([sys.executable, "-m", "spin", "serve", "--dtype", "bfloat16",
                        "--drafter-quantize", "int8", "--log-dir", str(tmp_path / "serve"),
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "spin serve: --drafter-quantize int8 needs --device cpu and --dtype float32" in r.stderr
    assert "--dtype bfloat16" in r.stderr and "starting" not in r.stdout
    assert not (tmp_path / "serve").exists()


def test_spin_serve_refuses_a_default_drafter_it_does_not_serve_before_starting(tmp_path) -> None:
    """Services, drafters inside the verifier (the family's head, --colocate) and the model-free
    ones may be the default; any other name is refused at once, naming what there is."""
    from spin.cli.serve import _check_default_drafter

    def check(*flags: str) -> None:
        _check_default_drafter(serve_config(parser().parse_args(["serve", *flags])))

    check("--default-drafter", "draft-code")
    check("--default-drafter", "eagle")  # the family's head
    check("--drafters", "draft-code", "--colocate", "draft-code", "--default-drafter",
          "draft-code")
    with pytest.raises(ValueError, match="'draft-code' is not one of the drafters"):
        check("--drafters", "draft-prose", "--default-drafter", "draft-code")
    r = subprocess.run([sys.executable, "-m", "spin", "serve", "--default-drafter", "nope",
                        "--log-dir", str(tmp_path / "serve"), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "spin serve: --default-drafter 'nope' is not one of the drafters" in r.stderr
    assert "inside the verifier: ['eagle']" in r.stderr and not (tmp_path / "serve").exists()


def test_a_child_that_exits_while_starting_ends_spin_serve_with_its_reason(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "spin", "serve", "--max-model-len", "1000000",
                        "--drafters", "draft-code", "--no-redis", "--log-dir",
                        str(tmp_path / "serve"), "--port", "0"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr
    assert "spin serve: verifier exited with 2 while starting" in r.stderr
    assert "--max-model-len 1000000" in r.stderr and "Traceback" not in r.stderr
