"""The router over real processes: streaming, losslessness, bad input, cancellation, queue bound,
health, reflection, metrics, Redis statistics (and Redis going away)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from service_helpers import collect, request, scrape

from spin.engine.model_free import MODEL_FREE
from spin.serve import Child, spin_argv
from spin.stats import RedisStatsStore
from spin.v1 import generation_pb2, generation_pb2_grpc

PROMPT = "def parse(path):\n    with open(path) as f:\n"


def test_speculation_is_lossless_and_reports_stats(serving) -> None:
    off, _, last_off = collect(serving.endpoint, request(PROMPT, max_tokens=40, mode="off",
                                                         ignore_eos=True))
    assert len(off) == 40 and last_off.speculation.steps == 40
    for drafter, k in (("draft-code", 4), ("draft-prose", 2), ("prompt-lookup", 6),
                       ("draft-structured", 8), ("eagle", 4)):  # eagle: the family's head
        ids, text, last = collect(serving.endpoint, request(PROMPT, max_tokens=40, mode="drafter",
                                                            drafter=drafter, k=k, ignore_eos=True))
        assert ids == off, drafter
        s = last.speculation
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 40 and last.usage.prompt_tokens > 0
        assert s.steps < 40 or drafter == "draft-structured"  # code drafts do accept on code
        assert s.tau == pytest.approx(40 / s.steps)
        if s.drafters:
            assert s.drafters[0].drafter == drafter
            assert s.accepted_tokens <= s.draft_tokens
    _, text_off, _ = collect(serving.endpoint, request(PROMPT, max_tokens=40, mode="off",
                                                       ignore_eos=True))
    assert text_off.strip()


def _messages(endpoint: str, req: generation_pb2.GenerateRequest,
              ) -> list[generation_pb2.GenerateResponse]:
    with grpc.insecure_channel(endpoint) as ch:
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))


@pytest.mark.parametrize("mode, drafter, k", [("auto", "", 0), ("drafter", "draft-code", 4)])
def test_every_message_carries_the_step_that_produced_it(serving, mode, drafter, k) -> None:
    msgs = _messages(serving.endpoint, request(PROMPT, max_tokens=40, mode=mode, drafter=drafter,
                                               k=k, ignore_eos=True))
    s = msgs[-1].speculation
    steps = [m.step for m in msgs]
    # each target forward is a step; plain steps may run several to a message (--plain-steps)
    assert all(m.HasField("step") for m in msgs) and sum(st.forwards for st in steps) == s.steps
    assert sum(st.accepted_tokens for st in steps) == s.accepted_tokens
    assert sum(st.draft_tokens for st in steps) == s.draft_tokens
    assert sum(st.forwards for st in steps if not st.drafter) == s.steps_without_speculation
    for d in s.drafters:  # the per-step account adds up to the request's per-drafter one
        mine = [st for st in steps if st.drafter == d.drafter]
        assert (len(mine), sum(st.accepted_tokens for st in mine)) == (d.steps, d.accepted_tokens)
    for m, st in zip(msgs[:-1], steps):  # the accepted drafts and the target's own token(s)
        assert len(m.token_ids) == st.accepted_tokens + st.forwards
        assert st.forwards == 1 or not st.drafter
        # a chain drafts at most k tokens, a tree more (its nodes), and either gets at most k
        # (one path) accepted
        assert st.accepted_tokens <= min(st.draft_tokens, st.k) or not st.drafter
        assert st.step_seconds > 0 and st.batch_size >= 1
    if mode == "drafter":
        assert {st.drafter for st in steps} == {drafter} and {st.k for st in steps} <= {4, 3, 2, 1}
    else:  # the learned policy predicts the steps of requests in mode auto from its cost model
        assert all(st.predicted_step_seconds > 0 for st in steps if st.forwards == 1)
        assert steps[0].drafter in ("", *MODEL_FREE)  # the models score the prompt instead


def test_seeded_sampling_is_reproducible(serving) -> None:
    a, _, _ = collect(serving.endpoint, request(PROMPT, max_tokens=20, temperature=0.8, seed=7,
                                                mode="drafter", drafter="draft-code", k=3))
    b, _, _ = collect(serving.endpoint, request(PROMPT, max_tokens=20, temperature=0.8, seed=7,
                                                mode="drafter", drafter="draft-code", k=3))
    assert a == b and len(a) > 0


def test_stop_strings_end_the_stream(serving) -> None:
    _, full, _ = collect(serving.endpoint, request(PROMPT, max_tokens=40, mode="off"))
    stop = full.strip()[:3]
    assert stop
    _, text, last = collect(serving.endpoint, request(PROMPT, max_tokens=40, mode="off",
                                                      stop=[stop]))
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert stop not in text and full.startswith(text)


@pytest.mark.parametrize("bad, message", [
    (request("", max_tokens=5), "empty"),
    (request("x", max_tokens=0), "max_tokens"),
    (request("x", max_tokens=5000), "exceeds the context"),
    (request("x", temperature=-1.0), "temperature"),
    (request("x " * 1500, max_tokens=5), "context"),
    (request("x", mode="drafter", drafter="nope"), "unknown drafter"),
    (request(ids=[10 ** 6], max_tokens=5), "prompt_token_ids"),
])
def test_bad_requests_get_invalid_argument(serving, bad, message) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(serving.endpoint, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_bad_requests_do_not_disturb_others(serving) -> None:
    good = request(PROMPT, max_tokens=48, mode="drafter", drafter="draft-code", k=4,
                   ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(collect, serving.endpoint, good) for _ in range(3)]
        bad = [pool.submit(collect, serving.endpoint, request("", max_tokens=3)) for _ in range(5)]
        for f in bad:
            with pytest.raises(grpc.RpcError):
                f.result()
        outputs = [f.result()[0] for f in running]
    assert all(len(o) == 48 for o in outputs) and outputs[0] == outputs[1] == outputs[2]


def _verifier_slots_in_use(serving) -> float:
    port = serving.child("verifier", "verifier").metrics_port
    return sum(v for k, v in scrape(port).items() if k.startswith("spin:kv_cache_usage_perc"))


def _wait_until(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_cancel_and_deadline_free_the_caches(serving) -> None:
    with grpc.insecure_channel(serving.endpoint) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        call = stub.Generate(request(PROMPT, max_tokens=600, mode="drafter", drafter="draft-code",
                                     k=2, ignore_eos=True))
        next(call)
        assert _verifier_slots_in_use(serving) > 0  # the request holds a verifier slot
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(PROMPT, max_tokens=600, mode="off", ignore_eos=True),
                               timeout=0.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_until(lambda: _verifier_slots_in_use(serving) == 0), "caches were not freed"
    drafter_port = serving.child("drafter", "draft-code").metrics_port
    assert _wait_until(lambda: sum(v for k, v in scrape(drafter_port).items()
                                   if k.startswith("spin:kv_cache_usage_perc")) == 0)


def test_queue_bound_gives_resource_exhausted(serving, tmp_path: Path) -> None:
    verifier = serving.child("verifier", "verifier")
    router = Child("router-small", spin_argv(
        "router", "--verifier", f"127.0.0.1:{verifier.port}", "--tokenizer",
        str(serving.cfg.family_dir / "target"), "--port", "0", "--max-batch", "1",
        "--max-queue", "1"), tmp_path, None)
    try:
        router.wait_ready(120)
        endpoint = f"127.0.0.1:{router.port}"
        long = request(PROMPT, max_tokens=200, mode="off", ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(collect, endpoint, long) for _ in range(4)]
            codes = []
            for f in futures:
                try:
                    f.result()
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
                    assert "waiting" in e.details()
        assert codes.count("RESOURCE_EXHAUSTED") >= 1 and codes.count("OK") >= 2, codes
    finally:
        router.stop(10)


def test_health_and_reflection(serving) -> None:
    for port in (serving.router.port, serving.child("verifier", "verifier").port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(serving.endpoint) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert "spin.v1.Generation" in services and "grpc.health.v1.Health" in services


@pytest.mark.parametrize("drafter", ["draft-code", "eagle"])  # a drafter service, a head
def test_metrics_and_redis_statistics(serving, drafter: str) -> None:
    before = scrape(serving.router.metrics_port)
    _, _, last = collect(serving.endpoint, request(PROMPT, max_tokens=32, mode="drafter",
                                                   drafter=drafter, k=4, ignore_eos=True))
    after = scrape(serving.router.metrics_port)
    key = f'spin:spec_decode_num_drafts_total{{draft_model="{drafter}"}}'
    steps = last.speculation.drafters[0].steps
    assert last.speculation.drafters[0].drafter == drafter and steps > 0
    assert after[key] - before.get(key, 0) == steps
    acc = f'spin:spec_decode_num_accepted_tokens_total{{draft_model="{drafter}"}}'
    assert after[acc] - before.get(acc, 0) == last.speculation.accepted_tokens
    store = RedisStatsStore(serving.redis.url)
    try:
        assert _wait_until(lambda: store.population().get(drafter) is not None
                           and store.population()[drafter].drafts >= steps)
    finally:
        store.close()


def test_router_keeps_serving_without_redis_and_catches_up(serving) -> None:
    def prose() -> tuple[int, int]:
        store = RedisStatsStore(serving.redis.url)
        try:
            stats = store.population().get("draft-prose")
            return (stats.drafts, stats.accepted_tokens) if stats else (0, 0)
        finally:
            store.close()

    time.sleep(1.0)  # the router's last flush (every 0.5 s) is in
    before = prose()
    serving.redis.stop()
    _, _, last = collect(serving.endpoint, request(PROMPT, max_tokens=32, mode="drafter",
                                                   drafter="draft-prose", k=3, ignore_eos=True))
    assert last.usage.completion_tokens == 32
    assert _wait_until(lambda: scrape(serving.router.metrics_port).get(
        "spin:stats_store_errors_total", 0) >= 1), "the failed writes were not counted"
    serving.redis.restart()  # with what it had (spin serve keeps Redis's data on disk)
    steps = last.speculation.drafters[0].steps
    assert _wait_until(lambda: prose()[0] == before[0] + steps, timeout=30), (before, prose())
    assert prose() == (before[0] + steps, before[1] + last.speculation.accepted_tokens)


def test_loadgen_against_spin_serve(serving, tmp_path: Path) -> None:
    """The issue's bar: 64 prompts, all at once, 32 concurrent, lossless check: no errors."""
    out = tmp_path / "loadgen.json"
    r = subprocess.run([sys.executable, "-m", "loadgen", "--endpoint", serving.endpoint,
                        "--num-prompts", "64", "--rate", "inf", "--max-concurrency", "32",
                        "--max-tokens", "48",  # the bar is the load, not the length
                        "--check-lossless", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["completed"] == 64 and report["errors"] == 0
    assert report["lossless_mismatches"] == 0
    assert report["speculation"]["draft_tokens"] > 0


def test_two_micro_batches_are_lossless_and_both_step(serving, tmp_path: Path) -> None:
    """A router pipelining two micro-batches (one drafted while the other is verified)."""
    verifier = serving.child("verifier", "verifier")
    code = serving.child("drafter", "draft-code")
    router = Child("router-piped", spin_argv(
        "router", "--verifier", f"127.0.0.1:{verifier.port}", "--tokenizer",
        str(serving.cfg.family_dir / "target"), "--port", "0", "--metrics-port", "0",
        "--drafter", f"draft-code=127.0.0.1:{code.port}", "--micro-batches", "2",
        "--policy", "fixed"), tmp_path, None)
    try:
        router.wait_ready(120)
        endpoint = f"127.0.0.1:{router.port}"
        prompts = [PROMPT, "import os\nimport sys\n\n", "def main():\n", "class A:\n    x = 1\n"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            spec = [pool.submit(collect, endpoint, request(p, max_tokens=40, mode="drafter",
                                                            drafter="draft-code", k=3,
                                                            ignore_eos=True)) for p in prompts]
            outs = [f.result()[0] for f in spec]
        offs = [collect(serving.endpoint, request(p, max_tokens=40, mode="off",
                                                  ignore_eos=True))[0] for p in prompts]
        assert outs == offs
        # steps ran, and with 4 concurrent requests split over two lanes none carried all four
        hist = scrape(router.metrics_port)
        assert hist["spin:batch_size_count"] > 0
        assert hist['spin:batch_size_bucket{le="2.0"}'] == hist["spin:batch_size_count"]
    finally:
        router.stop(10)


def test_a_mixed_workload_uses_the_drafter_that_fits_each_domain(
        serving_model_drafters) -> None:
    """Code prompts draft mostly with the code model, prose prompts with the prose model (the
    learned policy's prompt fit, here by prompt agreement alone: the fixture's doc), and every
    output equals the target decoding alone. Counted over both domains: one of the code prompts
    fits the prose model best by its prompt, and steps before the prompt scores arrive may go to
    any drafter, while a broken fit would draft with the wrong specialist about as often as with
    the right one."""
    from spin.engine.model_free import MODEL_FREE
    from spin.zoo.corpus import heldout_prompts
    from spin.zoo.specs import FAMILY_DIR

    serving = serving_model_drafters
    used: dict[str, dict[str, int]] = {}
    for domain in ("code", "prose"):
        steps: dict[str, int] = {}
        for row in heldout_prompts(FAMILY_DIR, (domain,))[:4]:
            ids, _, last = collect(serving.endpoint, request(row["prompt"], max_tokens=48,
                                                             ignore_eos=True))
            off, _, _ = collect(serving.endpoint, request(row["prompt"], max_tokens=48,
                                                          mode="off", ignore_eos=True))
            assert ids == off
            for d in last.speculation.drafters:
                if d.drafter not in MODEL_FREE:
                    steps[d.drafter] = steps.get(d.drafter, 0) + d.steps
        used[domain] = steps
    matched = used["code"].get("draft-code", 0) + used["prose"].get("draft-prose", 0)
    crossed = used["code"].get("draft-prose", 0) + used["prose"].get("draft-code", 0)
    assert matched >= 2 * crossed and matched > 0, used
    assert max(used["code"], key=used["code"].get) == "draft-code", used


def test_the_step_trace_records_each_step_the_stream_reported(serving) -> None:
    """``--step-trace``: one line per verified step, with the request's drafter, k, drafted and
    accepted tokens as its stream reported them, and the step's times beside their prediction."""
    from spin.router.step_trace import read_trace

    msgs = _messages(serving.endpoint, request(PROMPT + "    # traced\n", max_tokens=24,
                                               mode="drafter", drafter="draft-code", k=3,
                                               ignore_eos=True))
    rid = msgs[0].request_id
    path = serving.cfg.router.scheduler.step_trace
    deadline = time.monotonic() + 30  # the stream may reach us before the line is written
    while True:
        mine = [(rec, row) for rec in read_trace(path) for row in rec["requests"]
                if row[0] == rid]
        if len(mine) >= len(msgs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(mine) == len(msgs)
    for (rec, row), m in zip(mine, msgs):
        _, drafter, k, drafted, accepted, emitted, greedy, prefilled = row
        assert prefilled == (m is msgs[0])
        assert (drafter or "", k, drafted, accepted) == (
            m.step.drafter, m.step.k, m.step.draft_tokens, m.step.accepted_tokens)
        assert greedy is True and emitted == len(m.token_ids)
        assert rec["batch"] == m.step.batch_size and rec["step_s"] > 0
        if drafter:
            assert rec["draft_s"]["draft-code"] > 0 and rec["verify_s"] > 0
