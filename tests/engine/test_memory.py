"""Sizes, device and dtype resolution, and the KV cache budget."""

import pytest
import torch
from transformers import LlamaConfig

from spin.engine.memory import (CPU_KV_CACHE_DEFAULT, MAX_BATCH_TOKENS, ModelShape, format_size,
                                kv_budget, parse_size, resolve_device, resolve_dtype)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("text", "size"), [
    ("64MiB", 64 << 20), ("20GiB", 20 << 30), ("512Mi", 512 << 20), ("1.5G", 1_500_000_000),
    ("4096", 4096), ("8 kb", 8000), (" 2Ki ", 2048), ("1TiB", 1 << 40), ("3b", 3), (123, 123),
])
def test_parse_size(text, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5MiB", "1e3", "5 Mi B"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_parse_size_refuses_zero() -> None:
    with pytest.raises(ValueError, match="> 0"):
        parse_size("0")
    with pytest.raises(ValueError, match="> 0"):
        parse_size("0.1b")  # rounds down to nothing


def test_format_size() -> None:
    assert format_size(1.5 * (1 << 30)) == "1.5 GiB"
    assert format_size(512 << 20) == "512.0 MiB"
    assert format_size(1024) == "1.0 KiB"
    assert format_size(1023) == "1023 B"
    assert format_size(3 << 40) == "3.0 TiB"


def test_resolve_device() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == (CUDA if torch.cuda.is_available() else CPU)
    for bad in ("gpu", "cuda:x", "mps", ""):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    if torch.cuda.is_available():
        assert resolve_device("cuda:0") == torch.device("cuda:0")
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_resolve_dtype() -> None:
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CUDA, "float32") == torch.float16
    assert resolve_dtype("auto", CPU, "bfloat16") == torch.float32  # fp32 on the CPU
    assert resolve_dtype("auto", CUDA, "bfloat16") == torch.bfloat16  # the checkpoint's on CUDA
    assert resolve_dtype("auto", CUDA, "torch.float16") == torch.float16
    assert resolve_dtype("auto", CUDA, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", CUDA, None) == torch.float32
    with pytest.raises(ValueError, match="dtype must be auto"):
        resolve_dtype("float64", CPU)


def shape(max_pos: int = 1024) -> ModelShape:
    cfg = LlamaConfig(vocab_size=4096, hidden_size=384, num_hidden_layers=8,
                      num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=max_pos)
    return ModelShape.of(cfg)


def test_model_shape_from_a_config() -> None:
    s = shape()
    assert (s.num_layers, s.hidden_size, s.kv_heads, s.head_dim, s.vocab_size,
            s.max_position_embeddings) == (8, 384, 2, 64, 4096, 1024)
    assert s.kv_bytes_per_token(torch.float32) == 2 * 8 * 2 * 64 * 4
    assert s.kv_bytes_per_token(torch.bfloat16) == 2 * 8 * 2 * 64 * 2
    assert s.activation_bytes(torch.float32, 10) == 10 * (8 * 4096 + 8 * 384 * 4)
    assert s.activation_bytes(torch.float32) == s.activation_bytes(torch.float32, MAX_BATCH_TOKENS)
    mha = ModelShape.of(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    assert mha.kv_heads == 4 and mha.head_dim == 16  # no kv heads: multi-head


def test_budget_is_a_whole_number_of_blocks() -> None:
    s = shape()
    per_block = s.kv_bytes_per_token(torch.float32) * 16                      # 256 KiB
    b = kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=10 * per_block + per_block // 2)
    assert b.num_blocks == 10 and b.bytes == 10 * per_block and b.block_size == 16
    assert b.tokens == 160 and b.max_model_len == 160  # less than the model's context
    b = kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=100 * per_block, max_model_len=300)
    assert b.num_blocks == 100 and b.max_model_len == 300
    b = kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=100 * per_block)
    assert b.max_model_len == 1024  # the model's context when the cache holds more
    b = kv_budget(s, torch.bfloat16, CPU, 16, kv_cache_bytes=10 * per_block)
    assert b.num_blocks == 20  # half the bytes per block


def test_cpu_default_budget() -> None:
    b = kv_budget(shape(), torch.float32, CPU, 16)
    assert b.bytes == CPU_KV_CACHE_DEFAULT and b.num_blocks == CPU_KV_CACHE_DEFAULT // (
        shape().kv_bytes_per_token(torch.float32) * 16)


def test_cuda_budget_is_the_gpu_share_less_weights_and_activations() -> None:
    s = shape()
    per_block = s.kv_bytes_per_token(torch.bfloat16) * 16
    act = s.activation_bytes(torch.bfloat16)
    total, weights = 8 << 30, 1 << 30
    b = kv_budget(s, torch.bfloat16, CUDA, 16, weight_bytes=weights, gpu_memory_bytes=total,
                  gpu_memory_utilization=0.5)
    assert b.num_blocks == (int(total * 0.5) - weights - act) // per_block
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_budget(s, torch.bfloat16, CUDA, 16, weight_bytes=4 << 30, gpu_memory_bytes=total,
                  gpu_memory_utilization=0.5)
    # an explicit budget wins over the GPU's share
    b = kv_budget(s, torch.bfloat16, CUDA, 16, kv_cache_bytes=3 * per_block,
                  gpu_memory_bytes=total)
    assert b.num_blocks == 3


def test_budgets_that_cannot_serve_are_refused() -> None:
    s = shape()
    per_block = s.kv_bytes_per_token(torch.float32) * 16
    with pytest.raises(ValueError, match="holds no block"):
        kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=per_block - 1)
    with pytest.raises(ValueError, match="max-model-len 161 does not fit"):
        kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=10 * per_block, max_model_len=161)
    kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=10 * per_block, max_model_len=160)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        kv_budget(shape(max_pos=128), torch.float32, CPU, 16, kv_cache_bytes=10 * per_block,
                  max_model_len=129)
    with pytest.raises(ValueError, match="no room for a request"):
        kv_budget(s, torch.float32, CPU, 16, kv_cache_bytes=10 * per_block, max_model_len=1)
    for util in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="utilization"):
            kv_budget(s, torch.float32, CPU, 16, gpu_memory_utilization=util)
