"""The code stays in small pieces: no hand-written module over 400 lines, no function over 80.

Generated code (``services/spin/v1``, from ``proto/``) is left out. A module that grows past the
limit is split by concept (as ``policy/choice.py`` and ``policy/outcome.py`` were from
``policy/base.py``), a function by step.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "services" / "spin", ROOT / "loadgen")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py")
                  if "v1" not in p.relative_to(pkg).parts)


def test_the_packages_are_found() -> None:
    assert len(_modules()) > 100


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_over_80_lines() -> None:
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}
