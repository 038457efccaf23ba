"""Exhaustive search over every schedule of a short chain: the oracle for the chain DP."""

from __future__ import annotations

import heapq
import itertools
import math

from memfit.planning.solvers.chain import ChainCosts

BEFORE_LOSS = -1


def brute_force_recompute_time_s(costs: ChainCosts, budget_bytes: int,
                                 persistent: bool = True) -> float:
    """Least recompute time over schedules that fit (Dijkstra on live sets); inf if none.

    A state is (live activations, next backward step or BEFORE_LOSS); its live bytes follow from
    it, so the search needs no schedule structure: any Forward, Free, Loss or Backward that the
    model allows and the budget admits is an edge. ``persistent`` allows ``Free(i)`` only right
    after ``Forward(i)``, ``Forward(i + 1)``: an activation is either a passing intermediate of
    one advance or kept until its backward step (the class the DP optimises over; the state then
    also remembers which activation the last operation made). ``persistent=False`` searches every
    schedule.
    """
    start = (frozenset(), BEFORE_LOSS, 0)  # (live, phase, activation the last operation made)
    best = {start: 0.0}
    counter = itertools.count()
    queue = [(0.0, next(counter), start)]
    while queue:
        time_s, _, (live, phase, fresh) = heapq.heappop(queue)
        if time_s > best[(live, phase, fresh)]:
            continue
        if phase == 0:
            return time_s - math.fsum(costs.forward_time_s)
        for cost_s, new_live, new_phase, high in _moves(costs, live, phase, fresh, persistent):
            if high > budget_bytes:
                continue
            made = next(iter(new_live - live), 0)
            state = (frozenset(new_live), new_phase, made)
            if time_s + cost_s < best.get(state, math.inf) - 1e-12:
                best[state] = time_s + cost_s
                heapq.heappush(queue, (time_s + cost_s, next(counter), state))
    return math.inf


def _moves(costs: ChainCosts, live: frozenset[int], phase: int, fresh: int,
           persistent: bool) -> list[tuple[float, frozenset[int], int, int]]:
    """Every operation allowed in a state: (forward time, live after, phase after, high bytes)."""
    steps = costs.steps
    activation = (0, *costs.activation_bytes)
    gradient = (0, *costs.gradient_bytes)
    output = (0, *costs.output_bytes)
    now = sum(activation[i] for i in live)
    if phase != BEFORE_LOSS:
        now += costs.loss_bytes + gradient[phase] + sum(output[phase + 1:])
    moves = [(0.0, live - {step}, phase, now) for step in (() if persistent else live)]
    for step in range(1, steps + 1):
        available = step == 1 or step - 1 in live
        if not available or step in live or (step == steps and phase != BEFORE_LOSS):
            continue
        time_s, high = costs.forward_time_s[step - 1], now + activation[step]
        moves.append((time_s, live | {step}, phase, high))
        if step > 1 and (fresh == step - 1 or not persistent):  # F_step, then drop its input
            overwrite = activation[step - 1] if costs.in_place_forward else 0
            moves.append((time_s, (live - {step - 1}) | {step}, phase, high - overwrite))
    if phase == BEFORE_LOSS and steps in live:
        high = max(now + costs.loss_bytes, now + costs.loss_bytes - activation[steps] + gradient[steps])
        moves.append((0.0, live - {steps}, steps, high))
    if phase > 0 and (phase == 1 or phase - 1 in live):
        moves.append((0.0, live - {phase - 1}, phase - 1, now + gradient[phase - 1] + output[phase]))
    return moves
