"""strategy="auto": the fastest simulated plan that fits, whatever mix of keep, swap and
recompute it takes, chosen from the hardware profile."""

import pytest

from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Recompute, Swap
from memfit.model import synthetic
from memfit.model.recompute import planned_reruns
from memfit.model.schedule import check_plan
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.auto import block_stacks
from memfit.planning.strategies.swapping._free_swaps import free_swaps

GRAPHS = {
    "chain": lambda: synthetic.chain(24),
    "resnet_like": lambda: synthetic.resnet_like(6),
    "towers": lambda: synthetic.multi_tower(2, 8),
    "random_dag": lambda: synthetic.random_dag(40, seed=3),
}
# the acceptance's alternatives: swap only, recompute only (the optimal DP), the vDNN policies
# and per-block checkpointing (torchtitan's default: torch.utils.checkpoint around every block)
ALTERNATIVES = {"swap": {}, "optimal-recompute": {"method": "segments"}, "vdnn_all": {},
                "vdnn_conv": {}, "vdnn_dyn": {}, "checkpoint": "per block"}


def step_time_if_fits(graph, hardware, strategy, budget_bytes):
    params = ALTERNATIVES[strategy]
    if params == "per block":
        stacks = block_stacks(graph)
        if not stacks:
            return None
        params = {"checkpoints": [f"{stack}.*" for stack in stacks]}
    try:
        made = get_strategy(strategy)(graph, hardware, budget_bytes, **params)
    except BudgetError:
        return None
    timeline = simulate(graph, made, hardware, record_intervals=False)
    return timeline.step_time_s if timeline.peak_bytes <= budget_bytes else None


def auto_minimum_bytes(graph, hardware):
    with pytest.raises(BudgetError) as refused:
        get_strategy("auto")(graph, hardware, 1)
    return refused.value.minimum_bytes


@pytest.mark.parametrize("profile", ["h100-pcie", "gh200"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_never_slower_than_any_single_technique(name, profile):
    """From 90% of the unplanned peak down to the feasible minimum, auto fits and is at least as
    fast as every single technique that fits; below its minimum none of them fits either."""
    graph, hardware = GRAPHS[name](), get_hardware(profile)
    keep_peak = simulate(graph, Plan("keep"), hardware).peak_bytes
    minimum = auto_minimum_bytes(graph, hardware)
    assert minimum < 0.9 * keep_peak
    budgets = sorted({int(f * keep_peak) for f in (0.9, 0.7, 0.5) if f * keep_peak >= minimum}
                     | {minimum}, reverse=True)
    for budget in budgets:
        made = get_strategy("auto")(graph, hardware, budget)
        check_plan(graph, made)
        timeline = simulate(graph, made, hardware)
        assert timeline.peak_bytes <= budget
        assert made.params["candidates"][made.params["solver"]] == pytest.approx(timeline.step_time_s)
        for strategy in ALTERNATIVES:
            other = step_time_if_fits(graph, hardware, strategy, budget)
            assert other is None or timeline.step_time_s <= other * (1 + 1e-9), strategy
    below = minimum - 1
    assert all(step_time_if_fits(graph, hardware, s, below) is None for s in ALTERNATIVES)


def test_block_stacks_are_the_numbered_children_of_a_module_path():
    """GPT-2's ``transformer.h.0..11``, a ResNet's ``layer1.0..2`` each: stacks of two or more
    numbered blocks; a module path numbered once, or a name ending in a digit, is not one."""
    assert block_stacks(synthetic.chain(6)) == ["layers"]
    assert block_stacks(synthetic.multi_tower(2, 3)) == ["tower0", "tower1"]
    assert block_stacks(synthetic.random_dag(10, seed=3)) == []  # block0, block1: no children


def test_without_a_budget_or_when_everything_fits_it_keeps():
    graph, hardware = synthetic.chain(8), get_hardware("h100-pcie")
    assert not get_strategy("auto")(graph, hardware).decisions
    peak = simulate(graph, Plan("keep"), hardware).peak_bytes
    assert get_strategy("auto")(graph, hardware, peak).params["solver"] == "keep"


def test_the_link_decides_between_swapping_and_recomputing():
    """A fast link (GH200) swaps for free what a PCIe link must recompute."""
    graph = synthetic.chain(24, time_s=2e-4)
    budget = int(0.6 * simulate(graph, Plan("keep"), get_hardware("gh200")).peak_bytes)
    slow_link = get_hardware("h100-pcie").with_(d2h_bytes_per_s=2e8, h2d_bytes_per_s=2e8)
    fast = get_strategy("auto")(graph, get_hardware("gh200"), budget)
    slow = get_strategy("auto")(graph, slow_link, budget)
    assert any(isinstance(d, Swap) for d in fast.decisions.values())
    assert sum(isinstance(d, Recompute) for d in slow.decisions.values()) > sum(
        isinstance(d, Recompute) for d in fast.decisions.values())


def test_free_swaps_stall_nothing():
    graph = synthetic.resnet_like(8)
    for profile in ("h100-pcie", "gh200"):
        hardware = get_hardware(profile)
        swaps = free_swaps(graph, hardware)
        assert swaps
        timeline = simulate(graph, Plan("free", swaps), hardware)
        assert timeline.exposed_transfer_s == 0
        assert timeline.step_time_s == pytest.approx(simulate(graph, Plan("keep"), hardware).step_time_s)
    assert free_swaps(graph, get_hardware("cpu")) == {}  # synchronous copies are never free


def test_unknown_parameters_are_refused():
    with pytest.raises(ValueError, match="takes none"):
        get_strategy("auto")(synthetic.chain(4), get_hardware("h100-pcie"), 1, speed=True)


def feeds_a_rerun(graph, plan) -> bool:
    """Whether some swap-in names a forward reader at or before its control op (its re-runs)."""
    return any(graph.index[consumer] <= graph.index[swap_in.after]
               for decision in plan.decisions.values() if isinstance(decision, Swap)
               for swap_in in decision.swap_ins for consumer in swap_in.consumers)


def test_free_swaps_given_reruns_feed_checkpoints_and_stall_nothing():
    graph, hardware = synthetic.chain(24, time_s=2e-4), get_hardware("h100-pcie")
    budget = int(0.4 * simulate(graph, Plan("keep"), hardware).peak_bytes)
    recompute = get_strategy("optimal-recompute")(graph, hardware, budget, method="segments")
    swaps = free_swaps(graph, hardware, exclude=recompute.recomputed,
                       reruns=planned_reruns(graph, recompute))
    both = Plan("both", {**recompute.decisions, **swaps})
    assert not set(swaps) & set(recompute.recomputed)
    assert feeds_a_rerun(graph, both)
    alone, together = simulate(graph, recompute, hardware), simulate(graph, both, hardware)
    assert together.exposed_transfer_s == 0
    assert together.step_time_s == pytest.approx(alone.step_time_s)
    assert together.peak_bytes < alone.peak_bytes


def test_swapped_checkpoints_win_where_the_link_carries_only_some_activations():
    """On a 1 GB/s link swapping alone stalls and the hybrid cannot swap the checkpoints its
    recomputation keeps; swapping those back for the re-runs lets auto recompute less."""
    graph = synthetic.chain(24, time_s=2e-4)
    hardware = get_hardware("h100-pcie").with_(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    budget = int(0.4 * simulate(graph, Plan("keep"), hardware).peak_bytes)
    made = get_strategy("auto")(graph, hardware, budget)
    assert made.params["solver"] == "swapped-checkpoints"
    candidates = made.params["candidates"]
    assert candidates["swapped-checkpoints"] < min(candidates["recompute"], candidates["hybrid"])
    check_plan(graph, made)
    assert feeds_a_rerun(graph, made)
    timeline = simulate(graph, made, hardware)
    assert timeline.peak_bytes <= budget and timeline.exposed_transfer_s == 0
    # no free swap on a synchronous link: the candidate is not made
    assert get_strategy("auto")(graph, get_hardware("cpu"), budget).params["candidates"][
        "swapped-checkpoints"] is None


def test_packed_copies_back_carry_more_and_stall_nothing():
    """Where the link is the bottleneck, packing the copies back as late as it allows (latest
    need first) carries more bytes than just-in-time copies in order of need, still free."""
    graph = synthetic.chain(24, time_s=2e-4)
    hardware = get_hardware("h100-pcie").with_(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    keep = simulate(graph, Plan("keep"), hardware)
    in_order, packed = free_swaps(graph, hardware), free_swaps(graph, hardware, packed=True)
    size = lambda swaps: sum(graph.tensors[t].size_bytes for t in swaps)  # noqa: E731
    assert size(packed) > size(in_order)
    timeline = simulate(graph, Plan("packed", packed), hardware)
    assert timeline.exposed_transfer_s == 0
    assert timeline.step_time_s == pytest.approx(keep.step_time_s)
    assert timeline.peak_bytes < simulate(graph, Plan("in order", in_order), hardware).peak_bytes
