"""Calling a running router from tests."""

from __future__ import annotations

import re
import urllib.request

import grpc

from spin.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2


def request(prompt: str = "", ids: list[int] | None = None, max_tokens: int = 24,
            mode: str = "auto", drafter: str = "", k: int = 0, temperature: float = 0.0,
            seed: int | None = None, **kw) -> generation_pb2.GenerateRequest:
    modes = {"auto": generation_pb2.SPECULATION_MODE_AUTO, "off": generation_pb2.SPECULATION_MODE_OFF,
             "drafter": generation_pb2.SPECULATION_MODE_DRAFTER}
    sampling = sampling_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=ids or [], max_tokens=max_tokens, sampling=sampling,
        speculation=generation_pb2.Speculation(mode=modes[mode], drafter=drafter, k=k), **kw)


def collect(endpoint: str, req: generation_pb2.GenerateRequest, timeout: float = 120.0,
            ) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
    """(token ids, text, last message) of one streamed generation."""
    with grpc.insecure_channel(endpoint) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        ids: list[int] = []
        text = ""
        last = None
        for msg in stub.Generate(req, timeout=timeout):
            ids += msg.token_ids
            text += msg.text
            last = msg
    return ids, text, last


def scrape(port: int) -> dict[str, float]:
    """Prometheus samples of a /metrics endpoint: 'name{labels}' -> value."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        m = re.match(r"^([^#\s][^\s]*)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out
