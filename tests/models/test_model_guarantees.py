"""The planning guarantees on the four real models, at small sizes: the same plan under a slow
clock, ``auto`` fitting wherever a single strategy fits, and a step compiled at exactly a
``BudgetError``'s minimum running within it (measured)."""

import copy
import json

import pytest
import torch

import memfit
from memfit import examples
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.fitting.traced import trace_plan
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy, strategy_names
from memfit.planning.strategies.swapping import _just_in_time_swap
from tests.measured_peaks import assert_within_budget
from tests.planning.strategies.test_strategy_guarantees import slow_clock, spy_on_highs

SMALL = {
    "mlp": lambda: examples.mlp(depth=8, width=64, batch_size=256),
    "gpt2": lambda: examples.gpt2(layers=2, width=32, heads=2, vocab=64, sequence=32, batch_size=2),
    "resnet50": lambda: examples.resnet50_shaped(widths=(8, 16, 32, 64), image=32, batch_size=2),
    "unet3d": lambda: examples.unet3d(channels=(2, 4, 8, 16), size=16, batch_size=1),
}
HARDWARE = get_hardware("cpu")


@pytest.fixture(scope="module", params=sorted(SMALL))
def small(request):
    """The example and the graph ``compile`` plans for it on the CPU profile."""
    example = SMALL[request.param]()
    return example, compiled_graph(example)


def compiled_graph(example):
    return trace_plan(example.model, example.loss_fn, example.inputs(), None, "keep", HARDWARE,
                      {}).graph


def outcome(graph, strategy: str, budget_bytes: int) -> str:
    """The plan's JSON, or the error's minimum and tensors: all planning decides."""
    try:
        return json.dumps(get_strategy(strategy)(graph, HARDWARE, budget_bytes).to_json(),
                          sort_keys=True)
    except memfit.BudgetError as error:
        return f"BudgetError {error.minimum_bytes} {error.dominant}"


def keep_peak(graph) -> int:
    return simulate(graph, Plan("keep"), HARDWARE, record_intervals=False).peak_bytes


@pytest.mark.slow
def test_auto_plans_the_same_under_a_slow_clock(small, monkeypatch):
    _, graph = small
    budget_bytes = int(0.5 * keep_peak(graph))
    normal = outcome(graph, "auto", budget_bytes)
    slow_clock(monkeypatch)
    assert outcome(graph, "auto", budget_bytes) == normal


def test_where_only_the_milp_fits_auto_runs_it_the_same_under_a_slow_clock(monkeypatch):
    """The issue's case, small: on a 3-layer MLP the MILP fits below what every other strategy
    reaches, so auto must not give up there, and its plan must not depend on the clock.

    auto's just-in-time swap candidate reaches the MILP's minimum on this MLP (22,224 B, where
    the MILP refuses below it), so it is taken out here: the case is the MILP alone below the
    others."""
    monkeypatch.setattr(_just_in_time_swap, "plan", lambda *_args, **_named: None)
    example = examples.mlp(depth=3, width=16, batch_size=64)
    graph = compiled_graph(example)
    others = [name for name in strategy_names("aot_eager")
              if name not in ("auto", "optimal-recompute")]
    smallest = min(refusal(graph, name) for name in [*others, "auto"])
    budget_bytes = int(0.94 * smallest)
    calls = spy_on_highs(monkeypatch)
    normal = outcome(graph, "auto", budget_bytes)
    assert json.loads(normal)["params"]["optimal-recompute.solver"] == "milp"
    slow_clock(monkeypatch)
    assert outcome(graph, "auto", budget_bytes) == normal
    assert calls and all("time_limit" not in options for options in calls)


def refusal(graph, strategy: str) -> int:
    with pytest.raises(memfit.BudgetError) as refused:
        get_strategy(strategy)(graph, HARDWARE, 1)
    return refused.value.minimum_bytes


@pytest.mark.slow
def test_auto_fits_wherever_one_strategy_fits_and_is_never_slower_than_its_candidates(small):
    _, graph = small
    budget_bytes = (refusal(graph, "auto") + keep_peak(graph)) // 2  # halfway to its minimum
    fitting = []
    for name in strategy_names(graph.compiler):
        try:
            made = get_strategy(name)(graph, HARDWARE, budget_bytes)
        except memfit.BudgetError:
            continue
        if simulate(graph, made, HARDWARE, record_intervals=False).peak_bytes <= budget_bytes:
            fitting.append(name)
    assert set(fitting) - {"auto"}, "pick a budget some single strategy fits"
    assert "auto" in fitting, fitting
    made = get_strategy("auto")(graph, HARDWARE, budget_bytes)
    timeline = simulate(graph, made, HARDWARE, record_intervals=False)
    ran = [time_s for time_s in made.params["candidates"].values() if time_s is not None]
    assert timeline.step_time_s <= min(ran) * (1 + 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "optimal-recompute"])
def test_compiling_at_the_reported_minimum_runs_within_it(small, strategy):
    """Refused at one byte, compiled at exactly the minimum it reported: one step runs with its
    measured peak within that minimum (bit-for-bit results are test_models.py's). ResNet's optimal-recompute
    minimum is memory-poor's plan (~18,000 re-runs, minutes to run): planned and simulated."""
    example, graph = small  # the graph compile plans on the CPU
    with pytest.raises(memfit.BudgetError) as refused:
        get_strategy(strategy)(graph, HARDWARE, 1)
    minimum = refused.value.minimum_bytes
    assert refused.value.dominant
    if example.name == "resnet50" and strategy == "optimal-recompute":
        made = get_strategy(strategy)(graph, HARDWARE, minimum)
        assert simulate(graph, made, HARDWARE, record_intervals=False).peak_bytes <= minimum
        return
    model = copy.deepcopy(example.model)
    # parameters and buffers (BatchNorm's statistics) are inputs of the traced graph, so the
    # device's minimum is the graph's and the previous step's float32 loss (a loop holds it
    # beside the next): nothing else of the step lies outside its one region
    minimum += 4
    step = memfit.compile(model, example.loss_fn, budget=minimum, strategy=strategy)
    loss = step(*example.inputs())
    assert torch.isfinite(loss)
    assert step.compiled.outside_bytes == loss.untyped_storage().nbytes() == 4
    assert_within_budget(step, minimum)
