"""Service discovery through the Kubernetes API (a stand-in API server: no cluster runs here).

Unit level: EndpointSlices -> addresses; the watch follows adds, changes, deletes, relists after
410 Gone, and filters by label selector. End to end: a router with ``--discovery kubernetes`` over
real verifier and drafter processes while replicas are added, removed and replaced under streaming
requests: every request completes with the target's own output, requests never reach a replica that
lacks their context (no resyncs anywhere), and new replicas take new work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import time

import pytest
from kube_stub import FakeKubeAPI, endpoint_slice
from service_helpers import collect, request, scrape

from spin.router.discovery import (Endpoints, KubernetesDiscovery, KubernetesDiscoveryConfig,
                                   endpoints_from_slices)
from spin.serve import Child, spin_argv
from spin.zoo.specs import FAMILY_DIR

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

RELEASE = {"app.kubernetes.io/instance": "test"}
SELECTOR = "app.kubernetes.io/instance=test"


def verifier_slice(name: str, addr: str, port: int, ready: bool = True) -> dict:
    return endpoint_slice(name, {**RELEASE, "spin.dev/role": "verifier"}, [addr], port, ready)


def drafter_slice(name: str, drafter: str, addr: str, port: int) -> dict:
    return endpoint_slice(name, {**RELEASE, "spin.dev/role": "drafter", "spin.dev/drafter": drafter},
                          [addr], port)


def test_endpoints_from_slices_keeps_ready_spin_endpoints() -> None:
    slices = [verifier_slice("v-1", "10.0.0.1", 50061),
              verifier_slice("v-2", "10.0.0.2", 50061, ready=False),  # terminating: no new work
              drafter_slice("d-1", "draft-code", "10.0.1.1", 50071),
              drafter_slice("d-2", "draft-code", "fd00::5", 50071),
              endpoint_slice("redis", {**RELEASE}, ["10.0.2.1"], 6379)]  # not a spin service
    eps = endpoints_from_slices(slices)
    assert eps.verifier == {"10.0.0.1:50061"}
    assert eps.drafters == {"draft-code": {"10.0.1.1:50071", "[fd00::5]:50071"}}
    two_ports = verifier_slice("v-3", "10.0.0.3", 50061)
    two_ports["ports"].insert(0, {"name": "metrics", "port": 9090})
    assert endpoints_from_slices([two_ports]).verifier == {"10.0.0.3:50061"}  # the port named grpc


def test_watch_follows_changes_relists_after_410_and_filters_by_label() -> None:
    api = FakeKubeAPI()
    seen: list[Endpoints] = []

    async def until(pred, timeout_s: float = 15.0) -> None:
        end = time.monotonic() + timeout_s
        while not (seen and pred(seen[-1])):
            assert time.monotonic() < end, f"discovery saw {seen[-1:] or 'nothing'}"
            await asyncio.sleep(0.05)

    async def go() -> int:
        api.put(verifier_slice("v-1", "10.0.0.1", 50061))
        api.put(endpoint_slice("other", {"app.kubernetes.io/instance": "other",
                                         "spin.dev/role": "verifier"}, ["10.9.9.9"], 50061))
        disc = KubernetesDiscovery(KubernetesDiscoveryConfig(SELECTOR, "serving", api.url,
                                                             retry_s=0.1), seen.append)
        disc.start()
        await until(lambda e: e.verifier == {"10.0.0.1:50061"})
        api.put(drafter_slice("d-1", "draft-code", "10.0.1.1", 50071))
        await until(lambda e: e.drafters == {"draft-code": {"10.0.1.1:50071"}})
        api.put(verifier_slice("v-1", "10.0.0.7", 50061))  # MODIFIED: the pod was replaced
        await until(lambda e: e.verifier == {"10.0.0.7:50061"})
        lists = disc.lists
        api.expire()  # the watch's resourceVersion is compacted away: 410, then a fresh list
        api.delete("d-1")
        await until(lambda e: e.drafters == {} and disc.lists > lists)
        disc.stop()
        return lists

    try:
        asyncio.run(go())
    finally:
        api.close()
    assert all("10.9.9.9:50061" not in e.verifier for e in seen)  # another release's slice
    assert all(q.get("labelSelector") == [SELECTOR] for q in api.requests)


# ---- end to end over real processes -------------------------------------------------------------
PROMPTS = ["def parse(path):\n    with open(path) as f:\n", "The old harbour town was",
           "for i in range(10):\n    print(", "Once upon a time, the", "import os\nimport sys\n\n",
           "She opened the letter and", "class Stack:\n    def __init__(self):\n", "The river"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two verifier and three draft-code replicas (processes), a stand-in API, and a router."""
    logs = tmp_path_factory.mktemp("discovery")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               OMP_WAIT_POLICY="PASSIVE")
    common = ("--port", "0", "--metrics-port", "0", "--threads", "1", "--slots", "32")
    children = {f"verifier-{i}": Child(f"verifier-{i}", spin_argv("verifier", "--model",
                                                               str(FAMILY_DIR / "target"), *common),
                                       logs, env) for i in (1, 2)}
    children |= {f"drafter-{i}": Child(f"drafter-{i}", spin_argv(
        "drafter", "--model", str(FAMILY_DIR / "draft-code"), "--name", "draft-code", *common),
        logs, env) for i in (1, 2, 3)}
    api = FakeKubeAPI()
    router = None
    try:
        for c in children.values():
            c.wait_ready(180)
        api.put(verifier_slice("verifier-1", "127.0.0.1", children["verifier-1"].port))
        api.put(drafter_slice("drafter-1", "draft-code", "127.0.0.1", children["drafter-1"].port))
        router = Child("router", spin_argv(
            "router", "--tokenizer", str(FAMILY_DIR / "target"), "--port", "0",
            "--metrics-port", "0", "--discovery", "kubernetes", "--label-selector", SELECTOR,
            "--namespace", "serving", "--kube-api", api.url, "--policy", "fixed",
            "--default-drafter", "draft-code", "--default-k", "4"), logs, env)
        router.wait_ready(120)
        yield api, children, router
    finally:
        for c in [router, *children.values()]:
            if c is not None:
                c.stop(10)
        api.close()


def test_replicas_come_and_go_under_streaming_requests(cluster) -> None:
    api, children, router = cluster
    endpoint = f"127.0.0.1:{router.port}"
    reqs = [request(p, max_tokens=48, ignore_eos=True) for p in PROMPTS]
    expected = [collect(endpoint, request(p, max_tokens=48, ignore_eos=True, mode="off"))[0]
                for p in PROMPTS]

    def changes() -> None:  # while the first wave streams
        time.sleep(0.5)
        api.put(verifier_slice("verifier-2", "127.0.0.1", children["verifier-2"].port))
        api.put(drafter_slice("drafter-2", "draft-code", "127.0.0.1", children["drafter-2"].port))
        time.sleep(1.0)
        api.delete("verifier-1")  # its requests move to verifier-2 with their whole context
        time.sleep(1.0)
        api.delete("drafter-1")  # replaced by a new pod
        api.put(drafter_slice("drafter-3", "draft-code", "127.0.0.1", children["drafter-3"].port))
        api.put(verifier_slice("verifier-1b", "127.0.0.1", children["verifier-1"].port))

    with concurrent.futures.ThreadPoolExecutor(len(reqs) * 2 + 1) as pool:
        wave1 = [pool.submit(collect, endpoint, r) for r in reqs]
        pool.submit(changes).result()
        wave2 = [pool.submit(collect, endpoint, r) for r in reqs]  # spread over the new replicas
        outs = [f.result() for f in wave1 + wave2]
    for (ids, _, last), want in zip(outs, expected * 2):
        assert ids == want  # none lost, none changed
        assert last.speculation.steps < 48  # speculation went on through the changes

    m = {name: scrape(c.metrics_port) for name, c in children.items()}
    for name, samples in m.items():  # pinned: no task ever reached a replica lacking its context
        assert sum(v for k, v in samples.items() if k.startswith("spin:service_resyncs_total")) == 0
    served = {name: sum(v for k, v in s.items() if k.startswith("spin:service_batch_requests_count"))
              for name, s in m.items()}
    assert served["verifier-2"] > 0 and served["drafter-2"] > 0 and served["drafter-3"] > 0, served
    r = scrape(router.metrics_port)
    assert r['spin:replicas{drafter="",role="verifier"}'] == 2
    assert r['spin:replicas{drafter="draft-code",role="drafter"}'] == 2
    assert r.get('spin:request_errors_total{code="UNAVAILABLE"}', 0) == 0


def test_requests_of_one_prefix_go_to_the_replica_that_caches_it(cluster) -> None:
    """Cache-aware routing over two verifier processes: requests sharing a 96-token prefix, sent
    together, all go to the replica that served it first, whose prefix cache serves every one
    of its six blocks; the other replica computes none of it."""
    api, children, router = cluster
    api.put(verifier_slice("verifier-2", "127.0.0.1", children["verifier-2"].port))
    deadline = time.monotonic() + 60
    while scrape(router.metrics_port).get('spin:replicas{drafter="",role="verifier"}') != 2:
        assert time.monotonic() < deadline, "the router never saw both verifier replicas"
        time.sleep(0.2)
    endpoint = f"127.0.0.1:{router.port}"
    rng = random.Random(41)  # token ids no other test sends
    system = [rng.randrange(100, 4000) for _ in range(96)]
    hits = 'spin:prefix_cache_hits_total{model="target",role="verifier"}'
    verifiers = {n: c for n, c in children.items() if n.startswith("verifier")}
    before = {n: scrape(c.metrics_port).get(hits, 0) for n, c in verifiers.items()}
    routed = 'spin:prefix_routing_total{drafter="",outcome="home",role="verifier"}'
    home_before = scrape(router.metrics_port).get(routed, 0)
    collect(endpoint, request(ids=system + [5] * 10, max_tokens=4, mode="off"))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: collect(endpoint, request(
            ids=system + [rng.randrange(100, 4000) for _ in range(12)], max_tokens=8)),
            range(6)))
    assert all(len(ids) == 8 for ids, _, _ in outs)
    gained = sorted(scrape(c.metrics_port).get(hits, 0) - before[n] for n, c in verifiers.items())
    assert gained == [0, 6 * 96]
    assert scrape(router.metrics_port).get(routed, 0) - home_before == 6
