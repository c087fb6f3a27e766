"""Shared fixtures: the committed demo family, loaded once per session (fp32, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from spin.zoo.report import family_members, load_model
from spin.zoo.specs import FAMILY_DIR


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker computes on one torch thread: ``make test`` runs two workers on
    two cores beside the services they start, and a forward of two OpenMP threads whose cores
    the other worker holds waits at every barrier (``timing/measure.py``: a 48 ms forward took
    616 ms beside two busy processes). The services compute on one thread each likewise
    (``rpc.serving.torch_worker``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip on a machine without a CUDA device (``scripts/gpu-check``
    runs them where there is one: ``pytest -m cuda``)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu-check runs it on a GPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def family_dir() -> Path:
    assert (FAMILY_DIR / "target" / "config.json").exists(), f"no demo family at {FAMILY_DIR}"
    return FAMILY_DIR


@pytest.fixture(scope="session")
def tokenizer(family_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(family_dir / "target")


@pytest.fixture(scope="session")
def target(family_dir: Path) -> PreTrainedModel:
    return load_model(family_dir / "target")


@pytest.fixture(scope="session")
def drafts(family_dir: Path) -> dict[str, PreTrainedModel]:
    return {name: load_model(family_dir / name) for name in family_members(family_dir)}


@pytest.fixture(scope="session")
def draft_model(family_dir: Path) -> PreTrainedModel:
    """The smallest draft as a transformers model (the reference for the engine's drafter)."""
    return load_model(family_dir / "draft-structured")


def _embedded(log_dir, heads: dict[str, str] | None = None, suffix_decoding: bool = True,
              cost_model: str | None = None, **policy: object):
    from spin.router.config import RouterConfig, SchedulerConfig
    from spin.serve import Embedded, ServeConfig

    router = RouterConfig(scheduler=SchedulerConfig(max_batch=32,
                                                    step_trace=str(log_dir / "steps.jsonl"),
                                                    suffix_decoding=suffix_decoding),
                          policy_config={"guard": {"enabled": False}, "price_catch_up": False,
                                         **policy},
                          cost_model=cost_model)
    return Embedded(ServeConfig(port=0, log_dir=log_dir, router=router, heads=heads))


IDLE_DRAFT_COSTS = {"draft-code": (1e-4, 6.6e-4, 4.8e-5, 5.7e-7, 1.9e-4),
                    "draft-prose": (1.2e-4, 6.3e-4, 4.9e-5, 6.1e-7, 1.8e-4),
                    "draft-general": (2.2e-5, 2.1e-3, 0.0, 1.4e-6, 6.7e-4),
                    "draft-structured": (5.9e-5, 4.1e-4, 3.2e-5, 2.3e-7, 5.5e-5)}
"""Each draft model's cost coefficients (``timing/cost_model.py``), rounded from ``spin profile
--quick`` on this project's idle 2-core CPU (fit error 4-8%)."""


def _idle_cost_model(path: Path) -> str:
    """The demo family's cost model on an idle 2-core CPU (``spin profile --quick``, its verify
    fit error 11%), written to ``path``."""
    from spin.timing.cost_model import CostModel

    cost = CostModel(verify=(7.5e-3, 1.6e-4, 2.3e-4, 6.5e-6, 0.0, 9.3e-4),
                     draft=dict(IDLE_DRAFT_COSTS))
    cost.save(path)
    return str(path)


@pytest.fixture(scope="session")
def serving_model_drafters(tmp_path_factory: pytest.TempPathFactory):
    """The embedded deployment without the family's draft head and without suffix decoding: for
    tests of how the learned policy picks among the draft models by their prompt fit (a head
    scores no prompt and is every request's candidate, and suffix decoding drafts the prompts
    the tests send again from the outputs before, so both take steps from them; their own
    tests use ``serving``). A request's best-fitting drafter is the one that predicts its prompt
    best (``fit_rank_margin`` 0): the default ranking adds each drafter's record on earlier
    requests and its goodput, which follow the step times the machine allows and which requests
    came first (``tests/policy`` cover that ranking).

    Its router plans with a fixed cost model of an idle machine, not calibrated in serving
    (``_idle_cost_model``), and scores every prompt whatever the scoring calls cost
    (``price_scoring`` off): which drafter a lone request's steps take, and how many of them
    speculate, then follow prompt agreement and acceptance alone. Beside four busy processes a
    forward over several tokens measured 50-60 ms against 15 ms for one, and a router planning
    with such times rightly drafted with a model in 4 of 96 steps: too few for these tests to
    tell one draft model's steps from another's."""
    log_dir = tmp_path_factory.mktemp("serve-models")
    emb = _embedded(log_dir, heads={}, suffix_decoding=False,
                    cost_model=_idle_cost_model(log_dir / "cost_model.json"),
                    fit_rank_margin=0.0, price_scoring=False,
                    controller={"calibration": 0.0})
    emb.start()
    yield emb
    emb.stop()


@pytest.fixture(scope="session")
def serving(tmp_path_factory: pytest.TempPathFactory):
    """The embedded deployment (verifier, one drafter per draft model, router, redis-server) as
    real processes on loopback ports, shared by the service tests.

    The learned policy's loss guard and its pricing of drafters' catch-ups are off here: they
    decide from the step times it measures, which follow whatever else the machine runs, and a
    test's drafters must not depend on that (``tests/policy/test_loss_guard.py`` and
    ``test_learned.py`` cover both)."""
    emb = _embedded(tmp_path_factory.mktemp("serve"))
    emb.start()
    assert emb.redis is not None, "the service tests need redis-server (make test installs it)"
    yield emb
    emb.stop()
