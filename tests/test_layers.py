"""The package's layering: no import cycle between modules, and no package importing one above it.

Every module under ``services/spin`` is parsed (``ast``; nothing is imported), and every import
counts: at module level, inside functions (a lazy import is still a dependency: it only moves the
cost), and under ``if TYPE_CHECKING:``. Type-only imports count too, because a type named in a
signature is a dependency of the code that reads it, and every one of them had a real import's
alternative (a ``Protocol`` of what the code uses) or could move down. ``spin.v1`` (generated
code) is left out: it imports only protobuf.

``LAYERS`` is the design's layering, from the bottom: a module may import its own package and
any package of a lower layer, nothing beside or above. ``python tests/test_layers.py`` prints the
package graph, the module cycles and the imports against the layering.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "services"
PACKAGE = "spin"

LAYERS: list[set[str]] = [
    {"spin", "v1"},                    # the package's version; the generated protobuf code
    {"engine", "cpus"},                # models, caches, sampling, drafters (no gRPC); cores
    {"timing", "zoo"},                 # step times and the cost model; the demo family
    {"policy"},                        # drafter choice and k (pure Python over engine types)
    {"stats", "obs"},                  # acceptance statistics (Redis); metrics and tracing
    {"rpc"},                           # what the gRPC services share
    {"router", "drafter", "verifier", "client"},  # the services; the router's gRPC client
    {"openai_api"},                    # the HTTP adapter over the router's Frontend
    {"router_main"},                   # the composition root of the `spin router` process
    {"supervisor"},                    # child processes kept alive (spin serve's)
    {"serve"},                         # the embedded deployment
    {"plan"},                          # memory plans, of spin serve's deployment too
    {"bench"},                         # benchmarks (they run deployments)
    {"cli"},                           # the `spin` command
    {"__main__"},                      # python -m spin
]
"""Packages (``spin.X`` and top-level modules ``spin/X.py``) from the bottom layer up: the
design's order (engine < timing < policy < stats, obs < rpc < router, drafter, verifier <
openai_api < composition root < serve, supervisor, plan < bench < cli), with the modules it does
not name placed where they belong (``cpus`` and ``zoo`` over nothing but the engine, ``client``
beside the services whose API it calls), and serve's layer ordered supervisor < serve < plan:
serve runs a ``Supervisor`` over its children, and a plan is of what serve would start."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module under ``root/spin`` but the generated ones."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[1:2] == ("v1",):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Absolute names an import statement imports: modules, or names in modules (``from .x
    import y``: ``spin.p.x.y``, which ``graph`` reads as the module ``spin.p.x`` unless ``y`` is
    a module itself)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            base = base[:len(base) - node.level + (1 if is_package else 0)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        yield from (f"{name}.{a.name}" for a in node.names)


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of this package it imports (anywhere in its file)."""
    mods = modules(root)
    g: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, is_package):
                if name == f"{PACKAGE}.v1" or name.startswith(f"{PACKAGE}.v1."):
                    continue
                while name and name not in mods:  # spin.x.y.Name -> spin.x.y
                    name = name.rpartition(".")[0]
                if name and name != module:
                    g[module].add(name)
    return g


def package(module: str) -> str:
    """The layer unit of a module: ``spin.X`` -> X; ``spin`` itself -> 'spin'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []
    nodes = sorted(set(g) | {m for ms in g.values() for m in ms})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def violations(g: dict[str, set[str]]) -> list[str]:
    """Each import of a package above or beside the importer's."""
    level = layer_of()
    bad = []
    for a, bs in sorted(g.items()):
        for b in sorted(bs):
            pa, pb = package(a), package(b)
            if pa == pb:
                continue
            if level[pb] >= level[pa]:
                bad.append(f"{a} imports {b} ({pa} is in layer {level[pa]}, {pb} in {level[pb]})")
    return bad


def test_every_package_has_a_layer() -> None:
    level = layer_of()
    assert not {package(m) for m in modules()} - set(level)
    assert len(level) == sum(len(layer) for layer in LAYERS), "a package is in two layers"


def test_no_module_imports_a_package_above_its_own() -> None:
    assert violations(graph()) == []


def test_no_import_cycle_between_modules() -> None:
    assert [sorted(c) for c in cycles(graph())] == []


def test_the_checks_find_what_they_should(tmp_path: Path) -> None:
    """The checker itself, on a package of its own: relative imports resolve (from a module and
    from a package's ``__init__``), imports inside functions and under TYPE_CHECKING count, and
    the cycle and the upward import planted are found."""
    files = {
        "spin/__init__.py": "",
        "spin/engine/__init__.py": "from .a import f\n",
        "spin/engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from ..cli import main\n",
        "spin/engine/b.py": "def f():\n    from . import c\n",
        "spin/engine/c.py": "import spin.engine.b\nfrom spin.v1 import x_pb2\n",
        "spin/cli/__init__.py": "from ..engine.a import f\n",
        "spin/v1/x_pb2.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    g = graph(tmp_path)
    assert g == {"spin.engine": {"spin.engine.a"}, "spin.engine.a": {"spin.cli"},
                 "spin.engine.b": {"spin.engine.c"}, "spin.engine.c": {"spin.engine.b"},
                 "spin.cli": {"spin.engine.a"}}
    assert sorted(map(sorted, cycles(g))) == [["spin.cli", "spin.engine.a"],
                                              ["spin.engine.b", "spin.engine.c"]]
    assert [v.split(" (")[0] for v in violations(g)] == ["spin.engine.a imports spin.cli"]


def main() -> None:
    g = graph()
    packages: dict[str, set[str]] = defaultdict(set)
    for a, bs in g.items():
        for b in bs:
            if package(a) != package(b):
                packages[package(a)].add(package(b))
    for a in sorted(packages):
        print(f"{a} -> {sorted(packages[a])}")
    print("module cycles:", [sorted(c) for c in cycles(g)])
    print("upward imports:", *violations(g), sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
