"""``spin bench services``: one prompt in process and through the services (the drafter a service
of its own, then inside the verifier), lossless, with the step of each side split into drafting,
verification and (services) RPCs and the router."""

from __future__ import annotations

import pytest

from spin.bench.services import ServicesBenchConfig, _engine, run_services_bench, summary
from spin.engine.quant import Int8Linear
from spin.serve import ServeConfig, drafter_quantization


@pytest.fixture(scope="module")
def report(family_dir) -> dict:
    return run_services_bench(ServicesBenchConfig(family_dir=family_dir, prompts=1,
                                                  new_tokens=24, colocate=True))


def test_both_sides_emit_the_same_tokens_and_split_their_steps(report: dict) -> None:
    assert report["lossless"] is True
    steps = report["router_step_ms"]["steps"]
    assert steps > 0 and report["inprocess_split_ms"]["steps"] == steps  # one step a step
    on = report["router_step_ms"]
    # each service's own compute is part of what the router waited for it
    assert 0 < on["draft_compute"] < on["draft_wait"]
    assert 0 < on["verify_compute"] < on["verify_wait"]
    inproc = report["inprocess_split_ms"]
    assert 0 < inproc["draft"] and 0 < inproc["verify"]
    assert inproc["draft"] + inproc["verify"] <= report["inprocess_step_ms"] * 1.001
    off = report["router_step_ms_off"]
    # nothing drafts with speculation off (a release of the request before may reach a drafter)
    assert off["draft_compute"] <= off["draft_wait"]
    assert 0 < off["verify_compute"] < off["verify_wait"]


def test_the_engine_in_process_drafts_with_the_services_drafter_weights(report: dict,
                                                                        family_dir) -> None:
    quantize = drafter_quantization(ServeConfig(family_dir=family_dir))
    assert report["drafter_weights"] == quantize
    cfg = ServicesBenchConfig(family_dir=family_dir, drafter=report["drafter"])
    runner = _engine(cfg, quantize).drafters[report["drafter"]].runner
    assert isinstance(runner.lm_head, Int8Linear) == (quantize == "int8")


def test_the_summary_says_where_the_services_step_goes(report: dict) -> None:
    text = summary(report)
    on = report["router_step_ms"]
    rest = on["step"] - on["draft_compute"] - on["verify_compute"]
    assert f"{rest:.2f} in RPCs and the router" in text
    assert f"= {report['ratio_services_vs_inprocess']:.2f}x" in text
    assert text.endswith("lossless: True")
    assert "(a service of its own)" in text and "(inside the verifier)" in text


def test_a_drafter_inside_the_verifier_is_one_call_a_step(report: dict) -> None:
    """No drafter service: the router waits for no draft and the verifier's compute holds the
    drafting; the in-process engine drafts and verifies as before."""
    co = report["colocated"]
    assert co["lossless"] is True and co["drafter_in_verifier"] is True
    on = co["router_step_ms"]
    assert on["draft_compute"] == 0.0 and on["draft_wait"] < 0.25 * on["verify_wait"]
    assert 0 < on["verify_compute"] < on["verify_wait"]
    assert co["inprocess_split_ms"]["draft"] > 0
