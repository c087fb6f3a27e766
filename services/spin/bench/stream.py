"""One request through a router's gRPC ``Generate``, streamed to its end, as the benchmarks that
build their own requests (structured output, Predicted Outputs) time it."""

from __future__ import annotations

import time

import grpc

from ..v1 import generation_pb2, generation_pb2_grpc, sampling_pb2


def request(prompt: str, mode: str, temperature: float, seed: int,
            new_tokens: int) -> generation_pb2.GenerateRequest:
    """A request for ``prompt`` with speculation ``mode`` (``auto``/``off``), sampled at
    ``temperature`` with ``seed`` (0: greedy, no seed)."""
    sampling = sampling_pb2.SamplingParams(temperature=temperature)
    if temperature > 0:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(
        prompt=prompt, max_tokens=new_tokens, sampling=sampling,
        speculation=generation_pb2.Speculation(
            mode=generation_pb2.SPECULATION_MODE_OFF if mode == "off"
            else generation_pb2.SPECULATION_MODE_AUTO))


def generate(endpoint: str, req: generation_pb2.GenerateRequest) -> dict:
    """``req`` through ``endpoint``: its ``tokens``, ``text``, end-to-end seconds (``e2e_s``),
    verification ``steps``, ``accepted`` draft tokens, accepted tokens per drafter
    (``drafters``) and the last message's ``usage``."""
    ids: list[int] = []
    text, last = "", None
    start = time.perf_counter()
    with grpc.insecure_channel(endpoint) as ch:
        for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=600):
            ids += msg.token_ids
            text += msg.text
            last = msg
    spec = last.speculation if last is not None else generation_pb2.SpeculationStats()
    return {"tokens": ids, "text": text, "e2e_s": time.perf_counter() - start,
            "steps": spec.steps, "accepted": spec.accepted_tokens,
            "drafters": {d.drafter: d.accepted_tokens for d in spec.drafters},
            "usage": last.usage if last is not None else generation_pb2.Usage()}
