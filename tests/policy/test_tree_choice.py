"""Token trees chosen by goodput: rank evidence from verified steps, runner-up rates, and the
choice between a chain and a tree under a cost model."""

import pytest

from spin.engine.prompt_lookup import PromptLookupIndex, lookup_tree
from spin.engine.tree import TokenTree
from spin.policy.base import RequestView
from spin.timing.cost_model import CostModel
from spin.policy.goodput import ControllerConfig, SpecLengthController
from spin.policy.learned import LearnedPolicy, learned_config
from spin.policy.outcome import outcome
from spin.policy.tree_choice import Candidate, RunnerUps, choose_shapes
from policy.steps import observe, observe_score, observe_step, without_guard


@pytest.fixture(autouse=True)
def _no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    without_guard(monkeypatch)


def test_a_rejected_chain_node_tests_its_runner_up() -> None:
    chain = TokenTree((1, 2, 3), (-1, 0, 1), second=(7, 8, 9))
    full = outcome(chain, (1, 2, 3, 4), 3)
    assert (full.first_accepted, full.trials, full.hits) == (3, 0, 0)
    hit = outcome(chain, (1, 8), 1)  # node 1 rejected: the target's token was its runner-up
    assert (hit.first_accepted, hit.trials, hit.hits) == (1, 1, 1)
    miss = outcome(chain, (5,), 0)
    assert (miss.first_accepted, miss.trials, miss.hits) == (0, 1, 0)
    unknown = outcome(TokenTree.chain([1, 2]), (5,), 0)  # no runner-ups known: no trial
    assert (unknown.trials, unknown.hits) == (0, 0)


def test_a_trees_walk_says_which_rank_was_accepted() -> None:
    # two branches of two: (1 -> 3) and (2 -> 4); children listed best first
    tree = TokenTree((1, 2, 3, 4), (-1, -1, 0, 1))
    first = outcome(tree, (1, 3, 9), 2)  # the first branch all the way
    assert (first.first_accepted, first.trials, first.hits) == (2, 0, 0)
    second = outcome(tree, (2, 4, 9), 2)  # the second branch: a hit, and off the first path
    assert (second.first_accepted, second.trials, second.hits) == (0, 1, 1)
    neither = outcome(tree, (6,), 0)
    assert (neither.first_accepted, neither.trials, neither.hits) == (0, 1, 0)


def test_runner_up_rates_start_from_the_drafters_record() -> None:
    ups = RunnerUps(prior=0.3, weight=4.0, ema=0.5)
    assert ups.rate("a", "d") == pytest.approx(0.3)
    ups.observe("a", "d", 4, 4)
    assert ups.rate("a", "d") == pytest.approx((4 + 4 * 0.3) / 8)
    assert ups.population["d"] == pytest.approx(0.65)
    assert ups.rate("b", "d") == pytest.approx(0.65)  # a new request starts from the record
    ups.release("a")
    assert ups.rate("a", "d") == pytest.approx(0.65)


def _controller(per_token: float) -> SpecLengthController:
    cost = CostModel(verify=(0.010, 0.0, per_token, 0.0, 0.0),
                     draft={"d": (0.0, 0.001, 0.0, 0.0)})
    return SpecLengthController(cost, ControllerConfig())


@pytest.mark.parametrize("per_token, beta, tree", [(1e-5, 0.6, True), (1e-5, 0.0, False),
                                                  (2e-3, 0.6, False)])
def test_a_tree_is_chosen_where_verifying_more_is_nearly_free(per_token, beta, tree) -> None:
    """A GPU-like forward (a token verified costs 0.1% of a step) takes the tree when the
    drafter's runner-up is often right; not when it never is, nor when each verified token
    costs 20% of a step."""
    c = _controller(per_token)
    batch = [("a", "d", 100)]
    shapes = choose_shapes(c, batch, [4], 0, [Candidate(0, 0.6, beta, 4, 16)], 0.03)
    assert bool(shapes[0]) == tree


def test_the_learned_policy_drafts_trees_for_greedy_requests_only() -> None:
    cost = CostModel(verify=(0.010, 0.0, 1e-5, 0.0, 0.0),
                     draft={"draft-code": (0.0, 0.001, 0.0, 0.0)})
    policy = LearnedPolicy(learned_config({"score_after": 0, "runner_up_prior": 0.6}), cost)
    greedy = RequestView("g", 100, 5, 50, True, "drafter", "draft-code")
    sampled = RequestView("s", 100, 5, 50, False, "drafter", "draft-code")
    plan = policy.choose([greedy, sampled], {"draft-code"})
    assert plan[0].branching and plan[0].stop_below == 0.0  # a tree: no early stop
    assert plan[1].branching == ()
    # its verified nodes are in the step's prediction
    chain_only = LearnedPolicy(learned_config({"score_after": 0, "trees": False}), cost)
    assert plan.prediction.verify_s > chain_only.choose([greedy], {"draft-code"}).prediction.verify_s
    # a tree's second-ranked acceptance is no evidence of the first-ranked acceptance rate
    before = policy.controller.tracker.get("g", "draft-code")
    ranks = outcome(TokenTree((1, 2, 3, 4), (-1, -1, 0, 1)), (2, 4, 9), 2)
    observe(policy, "g", plan[0], 2, 0.001, 0.01, ranks)
    assert policy.controller.tracker.get("g", "draft-code") < before
    assert policy.runner_ups.rate("g", "draft-code") > 0.6


def test_prompt_lookup_branches_when_two_continuations_differ() -> None:
    index = PromptLookupIndex()
    index.extend([1, 2, 3, 9, 1, 2, 4, 8, 1, 2])
    chain = lookup_tree(index, 3, branch=False)
    assert chain.tokens == (4, 8, 1) and chain.second == (3, -1, -1)
    tree = lookup_tree(index, 3, branch=True)
    assert tree.tokens == (4, 8, 1, 3, 9, 1) and tree.parents == (-1, 0, 1, -1, 3, 4)
    assert tree.children(-1) == [0, 3]  # the latest continuation ranks first
    single = PromptLookupIndex()
    single.extend([1, 2, 3, 1, 2])
    assert lookup_tree(single, 2, branch=True).parents == (-1, 0)  # one continuation: a chain
    assert lookup_tree(PromptLookupIndex(), 2, branch=True) is None
