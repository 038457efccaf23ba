"""The Keep plan's profile and lifetimes: the base every change of the memory model is read
against (``memfit.model.profile.BaseProfile`` adds the queries).

Why a module of its own: the swap and re-run changes (``profile``, ``rerun_delta``) both read
the Keep plan's per-op bytes and lifetimes; with them here, below both, neither imports the
other's queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import cached_property

import numpy as np

from memfit.data.costgraph import CostGraph, Op
from memfit.data.plan import Plan, Swap
from memfit.model.keys import COMPUTE, STRIDE, SWAP_IN, SWAP_OUT, RangeMax
from memfit.model.recompute import late_readers
from memfit.model.schedule import lower, memory_profile, tensor_bytes
from memfit.model.sharding import COLLECTIVE_KINDS
from memfit.model.sharding import WAIT as COMM_WAIT


class KeepProfile:
    """The Keep plan's memory profile, lifetimes and compute clock of one graph.

    Built from ``memory_profile(lower(graph, Plan("keep")))`` itself (one compute action per op),
    so the base cannot drift from the truth. For a graph inductor runs it is the truth of the
    same graph with every op its own kernel (``aot_eager``'s): the changes priced on it follow
    op order, not inductor's inlined values and fused kernels (``memfit.model.inlining``), so
    the planners that ask this model search on that proxy and check what they choose on the
    truth.
    """

    def __init__(self, graph: CostGraph) -> None:
        eager = graph if graph.compiler == "aot_eager" else replace(graph, compiler="aot_eager")
        profile = memory_profile(lower(eager, Plan("keep")))
        self.graph, self.op_count = graph, len(graph.ops)
        self.resident_bytes, self.keep_peak_bytes = graph.resident_bytes, profile.peak_bytes
        self.high_bytes = np.asarray(profile.high_bytes, dtype=np.int64)  # while op k runs
        self.live_after = np.asarray(profile.live_bytes, dtype=np.int64)  # after op k
        self._range_max = RangeMax(self.high_bytes)
        index = graph.index
        self.produced_at = {name: index[t.producer] for name, t in graph.tensors.items()
                            if t.producer is not None}
        self.last_key = {  # the Keep plan's lifetimes of the buffers it frees
            name: max([at, *(index[c] for c in graph.tensors[name].consumers)]) * STRIDE + COMPUTE
            for name, at in self.produced_at.items() if not graph.tensors[name].is_output
        }
        self.op_time_s = np.asarray([op.time_s for op in graph.ops], dtype=float)
        self.keep_end_s = np.cumsum(self.op_time_s)  # the Keep plan's compute clock
        self.op_times = self.op_time_s.tolist()  # for additions one at a time
        self.has_collectives = any(op.kind in COLLECTIVE_KINDS or op.kind == COMM_WAIT
                                   for op in graph.ops)

    def live_across(self, tensors: Iterable[str], op: int) -> set[str]:
        """The tensors of ``tensors`` the Keep plan holds across op ``op``'s end: allocated at or
        before its compute and read after it (so counted in ``live_after[op]``). For bounds that
        take some of them out of that figure (``CountBounds``' boundary)."""
        return {t for t in tensors
                if t in self.last_key and self.produced_at[t] <= op < self.last_key[t] // STRIDE}

    @cached_property
    def live_before(self) -> np.ndarray:
        """Per op, the Keep plan's bytes live before it runs (after the op before)."""
        return np.concatenate(([self.resident_bytes], self.live_after[:-1]))

    @cached_property
    def readers(self) -> dict[str, list[int]]:
        """Tensor -> the positions of the ops that read it, in order (for re-run changes)."""
        index = self.graph.index
        return {name: sorted(index[c] for c in t.consumers)
                for name, t in self.graph.tensors.items()}

    @cached_property
    def op_named(self) -> dict[str, Op]:
        """Op name -> the op (a plain dict: the re-run walks look ops up by name in their hot
        loops)."""
        return {op.name: op for op in self.graph.ops}

    @cached_property
    def size_bytes(self) -> Mapping[str, int]:
        """Tensor -> its bytes (for the re-run walks' hot loops)."""
        return tensor_bytes(self.graph)

    @cached_property
    def first_late_reader(self) -> dict[str, int]:
        """Tensor -> position of its first reader outside the forward pass."""
        return late_readers(self.graph)

    def swap_lifetimes(self, name: str, swap: Swap, first: list[int], last: list[int],
                       size: list[int]) -> None:
        """One swapped tensor's changed lifetimes: the original now lives to its swap-out or its
        last unserved reader; each copy from its swap-in to its last reader (added to the
        lists). (The tuner's hot loop: keys are computed inline.)

        Raises:
            ValueError: for a swap-in that feeds re-runs (not modelled: ``simulate`` prices
                those plans)."""
        index = self.graph.index
        tensor = self.graph.tensors[name]
        produced_at, size_bytes = self.produced_at[name], tensor.size_bytes
        served = {c for swap_in in swap.swap_ins for c in swap_in.consumers}
        unserved = max((index[c] for c in tensor.consumers if c not in served), default=-1)
        start = produced_at * STRIDE + COMPUTE
        first += (start, start)
        last += (self.last_key[name],
                 unserved * STRIDE + COMPUTE if unserved >= 0 else produced_at * STRIDE + SWAP_OUT)
        size += (-size_bytes, size_bytes)
        for swap_in in swap.swap_ins:
            issued_at = index[swap_in.after]
            readers = [index[c] for c in swap_in.consumers]
            if min(readers) <= issued_at:
                raise ValueError(f"the swap-in of {name!r} after {swap_in.after!r} feeds re-runs, "
                                 "which the incremental profile does not model yet")
            first.append(issued_at * STRIDE + SWAP_IN)
            last.append(max(readers) * STRIDE + COMPUTE)
            size.append(size_bytes)

