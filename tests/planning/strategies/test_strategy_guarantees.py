"""What every plan promises, on random graphs: the same plan whatever the clock says, ``auto``
fits wherever a single strategy does and is never slower than a candidate it ran, and a
``BudgetError``'s minimum is a budget the same strategy fits."""

import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memfit.planning.solvers._milp_model as milp_model
from memfit.data.errors import BudgetError
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp import MilpSolution
from memfit.planning.strategies import get_strategy, strategy_names
from memfit.planning.strategies.recomputing import optimal_recompute

HARDWARE = get_hardware("h100-pcie")
SINGLE = tuple(name for name in strategy_names("aot_eager") if name != "auto")


def slow_clock(monkeypatch, factor: float = 1000.0) -> None:
    """Python's clocks run ``factor`` times fast: a machine ``factor`` times slower, as far as
    any time-based cut in memfit's own code could tell."""
    for name in ("perf_counter", "monotonic", "time", "process_time"):
        real = getattr(time, name)
        start = real()
        monkeypatch.setattr(time, name, lambda real=real, start=start: start + factor * (real() - start))


def spy_on_highs(monkeypatch) -> list[dict]:
    """Record the options of every ``scipy.optimize.milp`` call memfit's solvers make."""
    calls: list[dict] = []
    real = milp_model.milp

    def spied(*args, **kwargs):
        calls.append(dict(kwargs.get("options") or {}))
        return real(*args, **kwargs)

    monkeypatch.setattr(milp_model, "milp", spied)
    return calls


def plan_json(strategy: str, graph, budget_bytes: int, **params) -> str:
    made = get_strategy(strategy)(graph, HARDWARE, budget_bytes, **params)
    return json.dumps(made.to_json(), sort_keys=True)


def keep_peak(graph) -> int:
    return simulate(graph, Plan("keep"), HARDWARE, record_intervals=False).peak_bytes


def fits(graph, strategy: str, budget_bytes: int) -> Plan | None:
    """The strategy's plan (its defaults) if it fits by simulation, else ``None``."""
    try:
        made = get_strategy(strategy)(graph, HARDWARE, budget_bytes)
    except BudgetError:
        return None
    peak = simulate(graph, made, HARDWARE, record_intervals=False).peak_bytes
    return made if peak <= budget_bytes else None


GRAPHS = st.one_of(  # up to ~22 ops: optimal-recompute's MILP takes 15 s on resnet_like(3)
    st.builds(lambda size, seed: synthetic.random_dag(size, seed=seed),
              st.integers(4, 8), st.integers(0, 10_000)),
    st.builds(synthetic.chain, st.integers(2, 8)),
    st.builds(synthetic.multi_tower, st.integers(2, 3), st.integers(2, 3)),
    st.builds(synthetic.resnet_like, st.integers(1, 2)),
)


def test_the_milp_plans_the_same_under_a_slow_clock_and_never_gets_a_wall_time(monkeypatch):
    graph = synthetic.chain(6)
    budget_bytes = int(0.7 * keep_peak(graph))
    calls = spy_on_highs(monkeypatch)
    normal = plan_json("optimal-recompute", graph, budget_bytes)
    slow_clock(monkeypatch)
    slowed = plan_json("optimal-recompute", graph, budget_bytes)
    assert slowed == normal
    assert json.loads(normal)["params"]["solver"] == "milp"
    assert len(calls) == 2
    assert all("time_limit" not in options and options["node_limit"] >= 1 for options in calls)


def test_a_time_limit_is_refused_with_what_replaced_it():
    with pytest.raises(ValueError, match="node_limit"):
        get_strategy("optimal-recompute")(synthetic.chain(4), HARDWARE, 1, time_limit_s=2.0)


def test_a_milp_that_stops_early_hands_over_and_never_says_does_not_fit(monkeypatch):
    """Stopped at its node limit with no schedule: the DP plans, and where nothing fits the
    error says which solver stopped early."""
    graph = synthetic.chain(6)
    stopped = MilpSolution(float("inf"), -1, "node_limit", 0.0)
    monkeypatch.setattr(optimal_recompute, "solve_milp", lambda *args, **kwargs: stopped)
    budget_bytes = int(0.7 * keep_peak(graph))
    made = get_strategy("optimal-recompute")(graph, HARDWARE, budget_bytes)
    assert made.params["milp_status"] == "node_limit" and made.params["solver"] != "milp"
    assert simulate(graph, made, HARDWARE).peak_bytes <= budget_bytes
    for strategy in ("optimal-recompute", "auto"):
        with pytest.raises(BudgetError, match="node limit") as refused:
            get_strategy(strategy)(graph, HARDWARE, 1)
        assert refused.value.dominant


@settings(max_examples=12, deadline=None, derandomize=True)
@given(GRAPHS, st.floats(0.2, 0.95))
def test_auto_fits_wherever_one_strategy_fits_and_is_never_slower_than_its_candidates(
        graph, fraction):
    budget_bytes = int(fraction * keep_peak(graph))
    fitting = [name for name in SINGLE if fits(graph, name, budget_bytes) is not None]
    try:
        made = get_strategy("auto")(graph, HARDWARE, budget_bytes)
    except BudgetError:
        assert not fitting
        return
    timeline = simulate(graph, made, HARDWARE, record_intervals=False)
    assert timeline.peak_bytes <= budget_bytes
    ran = [time_s for time_s in made.params["candidates"].values() if time_s is not None]
    assert timeline.step_time_s <= min(ran) * (1 + 1e-12)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(GRAPHS, st.floats(0.0, 0.6))
def test_every_strategys_minimum_is_a_budget_it_fits(graph, fraction):
    """Planning again at exactly the reported minimum fits, and the error names what is live."""
    budget_bytes = max(1, int(fraction * keep_peak(graph)))
    inductor = dataclasses.replace(graph, compiler="inductor")  # fused-chains plans only its
    for strategy in strategy_names():
        planned = graph if strategy in strategy_names(graph.compiler) else inductor
        try:
            get_strategy(strategy)(planned, HARDWARE, budget_bytes)
            continue
        except BudgetError as error:
            minimum, dominant = error.minimum_bytes, error.dominant
        assert minimum > budget_bytes and dominant, strategy
        assert fits(planned, strategy, minimum) is not None, (strategy, minimum)
