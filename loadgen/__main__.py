"""``python -m loadgen``: print a seeded workload (the network client arrives with the services)."""

from __future__ import annotations

import argparse
import collections
import json
import sys

from .workload import build_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jsonl", action="store_true", help="print one request per line as JSON")
    args = p.parse_args(argv)
    if args.num_prompts <= 0:
        p.error("--num-prompts must be > 0")
    try:
        reqs = build_workload(args.num_prompts, args.rate, args.burstiness, args.seed)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    if args.jsonl:
        for r in reqs:
            print(json.dumps(r.__dict__))
    else:
        mix = collections.Counter(r.domain for r in reqs)
        print(f"{len(reqs)} requests over {reqs[-1].arrival_s:.2f} s; mix {dict(mix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
