"""A verifier under a KV cache budget far smaller than its load: ``spin serve`` with a 64 MiB
verifier cache (about 2,700 tokens of the demo target in fp32) serves 64 concurrent requests of
~500-token prompts. The router admits by free blocks and requeues the requests the verifier
preempts; every request completes with the target's own greedy output, and the verifier's
memory stays within its weights, its budget and a fixed overhead."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from service_helpers import collect, request, scrape
from transformers import AutoTokenizer

from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.memory import parse_size
from spin.engine.model_runner import ModelRunner, RunnerConfig
from spin.engine.verifier import Verifier
from spin.router.config import RouterConfig, SchedulerConfig
from spin.serve import Embedded, ServeConfig
from spin.zoo.corpus import heldout_prompts

REQUESTS = 64
PROMPT_TOKENS = 500
NEW = 64
BUDGET = "64MiB"
OVERHEAD = 700 << 20
"""What the verifier process holds besides its weights and KV budget: Python, torch, gRPC and
a forward's activations (measured: see the README's KV cache section)."""


def _prompts(family_dir: Path) -> list[list[int]]:
    """64 prompts of ~500 tokens: held-out documents joined, each request its own mix."""
    tok = AutoTokenizer.from_pretrained(family_dir / "target")
    docs = [tok(r["prompt"] + r["reference"], add_special_tokens=False)["input_ids"]
            for r in heldout_prompts(family_dir)]
    out = []
    for i in range(REQUESTS):
        ids: list[int] = []
        j = i
        while len(ids) < PROMPT_TOKENS:
            ids += docs[j % len(docs)]
            j += 7
        out.append(ids[:PROMPT_TOKENS - 20 + i % 40])
    return out


def _rss(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10)


@pytest.fixture(scope="module")
def reference(family_dir: Path) -> list[list[int]]:
    engine = SpecEngine(Verifier(ModelRunner(family_dir / "target", max_seqs=8)), {}, eos_id=None)
    prompts = _prompts(family_dir)
    out = []
    for i in range(0, REQUESTS, 8):
        out += [r.tokens for r in engine.generate(
            [GenerationRequest(f"r{j}", tuple(p), NEW) for j, p in enumerate(prompts[i:i + 8], i)])]
    return out


def test_64_long_requests_through_a_64mib_verifier_cache(family_dir: Path, reference,
                                                         tmp_path: Path) -> None:
    prompts = _prompts(family_dir)
    cfg = ServeConfig(port=0, drafters=["draft-code"], redis=False, log_dir=tmp_path,
                      router=RouterConfig(policy="fixed", default_drafter="draft-code", default_k=4,
                                          scheduler=SchedulerConfig(max_batch=32)),
                      runner=RunnerConfig(kv_cache_memory=parse_size(BUDGET)),
                      drafter_kv_cache_memory=parse_size("16MiB"))
    with Embedded(cfg) as emb:
        verifier = emb.child("verifier", "verifier")
        start_rss, _ = _rss(verifier.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(collect, emb.endpoint, request(ids=p, max_tokens=NEW,
                                                                  ignore_eos=True), 600)
                       for p in prompts]
            results = [f.result(timeout=900) for f in futures]
        rss, peak = _rss(verifier.proc.pid)
        samples = scrape(verifier.metrics_port)
        router = scrape(emb.router.metrics_port)
    assert [ids for ids, _, _ in results] == reference  # lossless, every request complete
    assert all(last.finish_reason for _, _, last in results)
    preempted = samples.get('spin:num_preemptions_total{model="target",role="verifier"}', 0)
    assert preempted > 0, "the budget should have preempted some requests"
    assert router.get('spin:request_errors_total{code="RESOURCE_EXHAUSTED"}', 0) == 0
    weights = 62 << 20  # the demo target in fp32
    print(f"verifier: {preempted:.0f} preemptions; resident {rss >> 20} MiB after, peak "
          f"{peak >> 20} MiB, {start_rss >> 20} MiB at start; weights + budget "
          f"{(weights + parse_size(BUDGET)) >> 20} MiB")
    assert peak <= weights + parse_size(BUDGET) + OVERHEAD
