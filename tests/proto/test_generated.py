"""The wire contracts: committed generated code matches the .proto files, and buf lint passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_tools import protoc

from spin.v1 import generation_pb2, token_tree_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
GENERATED = ROOT / "services" / "spin" / "v1"


def test_generated_code_has_no_drift(tmp_path: Path) -> None:
    files = sorted(str(p) for p in (PROTO / "spin" / "v1").glob("*.proto"))
    rc = protoc.main(["protoc", f"-I{PROTO}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                      f"--grpc_python_out={tmp_path}", *files])
    assert rc == 0
    fresh = {p.name: p.read_text() for p in (tmp_path / "spin" / "v1").iterdir()}
    committed = {p.name: p.read_text() for p in GENERATED.iterdir()
                 if p.is_file() and p.suffix in (".py", ".pyi") and p.name != "__init__.py"}
    assert sorted(fresh) == sorted(committed), "generated files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run `make proto` and commit"


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        pytest.fail("buf is not installed (pip install buf-bin; it is in the test extra)")
    r = subprocess.run([buf, "lint"], cwd=PROTO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_messages_round_trip() -> None:
    row = token_tree_pb2.DraftDistribution(token_ids=[11], token_probs_f16=b"\x00\x38")  # 0.5
    tree = token_tree_pb2.TokenTree(tokens=[11, 12, 13], parents=[-1, 0, 0], probs=[row] * 3)
    back = token_tree_pb2.TokenTree.FromString(tree.SerializeToString())
    assert list(back.tokens) == [11, 12, 13] and list(back.parents) == [-1, 0, 0]
    assert back.probs[2].token_probs_f16 == b"\x00\x38"
    req = generation_pb2.GenerateRequest(prompt="x", max_tokens=3, stop=["\n\n"])
    assert generation_pb2.GenerateRequest.FromString(req.SerializeToString()).stop == ["\n\n"]
    assert not req.sampling.HasField("top_p")  # unset top_p means "off", not 0
