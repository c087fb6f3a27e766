"""The repetitive/structured domain: JSON records, log lines, CSV and Markdown tables, INI files.

Generated from a seed, so every machine builds the same documents with no input files. The shapes
repeat within a document (same keys, same columns, same log format) while values vary: that is what
makes this domain easy for n-gram prompt lookup and for drafts that learned the formats.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

_FIRST = ["ada", "alan", "grace", "linus", "guido", "barbara", "ken", "dennis", "margaret",
          "edsger", "donald", "frances", "john", "radia", "tim", "vint", "sophie", "yukihiro"]
_LAST = ["lovelace", "turing", "hopper", "torvalds", "rossum", "liskov", "thompson", "ritchie",
         "hamilton", "dijkstra", "knuth", "allen", "backus", "perlman", "berners", "cerf", "wilson"]
_CITIES = ["Lisbon", "Oslo", "Kyoto", "Austin", "Nairobi", "Lima", "Tallinn", "Hanoi", "Perth",
           "Quebec", "Porto", "Gdansk", "Accra", "Dublin", "Seoul", "Leeds"]
_PRODUCTS = ["widget", "gadget", "sprocket", "flange", "gasket", "bracket", "spindle", "valve",
             "coupler", "bearing", "rotor", "sensor", "relay", "switch", "cable", "adapter"]
_SERVICES = ["api-gateway", "auth", "billing", "search", "inventory", "scheduler", "mailer",
             "ingest", "reports", "cache"]
_LEVELS = ["INFO"] * 6 + ["DEBUG"] * 3 + ["WARN"] * 2 + ["ERROR"]
_MESSAGES = [
    "request completed", "cache miss for key {key}", "retrying upstream call (attempt {n})",
    "user {user} logged in", "connection reset by peer", "slow query took {ms} ms",
    "scheduled job {key} finished", "rate limit exceeded for {user}", "health check ok",
    "config reloaded", "queue depth {n}", "payment {key} authorised", "token expired for {user}",
]
_PATHS = ["/api/v1/users", "/api/v1/orders", "/api/v1/items/{n}", "/health", "/login",
          "/static/app.js", "/api/v2/search?q={key}", "/metrics"]


def _user(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)}.{rng.choice(_LAST)}"


def _stamp(rng: random.Random, base: int) -> str:
    s = base
    return (f"2024-{1 + s // 2_600_000 % 12:02d}-{1 + s // 86_400 % 28:02d}T"
            f"{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}Z")


def _json_records(rng: random.Random) -> str:
    kind = rng.choice(["user", "order", "event"])
    lines = []
    for i in range(rng.randint(8, 30)):
        if kind == "user":
            rec = {"id": 1000 + i, "name": _user(rng), "city": rng.choice(_CITIES),
                   "age": rng.randint(18, 80), "active": rng.random() < 0.8}
        elif kind == "order":
            rec = {"order_id": f"ord-{rng.randint(10000, 99999)}", "item": rng.choice(_PRODUCTS),
                   "qty": rng.randint(1, 20), "price": round(rng.uniform(1, 500), 2),
                   "status": rng.choice(["paid", "shipped", "pending", "cancelled"])}
        else:
            rec = {"ts": _stamp(rng, 1_000_000 + i * 37), "service": rng.choice(_SERVICES),
                   "latency_ms": rng.randint(1, 900), "ok": rng.random() < 0.9}
        lines.append(json.dumps(rec, indent=2 if rng.random() < 0.2 else None))
    return "\n".join(lines)


def _log_lines(rng: random.Random) -> str:
    style = rng.choice(["app", "access", "syslog"])
    t = rng.randint(0, 20_000_000)
    out = []
    for _ in range(rng.randint(15, 60)):
        t += rng.randint(0, 30)
        fill = {"key": f"{rng.choice(_PRODUCTS)}-{rng.randint(1, 999)}", "n": rng.randint(1, 9),
                "user": _user(rng), "ms": rng.randint(100, 9000)}
        if style == "app":
            out.append(f"{_stamp(rng, t)} {rng.choice(_LEVELS):5s} [{rng.choice(_SERVICES)}] "
                       + rng.choice(_MESSAGES).format(**fill))
        elif style == "access":
            ip = ".".join(str(rng.randint(1, 254)) for _ in range(4))
            path = rng.choice(_PATHS).format(**fill)
            out.append(f'{ip} - - [{_stamp(rng, t)}] "{rng.choice(["GET", "GET", "POST"])} {path} '
                       f'HTTP/1.1" {rng.choice([200, 200, 200, 201, 304, 404, 500])} '
                       f"{rng.randint(120, 90000)}")
        else:
            out.append(f"{_stamp(rng, t)} host{rng.randint(1, 9)} {rng.choice(_SERVICES)}"
                       f"[{rng.randint(100, 40000)}]: " + rng.choice(_MESSAGES).format(**fill))
    return "\n".join(out)


def _table(rng: random.Random) -> str:
    cols = rng.sample(["city", "product", "qty", "price", "owner", "region", "score"], 4)
    rows = []
    for _ in range(rng.randint(6, 25)):
        vals = {"city": rng.choice(_CITIES), "product": rng.choice(_PRODUCTS),
                "qty": str(rng.randint(1, 500)), "price": f"{rng.uniform(1, 999):.2f}",
                "owner": _user(rng), "region": rng.choice(["north", "south", "east", "west"]),
                "score": f"{rng.random():.3f}"}
        rows.append([vals[c] for c in cols])
    if rng.random() < 0.5:
        return "\n".join([",".join(cols)] + [",".join(r) for r in rows])
    head = "| " + " | ".join(cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in rows])


def _ini(rng: random.Random) -> str:
    out = []
    for svc in rng.sample(_SERVICES, rng.randint(2, 5)):
        out.append(f"[{svc}]")
        out.append(f"host = {svc}.internal")
        out.append(f"port = {rng.choice([80, 443, 8080, 9000, 6379, 5432])}")
        out.append(f"timeout_ms = {rng.choice([100, 250, 500, 1000, 3000])}")
        out.append(f"retries = {rng.randint(0, 5)}")
        out.append(f"enabled = {rng.choice(['true', 'false'])}")
        out.append("")
    return "\n".join(out).strip()


_KINDS: list[Callable[[random.Random], str]] = [_json_records, _log_lines, _table, _ini]


def structured_documents(count: int, seed: int) -> Iterator[tuple[str, str]]:
    """Yield ``count`` (doc id, text) pairs; the same seed gives the same documents."""
    rng = random.Random(seed)
    for i in range(count):
        kind = _KINDS[rng.randrange(len(_KINDS))]
        yield f"structured/{kind.__name__.strip('_')}/{i}", kind(rng)
