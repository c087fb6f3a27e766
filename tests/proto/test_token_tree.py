"""The wire contract compiles with protoc and round-trips a token tree."""

import importlib.util
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def test_token_tree_compiles_and_round_trips(tmp_path: Path) -> None:
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp_path}",
                      str(PROTO_ROOT / "spin" / "v1" / "token_tree.proto")])
    assert rc == 0
    spec = importlib.util.spec_from_file_location("token_tree_pb2",
                                                  tmp_path / "spin" / "v1" / "token_tree_pb2.py")
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    chain = pb.TokenTree(tokens=[11, 12, 13], parents=[-1, 0, 1],
                         probs=[pb.DraftDistribution(token_ids=[11], token_probs=[0.5])])
    back = pb.TokenTree.FromString(chain.SerializeToString())
    assert list(back.tokens) == [11, 12, 13] and list(back.parents) == [-1, 0, 1]
    assert back.probs[0].token_probs[0] == 0.5
