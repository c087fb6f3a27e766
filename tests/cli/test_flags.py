"""``spin serve``'s flag writers for its verifier and drafters are the exact inverses of the
parsers: ``serve.runner_argv`` of ``model_flags`` (and the drafter's ``--quantize``),
``serve.server_argv`` of ``service_flags``."""

from __future__ import annotations

import pytest

from spin.cli import parser
from spin.cli.flags import runner_config, server_config
from spin.cpus import available_cpus
from spin.engine.memory import parse_size
from spin.engine.model_runner import RunnerConfig
from spin.rpc.serving import ServerConfig
from spin.serve import VERIFIER_GPU_SHARE, runner_argv, server_argv, service_runner

RUNNERS = {
    "defaults": RunnerConfig(),
    "every field": RunnerConfig(device="cuda:1", dtype="bfloat16",
                                kv_cache_memory=parse_size("48MiB"), gpu_memory_utilization=0.35,
                                max_model_len=4096, max_seqs=8, block_size=32, quantize="int8",
                                cuda_graphs=False, compile=True, attention="flex",
                                prefix_caching=False),
    "a service's share of the GPU": service_runner(RunnerConfig(gpu_memory_utilization=0.9),
                                                   parse_size("1GiB"), VERIFIER_GPU_SHARE),
    "cpu, no budget": RunnerConfig(device="cpu", dtype="float32", max_model_len=128),
}


@pytest.mark.parametrize("name", RUNNERS)
def test_runner_argv_parses_back_to_an_equal_config(name: str) -> None:
    runner = RUNNERS[name]
    argv = ["drafter", "--model", "m", *runner_argv(runner)]
    assert runner_config(parser().parse_args(argv)) == runner
    if runner.quantize == "none":  # the verifier has no --quantize, and needs none
        argv = ["verifier", "--model", "m", *runner_argv(runner)]
        assert runner_config(parser().parse_args(argv)) == runner


def test_every_runner_field_is_changed_in_the_round_trip() -> None:
    every, default = RUNNERS["every field"], RunnerConfig()
    assert all(getattr(every, f) != getattr(default, f) for f in every.__dataclass_fields__)


def test_a_service_gets_its_share_to_4_decimals_as_plan_plans_it() -> None:
    r = service_runner(RunnerConfig(gpu_memory_utilization=0.9), None, 0.25 / 3, "int8")
    assert (r.gpu_memory_utilization, r.kv_cache_memory, r.quantize) == (0.075, None, "int8")


@pytest.mark.parametrize("cfg,cpus", [
    (ServerConfig(), None),
    (ServerConfig(host="0.0.0.0", port=0, metrics_port=0, grace_s=2.5), available_cpus()[:1]),
    (ServerConfig(port=50051, metrics_port=9090), available_cpus()),
])
def test_server_argv_parses_back_to_an_equal_config(cfg: ServerConfig,
                                                   cpus: list[int] | None) -> None:
    for command in (["verifier", "--model", "m"], ["router", "--tokenizer", "t"]):
        args = parser().parse_args([*command, *server_argv(cfg, cpus)])
        assert (server_config(args), args.cpus) == (cfg, cpus)


def test_the_benchmarks_list_flags_parse_and_refuse_what_they_say() -> None:
    args = parser().parse_args(["bench", "prediction", "--temperatures", "0,0.8"])
    assert args.temperatures == (0.0, 0.8) and args.source == "previous-output"
    args = parser().parse_args(["bench", "structured", "--concurrency", "1,16,", "--temperatures",
                                "1.5"])
    assert args.concurrency == (1, 16) and args.temperatures == (1.5,)
    for argv in (["bench", "prediction", "--temperatures", "2.5"],
                 ["bench", "grid", "--temperatures", "hot"],
                 ["bench", "grid", "--concurrency", "0,8"],
                 ["bench", "structured", "--concurrency", ","]):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(argv)
        assert e.value.code == 2
