"""Optimal recomputation for a chain: Griewank's revolve and a dynamic program under a byte budget.

The model. A chain of ``l`` forward steps F_1..F_l: step i reads activation a_{i-1} and allocates
a_i (a_0 is the input: resident, never counted, never freed). Then a ``Loss`` reads a_l and
allocates the loss (``loss_bytes``, lives to the end); a_l is freed (nothing else reads it) and the
seed gradient g_l is allocated. Then the backward steps B_l..B_1 run in that order: B_i reads
a_{i-1} and g_i, allocates g_{i-1} (none for i = 1: the input needs no gradient) and its step
outputs (``output_bytes``: weight gradients, live to the end), then frees g_i and a_{i-1}.

Memory is counted like ``memfit.model.schedule``: in program order, an operation allocates its
outputs, the high-water mark is taken, then dead buffers are freed. So F_i holds a_{i-1} and a_i at
once. A schedule may drop any activation (``Free``) and recompute it later by re-running forward
steps from the nearest earlier live activation, any number of times; recomputed activations may be
kept as checkpoints for later backward steps (the revolve setting). The forward pass itself runs
every F_i once; *recompute time* is the time of every further forward step.

Note:
    Revolve's conventions (``revolve_forward_steps``, Griewank & Walther ch. 12): ``slots`` = c
    snapshots *including* the one holding x_0; one working state, not counted, advanced in place;
    the reverse of step i runs from x_{i-1} and its forward part is not counted, so x_l is never
    stored; t(l, c) counts every advance, the first sweep x_0 -> x_{l-1} included. So
    t(l, 1) = l (l - 1) / 2 and t(l, c >= l - 1) = l - 1. ``revolve_extra_steps`` = t - (l - 1):
    the advances beyond the training step's own forward pass (0 with enough slots, (l - 1)(l - 2)
    / 2 with one). This byte model reproduces revolve exactly (tested l <= 24, c <= 6) with
    ``in_place_forward=True``, unit a_1..a_{l-1}, a_l of 0 bytes and a budget of c units: a_0 is
    free here but takes revolve's first slot, the working state is free there but costs a unit
    here. Without in-place steps F_i holds input and output at once, and a budget of c units is
    worth at least c - 1 slots and at most c (tested l <= 24, c <= 7): 2 units cost
    floor((l - 1)² / 4) extra steps, between (l - 2)(l - 1) / 2 and revolve's two slots.

    The DP is exact over *persistent* schedules: an activation is either a passing intermediate
    of one advance (freed by the next forward step) or kept until the backward step that reads
    it, the class revolve's and Beaumont et al.'s DPs optimise over. Keeping an activation for
    a while and then dropping it to recompute it later can do better on heterogeneous chains
    (6 of 1500 random instances of up to 6 steps). ``solve_milp`` on ``chain_graph(costs)`` finds
    those too: it equals an exhaustive search over all schedules (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from memfit.planning.solvers._chain_tables import ChainTables
from memfit.planning.solvers.chain_costs import ChainCosts
from memfit.planning.solvers.revolve import (
    revolve_closed_form,
    revolve_extra_steps,
    revolve_forward_steps,
)

__all__ = [
    "Backward", "ChainCosts", "ChainReplay", "ChainSchedule", "Forward", "Free", "Loss",
    "Operation", "default_schedule", "memory_poor_schedule", "revolve_closed_form",
    "revolve_extra_steps", "revolve_forward_steps", "simulate_chain", "solve_chain",
    "solve_chain_costs", "sqrt_schedule",
]


@dataclass(frozen=True)
class Forward:
    """Run F_step: needs a_{step-1} live; allocates a_step."""

    step: int


@dataclass(frozen=True)
class Loss:
    """Read a_l, allocate the loss, free a_l, allocate the seed gradient g_l (once)."""


@dataclass(frozen=True)
class Backward:
    """Run B_step: needs a_{step-1} and g_step; allocates g_{step-1}; frees g_step, a_{step-1}."""

    step: int


@dataclass(frozen=True)
class Free:
    """Drop activation a_step (step >= 1) from memory."""

    step: int


Operation = Forward | Loss | Backward | Free


def _operation(kind: str, step: int) -> Operation:
    """The operation a DP table entry ``(kind, step)`` stands for."""
    if kind == "forward":
        return Forward(step)
    if kind == "backward":
        return Backward(step)
    if kind == "free":
        return Free(step)
    return Loss()


@dataclass(frozen=True)
class ChainSchedule:
    """A checked schedule: its operations, recompute time and exact peak (see ``simulate_chain``)."""

    operations: tuple[Operation, ...]
    recompute_time_s: float
    peak_bytes: int


class ChainReplay(NamedTuple):
    recompute_time_s: float
    peak_bytes: int


# ---- replay ---------------------------------------------------------------------------------------


def simulate_chain(operations: tuple[Operation, ...] | list[Operation], costs: ChainCosts) -> ChainReplay:
    """Replay ``operations`` on the chain, checking each, and return (recompute_time_s, peak_bytes).

    The peak counts activations a_1..a_l, gradients, step outputs and the loss as the module
    docstring says; a_0 and parameters are resident and left out.

    Raises:
        ValueError: naming the first operation whose inputs are missing, or a schedule that does
            not run every backward step once, in order.
    """
    state = _ReplayState(costs)
    for index, operation in enumerate(operations):
        following = operations[index + 1] if index + 1 < len(operations) else None
        try:
            state.apply(operation, following)
        except ValueError as error:
            raise ValueError(f"operation {index} ({operation}): {error}") from None
    if state.next_backward != 0:
        raise ValueError("the schedule stops before B_1: every backward step must run")
    recompute_time_s = math.fsum(
        (count - 1) * time_s for count, time_s in zip(state.runs[1:], costs.forward_time_s, strict=True)
    )
    return ChainReplay(recompute_time_s, state.peak_bytes)


class _ReplayState:
    """Live activations and bytes while a schedule replays; one method per operation kind."""

    def __init__(self, costs: ChainCosts) -> None:
        self.costs, self.steps = costs, costs.steps
        self.activation = (0, *costs.activation_bytes)
        self.gradient = (0, *costs.gradient_bytes)
        self.output = (0, *costs.output_bytes)
        self.live: set[int] = {0}
        self.runs = [0] * (self.steps + 1)
        self.live_bytes = self.peak_bytes = 0
        self.next_backward: int | None = None  # the step whose gradient is live
        self.overwritten = 0  # an in-place Forward(i) has already taken a_{i-1}'s bytes off

    def allocate(self, size_bytes: int) -> None:
        self.live_bytes += size_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def drop(self, step: int) -> None:
        self.live.discard(step)
        self.live_bytes -= self.activation[step]

    def apply(self, operation: Operation, following: Operation | None) -> None:
        if isinstance(operation, Forward):
            self.forward(operation.step, following)
        elif isinstance(operation, Loss):
            if self.steps not in self.live or self.next_backward is not None:
                raise ValueError(f"the loss needs a_{self.steps} and runs once")
            self.allocate(self.costs.loss_bytes)
            self.drop(self.steps)
            self.allocate(self.gradient[self.steps])
            self.next_backward = self.steps
        elif isinstance(operation, Backward):
            step = operation.step
            if step != self.next_backward or step - 1 not in self.live:
                raise ValueError(f"expected B_{self.next_backward} with a_{step - 1} live")
            self.allocate(self.gradient[step - 1] + self.output[step])
            self.live_bytes -= self.gradient[step]
            if step > 1:
                self.drop(step - 1)
            self.next_backward = step - 1
        elif isinstance(operation, Free):
            if operation.step < 1 or operation.step not in self.live:
                raise ValueError(f"a_{operation.step} is not a live activation")
            if operation.step == self.overwritten:
                self.live.discard(operation.step)
                self.overwritten = 0
            else:
                self.drop(operation.step)
        else:
            raise TypeError(f"{operation!r} is not a chain operation")

    def forward(self, step: int, following: Operation | None) -> None:
        if not 1 <= step <= self.steps or step - 1 not in self.live or step in self.live:
            raise ValueError(f"needs a_{step - 1} live and a_{step} not yet live")
        if step == self.steps and self.next_backward is not None:
            raise ValueError("the last step runs once, before the loss")
        self.live.add(step)
        self.runs[step] += 1
        overwrite = self.costs.in_place_forward and step > 1 and following == Free(step - 1)
        if overwrite:  # a_{step-1} is overwritten: the Free that follows is counted here
            self.live_bytes -= self.activation[step - 1]
            self.overwritten = step - 1
        self.allocate(self.activation[step])


# ---- dynamic program -----------------------------------------------------------------------------


def solve_chain(
    forward_time_s: tuple[float, ...] | list[float],
    backward_time_s: tuple[float, ...] | list[float],
    activation_bytes: tuple[int, ...] | list[int],
    budget_bytes: int,
    *,
    gradient_bytes: tuple[int, ...] | list[int] = (),
    output_bytes: tuple[int, ...] | list[int] = (),
    loss_bytes: int = 0,
    memory_units: int = 400,
) -> ChainSchedule | None:
    """The schedule of least recompute time whose peak fits ``budget_bytes``; None if none does.

    Args:
        forward_time_s, backward_time_s, activation_bytes, gradient_bytes, output_bytes,
            loss_bytes: the chain, as ``ChainCosts`` describes it.
        budget_bytes: the most live bytes allowed (a_0 and parameters excluded).
        memory_units: how finely the DP counts memory (default 400). When every size and the
            budget share a divisor that gives at most this many units the DP is exact; otherwise
            sizes are rounded *up* to units of ceil(budget / memory_units) bytes, so the schedule
            always fits but may recompute a little more than the true optimum. Time and memory
            grow linearly with it: O(l³ units) time, O(l² units) memory.

    Example:
        >>> schedule = solve_chain([1.0] * 4, [2.0] * 4, [10] * 4, budget_bytes=30)
        >>> schedule.recompute_time_s, schedule.peak_bytes
        (1.0, 30)
    """
    costs = ChainCosts(
        tuple(forward_time_s), tuple(backward_time_s), tuple(activation_bytes),
        tuple(gradient_bytes), tuple(output_bytes), loss_bytes,
    )
    return solve_chain_costs(costs, budget_bytes, memory_units=memory_units)


def solve_chain_costs(costs: ChainCosts, budget_bytes: int, memory_units: int = 400) -> ChainSchedule | None:
    """``solve_chain`` on a ``ChainCosts``: fill the DP tables, rebuild the schedule, replay it."""
    if budget_bytes < 0 or memory_units < 1:
        raise ValueError("budget_bytes must be >= 0 and memory_units >= 1")
    tables = ChainTables.fill(costs, budget_bytes, memory_units)
    if not np.isfinite(tables.sweep[0, tables.budget_units]):
        return None
    operations = tuple(_operation(kind, step) for kind, step in tables.operations())
    replay = simulate_chain(operations, costs)
    if replay.peak_bytes > budget_bytes:  # the rounding is conservative: this is a bug if it fires
        raise AssertionError(f"DP schedule peaks at {replay.peak_bytes} > {budget_bytes} bytes")
    return ChainSchedule(operations, replay.recompute_time_s, replay.peak_bytes)



# ---- the article's fixed schedules ----------------------------------------------------------------
# As ``simulate_chain`` counts them, with unit activations and no gradient bytes (the pebble game):
# default: peak l, 0 extra steps; memory_poor: peak 2 (F's input and output), l (l - 1) / 2;
# sqrt (k = ⌈√l⌉): peak max(k + 1, 2k - 2) for l = k², l - ⌈l / k⌉ extra (< one forward pass).


def default_schedule(steps: int) -> tuple[Operation, ...]:
    """Keep every activation: the forward pass, the loss, the backward pass (O(l) memory)."""
    return (*(Forward(step) for step in range(1, steps + 1)), Loss(),
            *(Backward(step) for step in range(steps, 0, -1)))


def memory_poor_schedule(steps: int) -> tuple[Operation, ...]:
    """Keep nothing but the input: each B_i recomputes a_{i-1} from a_0 (O(1) memory, O(l²) time).

    This is the article's strategy (forget each node as soon as it is consumed), so even a_{l-1},
    which the forward pass has just made, is dropped and recomputed for B_l.
    """
    operations: list[Operation] = [*_advance(0, steps), Loss()]
    for step in range(steps, 0, -1):
        operations += _advance(0, step - 1)
        operations.append(Backward(step))
    return tuple(operations)


def sqrt_schedule(steps: int, every: int | None = None) -> tuple[Operation, ...]:
    """Checkpoints a_k, a_2k, ... (k = ⌈√l⌉ unless ``every`` is given); each segment recomputed once.

    The forward pass keeps only the checkpoints. The backward pass takes the segments last to
    first: it recomputes and keeps the segment's activations from its checkpoint, then runs its
    backward steps. Every F_i runs at most twice: one extra forward pass at most.
    """
    every = every or max(1, math.ceil(math.sqrt(steps)))
    checkpoints = [step for step in range(every, steps, every)]
    operations: list[Operation] = []
    for step in range(1, steps + 1):
        operations.append(Forward(step))
        if step - 1 >= 1 and step - 1 not in checkpoints:
            operations.append(Free(step - 1))
    operations.append(Loss())
    bounds = [0, *checkpoints, steps]
    for start, end in reversed(list(zip(bounds, bounds[1:], strict=False))):
        operations += [Forward(step) for step in range(start + 1, end)]
        operations += [Backward(step) for step in range(end, start, -1)]
    return tuple(operations)


def _advance(start: int, end: int) -> list[Operation]:
    operations: list[Operation] = []
    for step in range(start + 1, end + 1):
        operations.append(Forward(step))
        if step - 1 > start:
            operations.append(Free(step - 1))
    return operations
