"""``spin bench api``: the same single streams through the gRPC API and the OpenAI-compatible
HTTP API (server-sent events), side by side in one run.

One embedded deployment (``spin serve``'s processes). Per prompt and round, alternately (the
order swapped every other prompt, so neither API always runs second): the request streamed over
gRPC, then over HTTP (``POST /v1/completions``, ``stream: true``, read with the standard
library's HTTP client and every event parsed, as a client would). Greedy, speculation auto,
``new_tokens`` each (EOS ignored). Reported: tokens/s of each (per request: tokens over the
time from sending to the last token; medians), their ratio, and whether both returned the same
tokens (``return_token_ids``).
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from ..serve import Embedded, ServeConfig
from ..v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from ..zoo.corpus import heldout_prompts
from ..zoo.specs import FAMILY_DIR


@dataclass
class ApiBenchConfig:
    """What the API benchmark runs."""

    family_dir: Path = FAMILY_DIR
    prompts: int = 8
    """Held-out prompts (every domain)."""
    rounds: int = 3
    """Passes over the prompts (per-request medians over them)."""
    new_tokens: int = 64


def _grpc(stub, prompt: str, n: int) -> tuple[list[int], float]:
    req = generation_pb2.GenerateRequest(
        prompt=prompt, max_tokens=n, ignore_eos=True,
        sampling=sampling_pb2.SamplingParams(temperature=0.0),
        speculation=generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_AUTO))
    t0 = time.perf_counter()
    ids: list[int] = []
    for msg in stub.Generate(req, timeout=300):
        ids += msg.token_ids
    return ids, time.perf_counter() - t0


def _http(port: int, model: str, prompt: str, n: int) -> tuple[list[int], float]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "stream": True, "ignore_eos": True, "return_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    ids: list[int] = []
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ids += json.loads(data)["choices"][0]["token_ids"]
    finally:
        conn.close()
    return ids, time.perf_counter() - t0


def run_api_bench(cfg: ApiBenchConfig) -> dict:
    prompts = [r["prompt"] for r in heldout_prompts(cfg.family_dir)[:: 3]][:cfg.prompts]
    log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-api-"))
    grpc_s: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    http_s: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    same = True
    with Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, log_dir=log_dir,
                              redis=False)) as emb, \
            grpc.insecure_channel(emb.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        port = emb.router.http_port
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/v1/models")
            model = json.loads(conn.getresponse().read())["data"][0]["id"]
        finally:
            conn.close()
        _grpc(stub, prompts[0], 8)  # warm-up: both paths once
        _http(port, model, prompts[0], 8)
        with tqdm(total=cfg.rounds * len(prompts) * 2, desc="gRPC vs HTTP", unit="req") as bar:
            for r in range(cfg.rounds):
                for i, prompt in enumerate(prompts):
                    order = ("grpc", "http") if (i + r) % 2 == 0 else ("http", "grpc")
                    out = {}
                    for api in order:
                        out[api] = (_grpc(stub, prompt, cfg.new_tokens) if api == "grpc"
                                    else _http(port, model, prompt, cfg.new_tokens))
                        bar.update(1)
                    same &= out["grpc"][0] == out["http"][0]
                    grpc_s[i].append(len(out["grpc"][0]) / out["grpc"][1])
                    http_s[i].append(len(out["http"][0]) / out["http"][1])
    g = [statistics.median(v) for v in grpc_s.values()]
    h = [statistics.median(v) for v in http_s.values()]
    per = [b / a for a, b in zip(g, h)]
    return {"prompts": len(prompts), "rounds": cfg.rounds, "new_tokens": cfg.new_tokens,
            "tok_s_grpc": statistics.median(g), "tok_s_http": statistics.median(h),
            "ratio_http_vs_grpc": statistics.median(h) / statistics.median(g),
            "ratio_median_per_prompt": statistics.median(per), "same_tokens": same,
            "per_prompt": [{"grpc": a, "http": b} for a, b in zip(g, h)]}
