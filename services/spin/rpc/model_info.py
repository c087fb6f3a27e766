"""The ``ModelInfo`` a drafter or verifier reports: its model, limits, cache and tokenizer."""

from __future__ import annotations

from ..engine.model_runner import ModelRunner
from ..engine.vocab import TokenizerId
from ..v1 import model_info_pb2


def model_info(name: str, model_path: str, runner: ModelRunner,
               tokenizer: TokenizerId | None) -> model_info_pb2.ModelInfo:
    blocks = runner.cache.blocks
    info = model_info_pb2.ModelInfo(
        name=name, model_path=model_path, vocab_size=runner.vocab_size,
        max_context=runner.max_len, max_requests=blocks.max_seqs, block_size=blocks.block_size,
        num_blocks=blocks.num_blocks, device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."), weight_bytes=runner.weight_bytes,
        kv_cache_bytes=runner.cache.nbytes)
    if tokenizer is not None:
        info.tokenizer, info.tokenizer_size = tokenizer.name, tokenizer.size
        info.tokenizer_fingerprint = tokenizer.fingerprint
    return info
