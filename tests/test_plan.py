"""Memory plans (``spin plan``, ``spin serve --dry-run``, ``plan.plan_chart``): real numbers from
configs alone, the reason when a service cannot fit, the command lines and their JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from spin.engine.memory import CPU_KV_CACHE_DEFAULT, ModelShape, parse_size
from spin.engine.model_runner import RunnerConfig
from spin.plan import (HOST_OVERHEAD, parameter_count, plan_chart, plan_deployment, plan_model,
                       plan_serve)
from spin.serve import VERIFIER_GPU_SHARE, ServeConfig

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ROOT / "models" / "demo"
CONFIGS = ROOT / "tests" / "deploy" / "configs"  # published Qwen2.5 configs
QWEN_7B = CONFIGS / "Qwen2.5-7B-Instruct"
QWEN_05B = CONFIGS / "Qwen2.5-0.5B-Instruct"
GIB = 1 << 30


def spin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spin", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_qwen_7b_in_bf16_on_a_gpu() -> None:
    runner = RunnerConfig(device="cuda", dtype="auto", max_model_len=32768)
    p = plan_model("verifier", str(QWEN_7B), runner, gpu_memory=80 * GIB)
    assert p.fits, p.error
    assert (p.device, p.dtype) == ("cuda", "bfloat16")  # auto on CUDA: the checkpoint's dtype
    assert p.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert p.weight_bytes == 7_615_616_512 * 2  # the published 7.62B parameters, untied head
    assert p.activation_bytes == 2048 * (2 * 4 * 152064 + 8 * 3584 * 2)
    # 0.9 of the GPU less weights and activations, in whole blocks of 16 tokens
    free = int(80 * GIB * 0.9) - p.weight_bytes - p.activation_bytes
    assert p.num_blocks == free // (57344 * 16) and p.tokens == p.num_blocks * 16
    assert p.kv_cache_bytes == p.num_blocks * 57344 * 16
    assert p.device_bytes == p.weight_bytes + p.kv_cache_bytes + p.activation_bytes
    assert p.device_bytes <= p.device_limit_bytes == int(80 * GIB * 0.9)
    assert p.host_bytes == HOST_OVERHEAD["cuda"] + p.weight_bytes  # the KV cache is on the GPU
    assert p.max_model_len == 32768


def test_tied_embeddings_count_once() -> None:
    cfg = AutoConfig.from_pretrained(QWEN_05B)
    assert cfg.tie_word_embeddings
    assert parameter_count(cfg) == 494_032_768  # Qwen2.5-0.5B's published 0.49B
    untied = AutoConfig.from_pretrained(QWEN_05B, tie_word_embeddings=False)
    assert parameter_count(untied) == 494_032_768 + 151936 * 896


def test_demo_family_on_the_cpu_matches_the_runner_rules() -> None:
    p = plan_model("verifier", str(FAMILY / "target"), RunnerConfig())
    assert p.fits and (p.device, p.dtype) == ("cpu", "float32")  # auto: the CPU, in fp32
    shape = ModelShape.of(AutoConfig.from_pretrained(FAMILY / "target"))
    assert p.kv_bytes_per_token == shape.kv_bytes_per_token(torch.float32) == 2 * 8 * 6 * 64 * 4
    assert p.num_blocks == CPU_KV_CACHE_DEFAULT // (p.kv_bytes_per_token * 16)
    assert p.max_model_len == 1024  # the model's context
    assert p.device_bytes == 0 and p.device_limit_bytes is None
    assert p.host_bytes == (HOST_OVERHEAD["cpu"] + p.weight_bytes + p.kv_cache_bytes
                            + p.activation_bytes)


def test_serve_split_of_one_gpu() -> None:
    runner = RunnerConfig(device="cuda", gpu_memory_utilization=0.8, max_model_len=8192)
    plans = plan_deployment(str(QWEN_7B), {"a": str(QWEN_05B), "b": str(QWEN_05B)}, runner,
                            gpu_memory=80 * GIB)
    assert [p.service for p in plans] == ["verifier", "drafter-a", "drafter-b"]
    assert all(p.fits for p in plans), [p.error for p in plans]
    verifier, drafter = plans[0], plans[1]
    assert verifier.device_limit_bytes == int(80 * GIB * 0.8 * VERIFIER_GPU_SHARE)
    assert drafter.device_limit_bytes == int(80 * GIB * 0.8 * (1 - VERIFIER_GPU_SHARE) / 2)
    assert "0.75 x --gpu-memory-utilization 0.8" in verifier.gpu_share
    assert "0.125 x --gpu-memory-utilization 0.8" in drafter.gpu_share
    assert sum(p.device_bytes for p in plans) <= 0.8 * 80 * GIB


@pytest.mark.parametrize(("runner", "gpu_memory", "reason"), [
    (RunnerConfig(device="cuda", kv_cache_memory=480 * GIB), 80 * GIB,
     "but may use 72.0 GiB"),  # 128 requests x 32k tokens preallocated in fp32: no GPU holds it
    (RunnerConfig(device="cuda"), 16 * GIB, "no room for a KV cache"),
    (RunnerConfig(device="cuda", max_model_len=65536), 80 * GIB, "exceeds the model's context"),
    (RunnerConfig(device="cpu", kv_cache_memory=64 << 20, max_model_len=32768), None,
     "does not fit the KV cache"),
    (RunnerConfig(device="cuda"), None, "--gpu-memory"),
    (RunnerConfig(device="cuda", quantize="int8"), 80 * GIB, "int8 weights need"),
])
def test_what_cannot_fit_says_why(runner: RunnerConfig, gpu_memory: int | None,
                                  reason: str) -> None:
    p = plan_model("verifier", str(QWEN_7B), runner, gpu_memory=gpu_memory)
    assert not p.fits and reason in p.error, p.error


def test_host_limit_and_sliding_window(tmp_path: Path) -> None:
    p = plan_model("verifier", str(FAMILY / "target"), RunnerConfig(), host_limit=1 << 30)
    assert not p.fits and "limit is 1.0 GiB" in p.error
    cfg = json.loads((QWEN_05B / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True,
                                                      "sliding_window": 4096}))
    runner = RunnerConfig(device="cuda", kv_cache_memory=GIB, max_model_len=8192)
    p = plan_model("drafter-x", str(tmp_path), runner, gpu_memory=80 * GIB)
    assert not p.fits and "sliding-window attention (4096)" in p.error
    assert plan_model("drafter-x", str(tmp_path), replace(runner, max_model_len=4096),
                      gpu_memory=80 * GIB).fits


def test_spin_plan_prints_every_service_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = spin("plan", "--target", "models/demo/target", "--drafter",
             "draft-code=models/demo/draft-code", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "verifier: models/demo/target" in r.stdout
    assert "drafter-draft-code: models/demo/draft-code" in r.stdout
    assert "KV 24576 B/token" in r.stdout and "KV 3072 B/token" in r.stdout
    assert "max model len 1024" in r.stdout and "2 of 2 services fit" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["fits"] is True
    verifier = plan["services"][0]
    for key in ("model", "device", "dtype", "weight_bytes", "kv_bytes_per_token",
                "kv_cache_bytes", "num_blocks", "block_size", "tokens", "max_model_len",
                "activation_bytes", "device_bytes", "host_bytes", "error"):
        assert key in verifier
    assert verifier["tokens"] == verifier["num_blocks"] * verifier["block_size"] == 21840


def test_spin_plan_on_cuda_without_a_gpu_and_the_exit_code(tmp_path: Path) -> None:
    r = spin("plan", "--target", str(QWEN_7B), "--drafter", f"q={QWEN_05B}", "--gpu-memory",
             "80GiB", "--max-model-len", "32768", "--drafter-kv-cache-memory", "4GiB")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on cuda in bfloat16" in r.stdout and "KV 57344 B/token" in r.stdout
    assert "GPU share 0.675 of 80.0 GiB (0.75 x --gpu-memory-utilization 0.9)" in r.stdout
    assert "GPU share 0.225 of 80.0 GiB (0.25 x --gpu-memory-utilization 0.9)" in r.stdout
    out = tmp_path / "plan.json"
    r = spin("plan", "--target", str(QWEN_7B), "--device", "cuda", "--gpu-memory", "80GiB",
             "--kv-cache-memory", "480GiB", "--json", str(out))
    assert r.returncode == 1
    assert "CANNOT FIT: needs 496.6 GiB of GPU memory" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["fits"] is False and "496.6 GiB" in plan["services"][0]["error"]


def test_spin_serve_dry_run_prints_the_demo_family_plan() -> None:
    r = spin("serve", "--dry-run", "--drafters", "draft-code,draft-prose",
             "--drafter-kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "verifier: " in r.stdout and "models/demo/target" in r.stdout
    for name in ("draft-code", "draft-prose"):
        assert f"drafter-{name}: " in r.stdout
    assert "KV cache 64.0 MiB = 1365 blocks x 16 = 21840 concurrent tokens" in r.stdout
    assert "3 of 3 services fit" in r.stdout and "together: host" in r.stdout
    # a budget that holds no block: the plan says which service and why, and exits 1
    r = spin("serve", "--dry-run", "--drafters", "draft-code", "--kv-cache-memory", "1KiB")
    assert r.returncode == 1 and "CANNOT FIT" in r.stdout and "holds no block" in r.stdout


def test_plan_serve_uses_the_serve_config(capsys) -> None:
    cfg = ServeConfig(drafters=["draft-structured"], drafter_quantize="none",
                      runner=RunnerConfig(kv_cache_memory=parse_size("48MiB")))
    assert plan_serve(cfg) == 0
    text = capsys.readouterr().out
    assert "KV cache 48.0 MiB = 128 blocks" in text  # the verifier's budget
    assert "drafter-draft-structured" in text and "2 of 2 services fit" in text


def test_a_colocated_drafter_is_planned_inside_the_verifier(capsys) -> None:
    cfg = ServeConfig(drafters=["draft-code", "draft-prose"], colocate=("draft-code",),
                      drafter_quantize="none",
                      runner=RunnerConfig(kv_cache_memory=parse_size("48MiB")))
    assert plan_serve(cfg) == 0
    text = capsys.readouterr().out
    assert "verifier, colocated draft-code: " in text and "drafter-draft-code" not in text
    assert "drafter-draft-prose: " in text and "3 of 3 services fit" in text
    # its KV cache holds as many positions as the verifier's: 128 blocks x 16
    inside = text.split("verifier, colocated draft-code: ")[1].split("drafter-draft-prose")[0]
    assert "= 128 blocks x 16 = 2048 concurrent tokens" in inside


def test_plan_chart_mps_slices_and_limits() -> None:
    values = {"gpu": {"enabled": True, "memory": "80GiB"}, "mps": {"enabled": True, "replicas": 4},
              "verifier": {"model": "Qwen2.5-7B-Instruct", "dtype": "bfloat16",
                           "maxModelLen": 32768, "kvCacheMemory": "40GiB",
                           "resources": {"limits": {"memory": "48Gi"}}},
              "drafterDefaults": {"gpus": 1, "resources": {"limits": {"memory": "8Gi"}}},
              "drafters": [{"name": "small", "model": "/models/Qwen2.5-0.5B-Instruct",
                            "kvCacheMemory": "8GiB"},
                           {"name": "greedy", "model": "Qwen2.5-0.5B-Instruct"}]}
    plans = {p.service: p for p in plan_chart(values, {"Qwen2.5-7B-Instruct": QWEN_7B,
                                                       "Qwen2.5-0.5B-Instruct": QWEN_05B})}
    assert plans["verifier"].fits and plans["verifier"].device_limit_bytes == int(72 * GIB)
    assert plans["drafter-small"].fits
    assert plans["drafter-small"].device_limit_bytes == int(20 * GIB * 0.9)  # a quarter GPU
    # Without a KV budget a process under MPS sizes its cache from the whole GPU: too much.
    assert not plans["drafter-greedy"].fits
    assert "may use 18.0 GiB" in plans["drafter-greedy"].error
