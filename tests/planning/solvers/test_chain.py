"""The chain DP against revolve, the article's three schedules and an exhaustive search."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.planning.solvers.chain import (
    Backward,
    ChainCosts,
    Forward,
    Free,
    Loss,
    default_schedule,
    memory_poor_schedule,
    revolve_closed_form,
    revolve_extra_steps,
    revolve_forward_steps,
    simulate_chain,
    solve_chain,
    solve_chain_costs,
    sqrt_schedule,
)
from tests.planning.solvers.chain_brute_force import brute_force_recompute_time_s

# ---- revolve -------------------------------------------------------------------------------------


def test_revolve_known_values():
    # by hand from t(l, c) = r l - C(c + r, c + 1), C(c + r - 1, c) < l <= C(c + r, c)
    assert [revolve_forward_steps(steps, 1) for steps in range(1, 7)] == [0, 1, 3, 6, 10, 15]
    assert [revolve_forward_steps(steps, 2) for steps in range(1, 8)] == [0, 1, 2, 4, 6, 8, 11]
    assert revolve_forward_steps(10, 3) == 2 * 10 - 5  # r = 2: 4 < 10 <= 10
    assert revolve_forward_steps(100, 10) == 3 * 100 - 78  # r = 3: 66 < 100 <= 286


@pytest.mark.parametrize("steps", [1, 2, 5, 17, 60])
def test_revolve_one_slot_is_memory_poor_and_enough_slots_cost_nothing(steps):
    assert revolve_forward_steps(steps, 1) == steps * (steps - 1) // 2
    assert revolve_extra_steps(steps, 1) == (steps - 1) * (steps - 2) // 2
    assert revolve_extra_steps(steps, max(1, steps - 1)) == 0
    assert revolve_extra_steps(steps, steps + 5) == 0
    if steps > 2:
        assert revolve_extra_steps(steps, steps - 2) == 1


def test_revolve_recurrence_equals_binomial_closed_form():
    for steps in range(1, 61):
        for slots in range(1, 11):
            assert revolve_forward_steps(steps, slots) == revolve_closed_form(steps, slots), (steps, slots)


def test_revolve_rejects_no_slot():
    with pytest.raises(ValueError, match="slots >= 1"):
        revolve_forward_steps(3, 0)


def test_dp_on_the_sliding_pebble_chain_equals_revolve():
    """c slots of revolve = a budget of c unit activations with in-place forward steps and a free
    a_l: a_0 (free here) takes revolve's first slot, and the working state takes the slot here."""
    for steps in range(1, 25):
        for slots in range(1, 7):
            costs = ChainCosts((1.0,) * steps, (2.0,) * steps, (1,) * (steps - 1) + (0,),
                               in_place_forward=True)
            schedule = solve_chain_costs(costs, slots)
            assert schedule is not None
            assert schedule.recompute_time_s == revolve_extra_steps(steps, slots), (steps, slots)
            forward_runs = sum(isinstance(operation, Forward) for operation in schedule.operations)
            assert forward_runs - steps == revolve_extra_steps(steps, slots)


def test_dp_without_in_place_steps_sits_between_revolve_slot_counts():
    """Out of place, c units buy at least revolve's c - 1 slots and at most its c slots."""
    for last_bytes in (0, 1):
        for steps in range(2, 20):
            for units in range(2, 7):
                costs = ChainCosts((1.0,) * steps, (1.0,) * steps, (1,) * (steps - 1) + (last_bytes,))
                extra = solve_chain_costs(costs, units).recompute_time_s
                assert revolve_extra_steps(steps, units) <= extra <= revolve_extra_steps(steps, units - 1)


# ---- the article's three schedules ----------------------------------------------------------------

ARTICLE = {  # steps: (default peak, memory-poor extra steps, sqrt peak, sqrt extra steps)
    4: (4, 6, 3, 2),
    9: (9, 36, 4, 6),
    16: (16, 120, 6, 12),
    100: (100, 4950, 18, 90),
}


@pytest.mark.parametrize("steps", sorted(ARTICLE))
def test_article_numbers(steps):
    default_peak, poor_extra, sqrt_peak, sqrt_extra = ARTICLE[steps]
    costs = ChainCosts.uniform(steps)  # unit activations, no gradient bytes: the pebble game
    assert simulate_chain(default_schedule(steps), costs) == (0.0, default_peak)
    assert simulate_chain(memory_poor_schedule(steps), costs) == (poor_extra, 2)  # O(1), O(n²)
    assert simulate_chain(sqrt_schedule(steps), costs) == (sqrt_extra, sqrt_peak)
    assert sqrt_extra < steps  # less than one extra forward pass
    runs = [0] * (steps + 1)
    for operation in sqrt_schedule(steps):
        if isinstance(operation, Forward):
            runs[operation.step] += 1
    assert max(runs) == 2  # each step computed at most twice


@pytest.mark.parametrize("steps", sorted(ARTICLE))
def test_dp_is_no_worse_than_the_article_schedules(steps):
    costs = ChainCosts.uniform(steps)
    for schedule in (default_schedule(steps), memory_poor_schedule(steps), sqrt_schedule(steps)):
        recompute_time_s, peak_bytes = simulate_chain(schedule, costs)
        best = solve_chain_costs(costs, peak_bytes)
        assert best is not None and best.peak_bytes <= peak_bytes
        assert best.recompute_time_s <= recompute_time_s
    # at the memory-poor budget of 2 the DP keeps a_{l-1} from the forward pass, and a kept a_s
    # can still make a_{s+1} in 2 units: (l - 1)² / 4 extra steps, not l (l - 1) / 2
    assert solve_chain_costs(costs, 2).recompute_time_s == (steps - 1) ** 2 // 4


def test_two_units_without_in_place_steps_matches_exhaustive_search():
    for steps in range(2, 9):
        costs = ChainCosts.uniform(steps)
        assert brute_force_recompute_time_s(costs, 2, persistent=False) == (steps - 1) ** 2 // 4


# ---- the DP itself ---------------------------------------------------------------------------------


def test_docstring_example_and_infeasible_budget():
    schedule = solve_chain([1.0] * 4, [2.0] * 4, [10] * 4, budget_bytes=30)
    assert schedule is not None and (schedule.recompute_time_s, schedule.peak_bytes) == (1.0, 30)
    assert solve_chain([1.0] * 4, [2.0] * 4, [10] * 4, budget_bytes=19) is None
    assert solve_chain([1.0] * 4, [2.0] * 4, [10] * 4, budget_bytes=40).recompute_time_s == 0.0


def test_rounded_memory_still_fits():
    """Sizes that share no divisor with the budget are rounded up: the schedule still fits."""
    costs = ChainCosts.uniform(30, activation_bytes=1_000_003)
    schedule = solve_chain_costs(costs, 7_654_321, memory_units=50)
    assert schedule is not None and schedule.peak_bytes <= 7_654_321
    exact = solve_chain_costs(ChainCosts.uniform(30), 7)
    assert schedule.recompute_time_s >= exact.recompute_time_s


def test_hundred_steps_three_hundred_units_is_fast():
    costs = ChainCosts(
        tuple(1.0 + (step % 7) / 10 for step in range(100)), (2.0,) * 100,
        tuple(1000 * (1 + step % 13) for step in range(100)), tuple(500 * (1 + step % 5) for step in range(100)),
    )
    started = time.perf_counter()
    schedule = solve_chain_costs(costs, 120_000, memory_units=300)
    assert time.perf_counter() - started < 5.0
    assert schedule is not None and schedule.peak_bytes <= 120_000


def test_replay_rejects_broken_schedules():
    costs = ChainCosts.uniform(3)
    with pytest.raises(ValueError, match="a_1"):
        simulate_chain((Forward(2),), costs)
    with pytest.raises(ValueError, match="expected B_3"):
        simulate_chain((Forward(1), Forward(2), Forward(3), Loss(), Backward(2)), costs)
    with pytest.raises(ValueError, match="B_1"):
        simulate_chain((Forward(1), Forward(2), Forward(3), Loss(), Backward(3)), costs)
    with pytest.raises(ValueError, match="not a live"):
        simulate_chain((Free(1),), costs)
    with pytest.raises(ValueError, match="one per step"):
        ChainCosts((1.0,), (1.0, 2.0), (1,))


@st.composite
def chains(draw, max_steps: int):
    steps = draw(st.integers(1, max_steps))
    sizes = st.lists(st.integers(1, 9), min_size=steps, max_size=steps)
    optional = st.one_of(st.just([]), st.lists(st.integers(0, 9), min_size=steps, max_size=steps))
    costs = ChainCosts(
        forward_time_s=tuple(draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.25, 3.0]),
                                           min_size=steps, max_size=steps))),
        backward_time_s=(1.0,) * steps,
        activation_bytes=tuple(draw(sizes)),
        gradient_bytes=tuple(draw(optional)),
        output_bytes=tuple(draw(optional)),
        loss_bytes=draw(st.integers(0, 3)),
        in_place_forward=draw(st.booleans()),
    )
    return costs, draw(st.integers(1, 12 * steps + 10))


@settings(max_examples=150, deadline=None)
@given(chains(max_steps=12))
def test_every_dp_schedule_replays_within_budget(case):
    costs, budget_bytes = case
    schedule = solve_chain_costs(costs, budget_bytes)
    if schedule is None:
        return
    assert simulate_chain(schedule.operations, costs) == (schedule.recompute_time_s, schedule.peak_bytes)
    assert schedule.peak_bytes <= budget_bytes


@settings(max_examples=150, deadline=None)
@given(chains(max_steps=6))
def test_dp_equals_exhaustive_search_over_persistent_schedules(case):
    costs, budget_bytes = case
    schedule = solve_chain_costs(costs, budget_bytes)
    best = brute_force_recompute_time_s(costs, budget_bytes)
    found = math.inf if schedule is None else schedule.recompute_time_s
    assert found == pytest.approx(best, abs=1e-9) or found == best == math.inf
    # dropping a checkpoint early (not persistent) can only help
    assert brute_force_recompute_time_s(costs, budget_bytes, persistent=False) <= best + 1e-9


def test_a_non_persistent_schedule_can_beat_the_dp():
    """Keep a_1 from the free forward pass, use it once, drop it: 3.06 s; the DP's best is 4.54 s."""
    costs = ChainCosts((1.48, 1.59, 1.13, 1.36), (1.0,) * 4, (2, 5, 4, 4), output_bytes=(1, 0, 1, 3),
                       loss_bytes=2)
    assert solve_chain_costs(costs, 12).recompute_time_s == pytest.approx(1.48 + 1.59 + 1.48)
    assert brute_force_recompute_time_s(costs, 12, persistent=False) == pytest.approx(1.48 + 1.59)
