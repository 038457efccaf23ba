"""No plan swaps more than the host holds (``Hardware.host_bytes``), torch-free.

What is checked, on synthetic graphs planned for an H100 PCIe: with no host limit ``auto``
swaps; with a host limit below what that plan holds it returns a plan whose simulated host peak
is within the limit (recomputing what it no longer swaps) at a device peak within the budget;
every swapping strategy either fits both limits or raises a ``BudgetError`` that names
``host_bytes`` where the limit stopped it, and planning again at that error's minimum fits;
the MILP reference respects the limit; and ``memfit.plan``'s pipeline refuses a strategy that
ignores it.
"""

from __future__ import annotations

import pytest

from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model import synthetic
from memfit.model.schedule import peak_bytes
from memfit.model.simulate import simulate
from memfit.planning import strategies
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.milp_swap_plan import plan_swap_milp
from memfit.planning.strategies.swapping import _just_in_time_swap
from memfit.planning.strategies.swapping._free_swaps import free_swaps

UNLIMITED = get_hardware("h100-pcie").with_(host_bytes=None)
GRAPHS = {"chain": lambda: synthetic.chain(12), "resnet_like": lambda: synthetic.resnet_like(5),
          "multi_tower": lambda: synthetic.multi_tower(3, 5)}
SWAPPING = ("swap", "vdnn_all", "vdnn_conv", "vdnn_dyn", "jit-swap", "auto")


def keep_peak(graph) -> int:
    return peak_bytes(graph, Plan("keep"))


def plan_with(strategy: str, graph, hardware, budget_bytes):
    if strategy == "jit-swap":
        return _just_in_time_swap.plan(graph, hardware, budget_bytes)
    return get_strategy(strategy)(graph, hardware, budget_bytes)


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_a_tight_host_turns_swaps_into_recomputation(graph_name, fraction):
    graph = GRAPHS[graph_name]()
    budget_bytes = int(fraction * keep_peak(graph))
    free = get_strategy("auto")(graph, UNLIMITED, budget_bytes)
    free_host = simulate(graph, free, UNLIMITED).host_peak_bytes
    assert free.swapped and free_host > 0, free.params["solver"]
    for host_bytes in (0, free_host // 2, free_host - 1):
        hardware = UNLIMITED.with_(host_bytes=host_bytes)
        limited = get_strategy("auto")(graph, hardware, budget_bytes)
        timeline = simulate(graph, limited, hardware)
        assert timeline.host_peak_bytes <= host_bytes < free_host
        assert timeline.peak_bytes <= budget_bytes
        assert limited.recomputed or limited.reruns  # what is not swapped is recomputed
        assert timeline.step_time_s >= simulate(graph, free, UNLIMITED).step_time_s
    assert not get_strategy("auto")(graph, UNLIMITED.with_(host_bytes=0), budget_bytes).swapped


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("strategy", SWAPPING)
def test_every_swapping_strategy_fits_the_host_or_says_so(graph_name, strategy):
    graph = GRAPHS[graph_name]()
    budget_bytes = int(0.6 * keep_peak(graph))
    try:
        free = plan_with(strategy, graph, UNLIMITED, budget_bytes)
    except BudgetError:
        free = None
    free_host = simulate(graph, free, UNLIMITED).host_peak_bytes if free else 0
    for host_bytes in (0, free_host // 2):
        hardware = UNLIMITED.with_(host_bytes=host_bytes)
        try:
            made = plan_with(strategy, graph, hardware, budget_bytes)
        except BudgetError as error:
            if free is not None and free_host > host_bytes:  # the host limit stopped it
                assert error.host_bytes == host_bytes and "host_bytes" in str(error)
            again = plan_with(strategy, graph, hardware, error.minimum_bytes)
            assert simulate(graph, again, hardware).host_peak_bytes <= host_bytes
            continue
        timeline = simulate(graph, made, hardware)
        assert timeline.host_peak_bytes <= host_bytes
        assert timeline.peak_bytes <= budget_bytes


def test_the_budget_error_names_host_bytes_and_what_to_do():
    graph = synthetic.chain(12)
    budget_bytes = int(0.6 * keep_peak(graph))
    assert simulate(graph, get_strategy("swap")(graph, UNLIMITED, budget_bytes),
                    UNLIMITED).peak_bytes <= budget_bytes  # unlimited, TFLMS fits
    tight = UNLIMITED.with_(host_bytes=2 << 20)
    with pytest.raises(BudgetError, match=r"host_bytes \(2.00 MiB") as caught:
        get_strategy("swap")(graph, tight, budget_bytes)
    assert caught.value.host_bytes == 2 << 20
    assert "hardware.with_(host_bytes=" in str(caught.value)
    assert "recompute" in str(caught.value)


def test_the_free_swaps_stay_within_the_host():
    graph = synthetic.chain(12, time_s=1e-2)
    swaps = free_swaps(graph, UNLIMITED)
    plan = Plan("free", swaps, graph_hash=graph.structure_hash)
    unlimited_host = simulate(graph, plan, UNLIMITED).host_peak_bytes
    assert unlimited_host > 0
    limited = UNLIMITED.with_(host_bytes=unlimited_host // 2)
    kept = free_swaps(graph, limited)
    assert kept and set(kept) < set(swaps)
    assert list(kept) == [t for t in swaps if t in kept]  # the order of issue is kept
    kept_plan = Plan("free", kept, graph_hash=graph.structure_hash)
    assert simulate(graph, kept_plan, limited).host_peak_bytes <= unlimited_host // 2


def test_the_milp_reference_respects_the_host():
    graph = synthetic.chain(6)
    budget_bytes = int(0.7 * keep_peak(graph))
    free = plan_swap_milp(graph, UNLIMITED, budget_bytes)
    assert free.plan is not None and free.plan.swapped
    free_host = simulate(graph, free.plan, UNLIMITED).host_peak_bytes
    limited = UNLIMITED.with_(host_bytes=free_host // 2)
    reference = plan_swap_milp(graph, limited, budget_bytes)
    assert reference.plan is not None, reference.solution.status
    timeline = simulate(graph, reference.plan, limited)
    assert timeline.host_peak_bytes <= free_host // 2
    assert timeline.peak_bytes <= budget_bytes
    assert reference.solution.step_time_s >= free.solution.step_time_s * (1 - 1e-9)


def _swaps_everything(graph, hardware, budget_bytes=None, **params):
    """A strategy that ignores host_bytes: every forward value swapped back before its readers."""
    decisions = {}
    for name, tensor in graph.tensors.items():
        readers = [c for c in tensor.consumers if graph.op(c).phase != "forward"]
        if tensor.producer and not tensor.is_output and readers \
                and graph.op(tensor.producer).phase == "forward":
            first = min(graph.index[c] for c in readers)
            decisions[name] = Swap((SwapIn(graph.ops[first - 1].name, tuple(readers)),))
    return Plan("keep", decisions, graph_hash=graph.structure_hash)


def test_planning_refuses_a_strategy_that_swaps_past_the_host(monkeypatch):
    from memfit.data.units import Budget
    from memfit.planning.step import plan_step  # imports torch: only this test needs it

    monkeypatch.setitem(strategies._REGISTRY, "test-swaps-everything", _swaps_everything)
    graph = synthetic.chain(8)
    made = plan_step(graph, UNLIMITED, None, "test-swaps-everything", {})
    held = made.predicted.host_peak_bytes
    assert held > 0
    with pytest.raises(BudgetError, match="host_bytes") as caught:
        plan_step(graph, UNLIMITED.with_(host_bytes=held - 1), Budget(bytes=1 << 40),
                  "test-swaps-everything", {})
    assert caught.value.host_bytes == held - 1


@pytest.mark.parametrize("strategy", ["swap", "vdnn_all", "jit-swap"])
def test_without_a_budget_the_swaps_stop_at_the_host(strategy):
    """No budget: the strategy's swaps as given, the first ones the host holds; the plan
    counts those it left out."""
    graph = synthetic.chain(10)
    free = plan_with(strategy, graph, UNLIMITED, None)
    free_host = simulate(graph, free, UNLIMITED).host_peak_bytes
    limited = UNLIMITED.with_(host_bytes=free_host // 3)
    made = plan_with(strategy, graph, limited, None)
    assert simulate(graph, made, limited).host_peak_bytes <= free_host // 3
    assert made.params["host_dropped"] == len(free.swapped) - len(made.swapped) > 0
    assert "host_dropped" not in free.params
