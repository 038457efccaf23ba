"""Nested recomputation over the chain of separator blocks: revolve where one level is not enough.

Why. The segment DP (``memfit.planning.solvers.segments``) rebuilds each segment in one go from the kept
separator before it: one level of checkpoints, whose smallest peak holds about 2 sqrt(blocks)
separators and a whole segment. Below it the only other recomputation plan is memory-poor's
(rebuild from the inputs before every backward op: O(n^2) re-runs, many times the step).
Revolve's schedules sit between: separators rebuilt from separators, as many
levels deep as the budget needs, for a few extra forward passes. The chain DP
(``memfit.planning.solvers.chain``) finds the one of least recompute time on a chain of unequal steps;
here the steps are the blocks.

The mapping. Chain step i is block i - 1 (the last block, holding the loss, is the chain's
``Loss``): F_i runs the block's forward ops, reading its input separator a_{i-1} and making its
closing separator a_i; B_i is the block's backward ops, which also read the block's own inner
values: those are rebuilt from a_{i-1} right before B_i (Beaumont et al.'s "F_all", which this
chain model leaves out, so the chain's budget sets aside the largest block's inner bytes). Every
``Forward`` in the schedule's backward phase becomes re-runs of the block's ops right before the
first backward op of the next block the schedule reverses.

Correct whatever the placement: a reader reads the newest instance made before it, and every
instance lives until its last reader, so a re-run placed too late costs memory, never a wrong
value. The chain's accounting is not the step's exact peak: the optimal-recompute strategy prices
each schedule with ``simulate`` and cuts the chain's budget by any excess (``next_chain_budget``
says by how much).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from memfit.data.costgraph import CostGraph
from memfit.planning.solvers.chain import (
    Backward,
    ChainCosts,
    Forward,
    Loss,
    solve_chain_costs,
)
from memfit.planning.solvers.segments import Blocks
from memfit.planning.tuning import TUNING


@dataclass(frozen=True)
class NestedSchedule:
    """The chain DP's schedule over the blocks, lowered to re-runs.

    Args:
        reruns: ``(op, before)`` pairs, in order: forward op ``op`` runs again right before op
            ``before`` (``Rerun``'s fields; the strategy builds the plan).
        chain_peak_bytes: the peak the chain DP counts for it (its own accounting: no resident
            bytes, no block's inner values), which the next target of the tightening reads.
    """

    reruns: tuple[tuple[str, str], ...]
    chain_peak_bytes: int


def nested_schedule(chain: BlockChain, chain_budget_bytes: int) -> NestedSchedule | None:
    """The schedule of least recompute over ``chain`` within ``chain_budget_bytes`` of the chain's
    own accounting (``BlockChain.chain_budget_bytes`` converts a step's budget), as re-runs;
    ``None`` when the DP finds none, or the budget is not positive."""
    if chain_budget_bytes <= 0:
        return None
    schedule = solve_chain_costs(chain.costs, chain_budget_bytes,
                                 memory_units=TUNING.chain_memory_units)
    if schedule is None:
        return None
    return NestedSchedule(chain.reruns(schedule.operations), schedule.peak_bytes)


def next_chain_budget(chain_budget_bytes: int, excess_bytes: int, planned: NestedSchedule,
                      previous: NestedSchedule | None) -> int:
    """The chain budget to try after ``planned`` came out ``excess_bytes`` over: cut by the
    excess; if the last cut found the same schedule, cut from what it uses (the DP gives it for
    every budget down to its own peak)."""
    used_bytes = planned.chain_peak_bytes
    stuck = previous is not None and previous.chain_peak_bytes == used_bytes
    return (used_bytes if stuck else chain_budget_bytes) - excess_bytes


class BlockChain:
    """The blocks of a step seen as a chain: per step its ops, costs and where its backward starts."""

    def __init__(self, graph: CostGraph, blocks: Blocks, advance: list[list[str]],
                 inner: list[list[str]], backward_start: list[str], costs: ChainCosts,
                 largest_inner_bytes: int) -> None:
        self.graph = graph
        self.blocks = blocks
        self.advance = advance  # per chain step: the forward ops that make its separator
        self.inner = inner  # per chain step: the forward ops that rebuild what its backward reads
        self.backward_start = backward_start  # per chain step: its first backward op
        self.costs = costs
        self.largest_inner_bytes = largest_inner_bytes

    def chain_budget_bytes(self, budget_bytes: int) -> int:
        """The chain's budget for a whole step's ``budget_bytes``: the chain counts neither the
        resident bytes nor the blocks' inner values, so both are set aside (the largest block's)."""
        return budget_bytes - self.graph.resident_bytes - self.largest_inner_bytes

    @classmethod
    def from_blocks(cls, graph: CostGraph, blocks: Blocks) -> BlockChain:
        steps = blocks.count - 1
        forward = [i for i, op in enumerate(graph.ops) if op.phase == "forward"]
        ops_of: list[list[str]] = [[] for _ in range(blocks.count)]
        for position in forward:
            ops_of[int(blocks.owner[position])].append(graph.ops[position].name)
        late = _read_late(graph)
        advance, inner, starts = [], [], []
        forward_time, activation, output, inner_bytes = [], [], [], []
        for block in range(steps):
            closing = blocks.closing[block]
            advance.append(_ancestors_within(graph, ops_of[block], closing))
            wanted = {t for t in blocks.droppable[block] if t in late}
            inner.append(_ancestors_within(graph, ops_of[block], wanted))
            starts.append(_backward_start(graph, blocks, block))
            forward_time.append(sum(graph.op(name).time_s for name in ops_of[block]))
            activation.append(_storage_bytes(graph, closing))
            output.append(_backward_output_bytes(graph, blocks, block))
            inner_bytes.append(_storage_bytes(graph, wanted))
        costs = ChainCosts(tuple(forward_time), tuple(forward_time), tuple(activation),
                           gradient_bytes=tuple(activation), output_bytes=tuple(output))
        return cls(graph, blocks, advance, inner, starts, costs, max(inner_bytes, default=0))

    def reruns(self, operations: Iterable[object]) -> tuple[tuple[str, str], ...]:
        """The schedule's backward phase as ``(op, before)`` re-runs: the advances before each
        ``Backward``, then the reversed block's inner values, all right before that block's first
        backward op."""
        found: list[tuple[str, str]] = []
        pending: list[str] = []
        last_step = len(self.advance)
        backward_phase = False
        for operation in operations:
            if isinstance(operation, Forward) and backward_phase:
                pending += self.advance[operation.step - 1]
            elif isinstance(operation, Backward):
                backward_phase = True
                block = operation.step - 1
                if operation.step != last_step:  # the last block's inner values are still live
                    pending += self.inner[block]
                before = self.backward_start[block]
                found += [(op, before) for op in pending if self.graph.op(op).outputs]
                pending = []
            elif isinstance(operation, Loss):
                backward_phase = True
        return tuple(found)


def _read_late(graph: CostGraph) -> set[str]:
    """Tensors some op outside the forward pass reads."""
    return {t for op in graph.ops if op.phase != "forward" for t in op.inputs}


def _ancestors_within(graph: CostGraph, ops: list[str], tensors: Iterable[str]) -> list[str]:
    """The ops of ``ops`` (one block's, in program order) that ``tensors`` need, in that order."""
    mine = set(ops)
    needed: set[str] = set()
    pending = [p for t in tensors if (p := graph.tensors[t].producer) is not None and p in mine]
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.add(name)
        pending += [p for t in graph.op(name).inputs
                    if (p := graph.tensors[t].producer) is not None and p in mine]
    return [name for name in ops if name in needed]


def _backward_start(graph: CostGraph, blocks: Blocks, block: int) -> str:
    """The first backward op priced by ``block`` (by ``blocks.owner``), else the first backward
    op of an earlier block: where the block's backward begins."""
    backward = np.array([op.phase != "forward" for op in graph.ops])
    for candidate in range(block, -1, -1):
        positions = np.nonzero(backward & (blocks.owner == candidate))[0]
        if positions.size:
            return graph.ops[int(positions[0])].name
    return graph.ops[int(np.nonzero(backward)[0][-1])].name


def _backward_output_bytes(graph: CostGraph, blocks: Blocks, block: int) -> int:
    """Bytes the block's backward ops return (weight gradients: live to the end)."""
    return sum(graph.tensors[t].size_bytes for position, op in enumerate(graph.ops)
               if op.phase != "forward" and blocks.owner[position] == block
               for t in op.outputs if graph.tensors[t].is_output)


def _storage_bytes(graph: CostGraph, tensors: Iterable[str]) -> int:
    return sum(graph.tensors[t].size_bytes for t in tensors)
