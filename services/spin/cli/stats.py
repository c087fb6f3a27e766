"""``spin stats``: the population's acceptance statistics (Redis) as a table."""

from __future__ import annotations

import argparse

from .flags import fail


def add_stats(sub: argparse._SubParsersAction) -> None:
    """``spin stats --redis-url URL``."""
    st = sub.add_parser("stats", help="acceptance statistics of the population (Redis) as a table")
    st.add_argument("--redis-url", required=True, help="e.g. redis://127.0.0.1:6379/0")
    st.set_defaults(func=_stats)


def _stats(args: argparse.Namespace) -> int:
    import redis

    from ..stats import RedisStatsStore

    try:
        redis.Redis.from_url(args.redis_url, socket_connect_timeout=2, socket_timeout=2).ping()
    except (redis.RedisError, ValueError) as e:
        return fail("stats", f"cannot read {args.redis_url}: {e}")
    store = RedisStatsStore(args.redis_url, flush_interval_s=3600)
    try:
        pop = store.population()
    finally:
        store.close()
    if not pop:
        print("no statistics yet")
        return 0
    k_max = max((max(st.drafted_per_pos, default=0) for st in pop.values()), default=0)
    head = (f"{'drafter':18s} {'steps':>7s} {'drafted':>8s} {'accepted':>8s} {'rate':>5s} "
            f"{'alpha':>5s} {'tau':>5s} {'draft ms':>8s} {'verify ms':>9s}  acceptance by position 1..{k_max}")
    print(head)
    for name, st in sorted(pop.items()):
        per_pos = " ".join(f"{st.acceptance_at(i):.2f}" for i in range(1, k_max + 1)
                           if st.drafted_per_pos.get(i))
        print(f"{name:18s} {st.drafts:7d} {st.draft_tokens:8d} {st.accepted_tokens:8d} "
              f"{st.acceptance_rate:5.2f} {st.chain_acceptance:5.2f} "
              f"{st.mean_accepted_length:5.2f} "
              f"{1e3 * st.draft_seconds / max(st.drafts, 1):8.2f} "
              f"{1e3 * st.verify_seconds / max(st.drafts, 1):9.2f}  {per_pos}")
    print("rate = accepted / drafted tokens; alpha = accepted / (accepted + rejections), the "
          "per-token acceptance a chain's length follows; tau = 1 + accepted / steps (vLLM's "
          "mean acceptance length, bonus token included); times are means per step; "
          "NAME@sampled: the steps of sampling requests (NAME: greedy ones)")
    return 0
