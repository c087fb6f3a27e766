"""Do the chart's value sets fit their GPUs and memory limits? The memory plan (``spin.plan``) of
every verifier and drafter pod, from the values helm really computes and the models' published
``config.json`` files (``configs/``; only configs, no weights).

``configs/<model>/config.json`` are the files published with the models on the Hugging Face Hub
(huggingface.co/Qwen/<model>/blob/main/config.json), value for value: Qwen2.5-7B-Instruct,
Qwen2.5-0.5B-Instruct, Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-1.5B-Instruct. The fields that size
memory (hidden and intermediate sizes, layers, heads, KV heads, vocabulary, context, tied
embeddings, dtype, sliding window) are checked below against the parameter counts the model cards
publish.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import yaml

from deploy.conftest import CHART, ROOT, run, tool
from spin.engine.memory import parse_size
from spin.plan import ServicePlan, format_plan, load_config, parameter_count, plan_chart

CONFIGS = Path(__file__).parent / "configs"
QWEN = {p.name: p for p in CONFIGS.iterdir() if (p / "config.json").exists()}
DEMO = {p.name: p for p in (ROOT / "models" / "demo").iterdir() if (p / "config.json").exists()}
GIB = 1 << 30


@pytest.fixture(scope="module")
def chart_values(tmp_path_factory: pytest.TempPathFactory):
    """``values(*helm_args)``: the values helm computes for the chart (defaults merged with the
    value files and --set flags, nulls removed), rendered by a template added to a copy."""
    chart = tmp_path_factory.mktemp("chart") / "spin"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "values-dump.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: values\ndata:\n"
        "  values: {{ toYaml .Values | quote }}\n")

    def values(*args: str) -> dict:
        out = run([tool("helm"), "template", "spin", chart, "--namespace", "serving",
                   "--show-only", "templates/values-dump.yaml", *args]).stdout
        return yaml.safe_load(yaml.safe_load(out)["data"]["values"])

    return values


def gpu_set(chart_values, *args: str) -> dict:
    return chart_values("-f", str(CHART / "ci" / "gpu-mps-values.yaml"), *args)


def by_service(plans: list[ServicePlan]) -> dict[str, ServicePlan]:
    return {p.service: p for p in plans}


@pytest.mark.parametrize(("model", "parameters"), [
    ("Qwen2.5-7B-Instruct", 7_615_616_512),   # model card: 7.61B
    ("Qwen2.5-0.5B-Instruct", 494_032_768),    # 0.49B, tied embeddings
    ("Qwen2.5-Coder-0.5B-Instruct", 494_032_768),
    ("Qwen2.5-1.5B-Instruct", 1_543_714_304),  # 1.54B, tied embeddings
])
def test_config_fixtures_are_the_published_models(model: str, parameters: int) -> None:
    cfg = load_config(QWEN[model])
    assert parameter_count(cfg) == parameters
    assert cfg.max_position_embeddings == 32768 and cfg.use_sliding_window is False
    assert cfg.vocab_size == (152064 if model.startswith("Qwen2.5-7B") else 151936)


def test_gpu_value_set_fits_80_gib_gpus_and_its_memory_limits(chart_values) -> None:
    values = gpu_set(chart_values)
    assert parse_size(values["gpu"]["memory"]) == 80 * GIB
    plans = plan_chart(values, QWEN)
    assert all(p.fits for p in plans), format_plan(plans)
    services = by_service(plans)
    assert set(services) == {"verifier", "drafter-qwen-0-5b", "drafter-qwen-coder-0-5b",
                             "drafter-qwen-1-5b"}
    verifier = services["verifier"]
    assert (verifier.device, verifier.dtype, verifier.max_model_len) == ("cuda", "bfloat16", 32768)
    assert verifier.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert verifier.max_seqs == 128
    assert verifier.device_limit_bytes == int(0.9 * 80 * GIB)  # a whole GPU
    # Every request at 32k context would not fit, but tens of them do, and all 128 at 7k each.
    assert 128 * 32768 > verifier.tokens >= 128 * 7000
    for name in ("qwen-0-5b", "qwen-coder-0-5b", "qwen-1-5b"):
        drafter = services[f"drafter-{name}"]
        assert drafter.device_limit_bytes == int(0.9 * 20 * GIB)  # a quarter of the GPU (MPS)
        assert (drafter.dtype, drafter.max_model_len) == ("bfloat16", 32768)
        assert drafter.host_bytes <= drafter.host_limit_bytes


@pytest.mark.parametrize(("value_set", "files"), [
    ("default", ()),
    ("cpu-demo", ("-f", str(CHART / "ci" / "cpu-demo-values.yaml"))),
])
def test_cpu_value_sets_fit_their_memory_limits(chart_values, value_set: str,
                                                files: tuple[str, ...]) -> None:
    plans = plan_chart(chart_values(*files), DEMO)
    assert all(p.fits and p.device == "cpu" for p in plans), format_plan(plans)
    assert all(p.host_bytes <= p.host_limit_bytes for p in plans)


@pytest.mark.parametrize("kv", ["224GiB", "480GiB"])
def test_fully_preallocated_slots_do_not_fit(chart_values, kv: str) -> None:
    """The old sizing: 128 requests x 32k tokens set aside (224 GiB in bf16, 480 GiB at 4 bytes
    and beyond) cannot fit an 80 GiB GPU, and the plan says so with the numbers."""
    plans = by_service(plan_chart(gpu_set(chart_values, "--set", f"verifier.kvCacheMemory={kv}"),
                                  QWEN))
    verifier = plans["verifier"]
    assert not verifier.fits
    assert "of GPU memory (weights, KV cache, activations) but may use 72.0 GiB" in verifier.error
    assert all(p.fits for s, p in plans.items() if s != "verifier")


def test_what_else_cannot_fit_says_why(chart_values) -> None:
    # Without a budget, a drafter under MPS sizes its cache from the whole GPU it may see.
    plans = by_service(plan_chart(gpu_set(chart_values, "--set-json",
                                          "drafterDefaults.kvCacheMemory=null"), QWEN))
    assert not plans["drafter-qwen-0-5b"].fits
    assert "set kvCacheMemory" in plans["drafter-qwen-0-5b"].error
    # The target's weights are loaded on the host first: 16 GiB do not fit 12Gi.
    values = gpu_set(chart_values)
    small = copy.deepcopy(values)
    small["verifier"]["resources"]["limits"]["memory"] = "12Gi"
    verifier = by_service(plan_chart(small, QWEN))["verifier"]
    assert not verifier.fits and "host memory but its memory limit is 12.0 GiB" in verifier.error
    # A context the model does not have.
    longer = copy.deepcopy(values)
    longer["drafterDefaults"]["maxModelLen"] = 65536
    assert "exceeds the model's context" in by_service(plan_chart(longer, QWEN))[
        "drafter-qwen-1-5b"].error
    # A model whose config is missing.
    assert "no config given" in by_service(plan_chart(values, {}))["verifier"].error
