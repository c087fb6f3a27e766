"""Two drafter processes share one GPU through MPS (the design's drafter pods): both serve,
speculation through each is lossless, and each is a client of the MPS server.

Needs a running MPS control daemon, found through ``SPIN_MPS_PIPE_DIRECTORY`` (what
``scripts/gpu-check`` sets after ``nvidia-cuda-mps-control -d``), else
``CUDA_MPS_PIPE_DIRECTORY``, else MPS's default ``/tmp/nvidia-mps``; skipped without one. Only
the services started here get the pipe directory: this process stays off MPS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from service_helpers import collect, request, scrape

from spin.engine.model_runner import RunnerConfig
from spin.router.config import RouterConfig
from spin.serve import Embedded, ServeConfig
from spin.zoo.corpus import heldout_prompts

pytestmark = pytest.mark.cuda
DRAFTERS = ("draft-code", "draft-prose")
NEW = 24


def _pipe() -> Path | None:
    """The pipe directory of a running MPS control daemon, or None."""
    pipe = Path(os.environ.get("SPIN_MPS_PIPE_DIRECTORY")
                or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    control = shutil.which("nvidia-cuda-mps-control")
    return pipe if control and (pipe / "control").exists() else None


def _control(pipe: Path, command: str) -> list[str]:
    """``command``'s answer from the MPS control daemon, split into words."""
    out = subprocess.run(["nvidia-cuda-mps-control"], input=command + "\n", text=True,
                         capture_output=True, timeout=10,
                         env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe)))
    return out.stdout.split()


def mps_clients(pipe: Path) -> set[int]:
    """Process ids of every client of every MPS server the daemon runs."""
    clients: set[int] = set()
    for server in _control(pipe, "get_server_list"):
        if server.isdigit():
            clients |= {int(x) for x in _control(pipe, f"get_client_list {server}") if x.isdigit()}
    return clients


def test_two_drafters_serve_on_one_gpu_under_mps(tmp_path: Path, family_dir: Path,
                                                 tokenizer) -> None:
    pipe = _pipe()
    if pipe is None:
        pytest.skip("no MPS control daemon is running (nvidia-cuda-mps-control -d; "
                    "scripts/gpu-check starts one and sets SPIN_MPS_PIPE_DIRECTORY)")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe),
           "CUDA_MPS_LOG_DIRECTORY": os.environ.get("SPIN_MPS_LOG_DIRECTORY", str(tmp_path))}
    # float32: speculation is token-identical to the target alone (no half-precision near ties)
    cfg = ServeConfig(family_dir=family_dir, port=0, drafters=list(DRAFTERS), redis=False,
                      env=env, log_dir=tmp_path / "serve",
                      runner=RunnerConfig(device="cuda", dtype="float32",
                                          kv_cache_memory=256 << 20),
                      drafter_kv_cache_memory=128 << 20,
                      router=RouterConfig(policy="fixed", http_port=None))
    rows = heldout_prompts(family_dir, ("code", "prose"))[:2]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-48:] for r in rows]
    with Embedded(cfg) as emb:
        pids = {c.role: c.proc.pid for c in emb.children}
        for name in DRAFTERS:
            for ids in prompts:
                spec, _, _ = collect(emb.endpoint, request(ids=ids, max_tokens=NEW,
                                                           mode="drafter", drafter=name, k=4,
                                                           ignore_eos=True))
                off, _, _ = collect(emb.endpoint, request(ids=ids, max_tokens=NEW, mode="off",
                                                          ignore_eos=True))
                assert len(spec) == NEW and spec == off, name
        samples = scrape(emb.router.metrics_port)
        clients = mps_clients(pipe)
    for name in DRAFTERS:
        accepted = samples.get(f'spin:spec_decode_num_accepted_tokens_total{{draft_model="{name}"}}')
        assert accepted and accepted > 0, f"{name} drafted nothing the target accepted"
        assert pids[f"drafter-{name}"] in clients, (
            f"drafter {name} (pid {pids[f'drafter-{name}']}) is not an MPS client: {clients}")
