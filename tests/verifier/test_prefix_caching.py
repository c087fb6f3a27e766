"""Prefix caching through the services: a request that shares a prefix with an earlier one is
served from the verifier's cached blocks, its output unchanged, and ``/metrics`` counts exactly
the tokens the test expects."""

from __future__ import annotations

import random

from service_helpers import collect, request, scrape

BLOCK = 16
QUERIES = 'spin:prefix_cache_queries_total{model="target",role="verifier"}'
HITS = 'spin:prefix_cache_hits_total{model="target",role="verifier"}'


def test_a_shared_prefix_is_found_and_counted(serving) -> None:
    port = serving.child("verifier", "verifier").metrics_port
    rng = random.Random(40)  # token ids no other test sends: nothing of them is cached yet
    first = [rng.randrange(100, 4000) for _ in range(90)]
    second = first[:70] + [rng.randrange(100, 4000) for _ in range(25)]
    before = scrape(port)
    a, _, _ = collect(serving.endpoint, request(ids=first, max_tokens=8, mode="off"))
    mid = scrape(port)
    b, _, _ = collect(serving.endpoint, request(ids=second, max_tokens=8, mode="off"))
    c, _, _ = collect(serving.endpoint, request(ids=second, max_tokens=8, mode="auto"))
    after = scrape(port)
    assert mid[QUERIES] - before.get(QUERIES, 0) == len(first)
    assert mid.get(HITS, 0) - before.get(HITS, 0) == 0
    # the second: the four full blocks of the 70 shared tokens; the third, the same prompt
    # again: every full block of it but the one holding its last token (fed again)
    assert after[QUERIES] - mid[QUERIES] == 2 * len(second)
    assert after[HITS] - mid[HITS] == 70 // BLOCK * BLOCK + (len(second) - 1) // BLOCK * BLOCK
    assert b == c and len(b) == 8  # the cached prefix changes nothing (auto: lossless)
    assert a and len(a) == 8
