"""Kernels of a compiled step: the ops a compiler runs as one kernel, and the step priced so.

``aot_eager`` runs every aten op of the captured graph as its own kernel, each paying the
dispatcher (``Hardware.op_overhead_s``) and moving its own inputs and outputs through memory,
and calls the dispatcher for each view too (``Hardware.view_overhead_s``): ``analyze`` prices
each op that way. ``inductor`` fuses: a chain of memory-bound ops
(elementwise, reductions, norms; ``memfit.data.op_classes``) becomes one generated kernel that
reads what the chain reads from outside and writes what is read outside it, its intermediates
never leaving registers or cache. Compute ops (matmul, convolution, attention, RNN) stay
library calls (templates and extern kernels), priced as eager prices them, and so do random
ops under memfit's ``fallback_random`` (``fusible``).

``fused_kernels`` groups the ops as inductor's scheduler fuses them vertically: walking the
step in program order, a memory-bound op that reads a value of an open group joins it (two open
groups it reads from merge); a group closes once an op outside it reads one of its values, so
a group never straddles an op that depends on it (no fused kernel waits on itself). Ops of
another phase never join. A group's time is the roofline of its external bytes and its ops'
per-element work, plus one ``Hardware.kernel_overhead_s``; ``compiled_times`` spreads it over
the group's ops in proportion to their eager times, so the step time is the sum of its kernels' and a re-run of
part of a chain costs its share (inductor fuses a re-run chain too).
"""

from __future__ import annotations

from dataclasses import replace

from memfit.data.costgraph import CostGraph, Op
from memfit.data.hardware import Hardware
from memfit.data.op_classes import (
    COMPILED_SOFTMAX,
    MEMORY,
    RANDOM_DRAWS,
    SOFTMAX_KERNEL_KINDS,
    op_class,
)

COMPILERS = ("aot_eager", "inductor")
MAX_GROUP_OPS = 64  # inductor's config.max_fusion_size: the most nodes one fused kernel takes


def fusible(op: Op) -> bool:
    """Whether inductor may fuse ``op`` into a generated kernel: a memory-bound op that
    allocates (a view or ``getitem`` allocates nothing and costs nothing either way) and draws
    no random numbers. memfit compiles with inductor's ``fallback_random`` (a re-run replays the
    forward's draws from the generator: ``memfit.lowering.inductor``), so a random op (dropout,
    ``bernoulli``, ``rand``) runs eager's kernels, as a library call, as does an op on complex
    tensors (``Op.library_call``)."""
    return (bool(op.outputs) and op_class(op.kind) == MEMORY and op.kind not in RANDOM_DRAWS
            and not op.library_call)


def fused_kernels(graph: CostGraph) -> list[list[int]]:
    """The step's kernels as inductor fuses them: each a list of op indices in program order.
    Every op that allocates is in exactly one kernel; an op that allocates nothing is in none."""
    group_of: dict[int, int] = {}  # op index -> its group id
    members: dict[int, list[int]] = {}  # group id -> op indices
    open_groups: set[int] = set()
    producer_group: dict[str, int] = {}  # tensor -> the group that made it
    for index, op in enumerate(graph.ops):
        if not op.outputs:
            continue
        read = {producer_group[name] for name in op.inputs if name in producer_group}
        joinable = {group for group in read if group in open_groups
                    and graph.ops[members[group][0]].phase == op.phase}
        size = sum(len(members[group]) for group in joinable)
        if fusible(op) and joinable and size < MAX_GROUP_OPS:
            target = min(joinable)
            for group in sorted(joinable - {target}):
                for member in members.pop(group):
                    group_of[member] = target
                    members[target].append(member)
                open_groups.discard(group)
            members[target].sort()
            read -= joinable
        else:
            target = index
            members[target] = []
            if fusible(op):
                open_groups.add(target)
        members[target].append(index)
        group_of[index] = target
        open_groups -= read  # read from outside: those groups' kernels have run
        for name in op.outputs:
            producer_group[name] = target
    return sorted(members.values())


def kernel_time_s(graph: CostGraph, kernel: list[int], hardware: Hardware) -> float:
    """One kernel's time. A library call (an op inductor does not fuse): its eager time less
    the dispatcher's overhead plus a compiled kernel's. A generated kernel (a fused group, or
    one fusible op): the slower of the bytes it reads from outside the group and writes for
    readers outside it (or as step outputs) at the memory bandwidth, and its ops' per-element
    work (``Hardware.elements_time_s``, an eager kernel's several passes as one), or a
    softmax's kernel's (``SOFTMAX_KERNEL_KINDS``) at the profile's ``compiled_softmax`` rate per
    element of its exponentials where that is slower, plus one kernel overhead."""
    ops = [graph.ops[index] for index in kernel]
    if len(ops) == 1 and not fusible(ops[0]):
        return max(0.0, ops[0].time_s - hardware.op_overhead_s) + hardware.kernel_overhead_s
    names = {op.name for op in ops}
    made = {name for op in ops for name in op.outputs}
    read = {name for op in ops for name in op.inputs if name not in made}
    written = {name for name in made
               if graph.tensors[name].is_output
               or any(reader not in names for reader in graph.tensors[name].consumers)}
    moved = sum(graph.tensors[name].size_bytes for name in read | written)
    memory_s = moved / (hardware.memory_bytes_per_s * hardware.memory_efficiency)
    compute_s = sum(hardware.elements_time_s(op.kind, op.elements, fused=True) for op in ops)
    softmax_rate = hardware.element_rates.get(COMPILED_SOFTMAX)
    if softmax_rate and SOFTMAX_KERNEL_KINDS <= {op.kind for op in ops}:
        exponentials = max(op.elements for op in ops if op.kind == "aten.exp")
        compute_s = max(compute_s, exponentials / softmax_rate)
    return max(memory_s, compute_s) + hardware.kernel_overhead_s


def compiled_times(graph: CostGraph, hardware: Hardware) -> dict[str, float]:
    """Each allocating op's time as inductor runs the step: its kernel's time
    (``kernel_time_s``) spread over the kernel's ops in proportion to their eager times."""
    times: dict[str, float] = {}
    for kernel in fused_kernels(graph):
        total_s = kernel_time_s(graph, kernel, hardware)
        eager_s = [graph.ops[index].time_s for index in kernel]
        weight = sum(eager_s)
        for index, own_s in zip(kernel, eager_s, strict=True):
            share = own_s / weight if weight > 0 else 1 / len(kernel)
            times[graph.ops[index].name] = total_s * share
    return times


def priced_for(graph: CostGraph, hardware: Hardware, compiler: str) -> CostGraph:
    """``graph`` (priced op by op, as ``aot_eager`` runs it) with the times ``compiler``'s
    kernels take: itself for ``"aot_eager"``, ``compiled_times`` for ``"inductor"``, whose
    generated code makes views without a call (an op that allocates nothing costs nothing).

    Raises:
        ValueError: for another compiler.
    """
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}: use one of {COMPILERS}")
    if compiler == "aot_eager":
        return graph if graph.compiler == compiler else replace(graph, compiler=compiler)
    views = {op.name: 0.0 for op in graph.ops if not op.outputs}
    return replace(graph.with_times({**views, **compiled_times(graph, hardware)}),
                   compiler=compiler)


def kernel_count(graph: CostGraph, compiler: str) -> int:
    """How many kernels ``compiler`` runs for the step (ops that allocate, or fused groups)."""
    if compiler == "inductor":
        return len(fused_kernels(graph))
    return sum(1 for op in graph.ops if op.outputs)



def eager_times(graph: CostGraph, hardware: Hardware) -> dict[str, float]:
    """Each op's time as ``aot_eager`` runs it, from what the op records (FLOPs, bytes, dtype,
    kind, elements): its roofline (``Hardware.op_time_s``), or a view's dispatch
    (``Hardware.view_time_s``), plus, for either, the cost of running its dispatch from memory
    after the op before it streamed its bytes through the cache (``Hardware.overhead_after_s``;
    a ``getitem`` costs nothing)."""
    times: dict[str, float] = {}
    bytes_before = 0
    for op in graph.ops:
        own_s = (hardware.op_time_s(op.flops, op.bytes_accessed, op.dtype, op.kind, op.elements)
                 if op.outputs else hardware.view_time_s(op.kind))
        times[op.name] = own_s + hardware.overhead_after_s(bytes_before) if own_s > 0 else 0.0
        if op.outputs:
            bytes_before = op.bytes_accessed
    return times


def repriced(graph: CostGraph, hardware: Hardware, compiler: str) -> CostGraph:
    """``graph`` priced anew on ``hardware`` as ``analyze`` prices a captured step: op by op
    (``eager_times``), then as ``compiler`` runs it (``priced_for``): the same step on another
    profile without capturing it again."""
    return priced_for(graph.with_times(eager_times(graph, hardware)), hardware, compiler)
