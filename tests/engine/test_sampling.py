import pytest
import torch

from spin.engine.sampling import SamplingParams, probs_from_logits

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_one_hot_argmax() -> None:
    assert probs_from_logits(LOGITS, SamplingParams()).tolist() == [[1.0, 0, 0, 0, 0]]


def test_temperature_softmax() -> None:
    p = probs_from_logits(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(p, torch.softmax(LOGITS / 2, -1))


def test_top_k_keeps_k_tokens() -> None:
    p = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(LOGITS[0, :2], -1))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    full = torch.softmax(LOGITS, -1)[0]  # 0.563, 0.207, 0.126, 0.076, 0.028
    p = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))[0]
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    top1 = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))[0]
    assert top1.tolist() == [1.0, 0, 0, 0, 0]


def test_tiny_temperatures_tend_to_greedy_and_huge_ones_to_uniform() -> None:
    logits = torch.tensor([[30.0, 29.0, -5.0, 0.0], [-1e4, 2.0, 2.0, 1.0]])
    for t in (1e-45, 1e-38, 1e-20):  # logits / t alone overflow to inf: a NaN softmax
        p = probs_from_logits(logits, SamplingParams(temperature=t))
        assert p.tolist() == [[1.0, 0, 0, 0], [0, 0.5, 0.5, 0]], t
    p = probs_from_logits(logits, SamplingParams(temperature=3.4e38))
    assert torch.allclose(p, torch.full_like(p, 0.25))


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("inf")},
                                    {"temperature": float("nan")}, {"top_p": 0.0},
                                    {"top_p": 1.5}, {"top_k": -1}])
def test_bad_parameters_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_seeded_generators_repeat() -> None:
    a = torch.rand(4, generator=SamplingParams(seed=3).generator())
    assert torch.equal(a, torch.rand(4, generator=SamplingParams(seed=3).generator()))
