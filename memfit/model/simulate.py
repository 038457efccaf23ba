"""Predict a step's timeline under a plan: four streams on a fake clock, memory from liveness.

``simulate`` replays ``lower(graph, plan).actions``, the same program the rewriter emits, so what
is predicted and what is run cannot drift apart. Compute actions run back to back on the compute
stream; a swap-out runs on the device-to-host stream once its producer has finished; a swap-in runs
on the host-to-device stream once its control op and its tensor's swap-out have finished; a wait
holds the compute stream until its swap-in has landed, and that stall is the exposed transfer time.
Collectives (``comm.*`` ops of a sharded graph, ``memfit.model.sharding``) run on a
communication stream of their own once issued, and a ``comm.wait`` op holds the compute stream
until its collective has landed; copies never queue behind them.

Note:
    Memory is not simulated in time: it is ``memory_profile`` of the same schedule (program-order
    liveness, which is what ``torch.cuda.max_memory_allocated`` reports; see ``schedule.py``).
    The whole simulation is one pass over the actions with plain floats and dicts, because the
    auto-tuners call it hundreds of times per plan search.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Interval, Stream, Timeline
from memfit.model.host_memory import host_peak_bytes
from memfit.model.plan_memo import remembered_timeline
from memfit.model.schedule import Action, lower, memory_profile
from memfit.model.sharding import COLLECTIVE_KINDS, WAIT


def simulate(
    graph: CostGraph, plan: Plan, hardware: Hardware, record_intervals: bool = True
) -> Timeline:
    """The predicted timeline of one step of ``graph`` run under ``plan`` on ``hardware``
    (computed once per plan inside ``memfit.model.plan_memo.plans_remembered``).

    Args:
        graph: the step, with ``Op.time_s`` filled in (estimated or measured).
        plan: the decisions to simulate; ``Plan("keep")`` gives the unmodified step.
        hardware: copy bandwidths and latency, whether the two copy directions overlap
            (``duplex``) and whether copies overlap compute at all (``async_copies``).
        record_intervals: build one ``Interval`` and one memory label per action (default).
            ``False`` leaves ``intervals`` and ``memory_labels`` empty (``memory_bytes`` is kept)
            and only computes the figures, which is markedly faster, for tuners that simulate many
            plans.

    Returns:
        A ``Timeline`` with ``source="simulated"``: the step time (the latest end on any stream),
        the exposed transfer time, the live bytes while each action runs, the host peak (what
        the swaps hold on the host at once; ``host_memory``), and the intervals: one
        per compute, swap-out and swap-in action (kind = the action's kind), plus a ``"wait"``
        interval on the compute stream for each wait that stalls it (one that does not takes no
        time and has none).

    Raises:
        PlanError: if the plan does not fit the graph (see ``schedule.check_plan``).

    Example:
        >>> from memfit.model import synthetic
        >>> from memfit.data.hardware import get_hardware
        >>> timeline = simulate(synthetic.chain(4), Plan("keep"), get_hardware("h100-pcie"))
        >>> timeline.exposed_transfer_s
        0.0
    """
    return remembered_timeline(graph, plan, hardware, record_intervals,
                               lambda: _simulated(graph, plan, hardware, record_intervals))


def _simulated(graph: CostGraph, plan: Plan, hardware: Hardware, record_intervals: bool
               ) -> Timeline:
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    actions = schedule.actions
    labels = tuple(action.label for action in actions) if record_intervals else None
    intervals: list[Interval] = []
    time_s = graph.remembered("op times", lambda: {op.name: op.time_s for op in graph.ops})
    run = _run_async if hardware.async_copies else _run_sync
    communication = _communication(graph)
    step_time_s, exposed_s, recompute_s = run(
        actions, time_s, schedule.buffer_bytes, hardware, labels, intervals, communication
    )
    peak_index = profile.peak_index
    return Timeline(
        source="simulated",
        peak_bytes=profile.peak_bytes,
        step_time_s=step_time_s,
        exposed_transfer_s=exposed_s,
        recompute_s=recompute_s,
        intervals=tuple(intervals),
        memory_labels=labels or (),
        memory_bytes=profile.high_bytes,
        peak_label=actions[peak_index].label if peak_index >= 0 else "",
        host_peak_bytes=host_peak_bytes(graph, plan),
        meta={"graph": graph.name, "strategy": plan.strategy, "hardware": hardware.name},
    )


COMM = ""  # in ``_communication``: the op is a collective (else: the collective it waits for)


def _communication(graph: CostGraph) -> Mapping[str, str]:
    """Op -> ``COMM`` for a collective, or the collective a ``comm.wait`` op waits for; empty
    for a graph without collectives (every unsharded one)."""
    def find() -> dict[str, str]:
        found = {op.name: COMM for op in graph.ops if op.kind in COLLECTIVE_KINDS}
        found.update({op.name: op.depends_on[0] for op in graph.ops if op.kind == WAIT})
        return found

    return graph.remembered("communication", find)


def _run_async(
    actions: Sequence[Action],
    time_s: Mapping[str, float],
    size_bytes: Mapping[str, int],
    hardware: Hardware,
    labels: Sequence[str] | None,
    intervals: list[Interval],
    communication: Mapping[str, str],
) -> tuple[float, float, float]:
    """Time the actions on four streams; returns (step time, compute time lost to waits for
    copies, recompute time).

    Note:
        Each copy stream is a FIFO in program order, as a CUDA stream is. Without ``duplex`` both
        directions share one queue, so ``d2h_free`` and ``h2d_free`` move together. A collective
        starts once the compute stream has reached it (what it reduces is made by then) and the
        communication stream is free; a wait for it stalls compute, and that stall is not a copy's.
    """
    compute_free = d2h_free = h2d_free = comm_free = exposed_s = recompute_s = 0.0
    comm_end: dict[str, float] = {}
    compute_end: dict[str, float] = {}
    swap_out_end: dict[str, float] = {}
    swap_in_end: dict[tuple[str, int], float] = {}
    duplex = hardware.duplex
    for index, action in enumerate(actions):
        kind = action.kind
        stream: Stream
        waits_for = communication.get(action.op) if communication else None
        if waits_for == COMM and kind == "compute":  # a collective, on its own stream
            start = max(compute_free, comm_free)
            compute_end[action.op] = compute_free
            comm_free = comm_end[action.op] = end = start + time_s[action.op]
            stream = "comm"
        elif waits_for and kind == "compute":  # the compute stream waits for a collective
            start, end = compute_free, comm_end[waits_for]
            compute_end[action.op] = compute_free = max(start, end)
            if end <= start:
                continue
            stream, kind = "compute", "wait"
        elif kind == "compute":
            start = compute_free
            compute_free = compute_end[action.op] = end = start + time_s[action.op]
            stream = "compute"
        elif kind == "recompute":  # a forward op re-run in the backward pass
            start = compute_free
            compute_free = end = start + time_s[action.op]
            recompute_s += end - start
            stream = "compute"
        elif kind == "swap_out":
            start = max(compute_end[action.op], d2h_free)
            end = start + hardware.d2h_time_s(size_bytes[action.tensor])
            swap_out_end[action.tensor] = d2h_free = end
            h2d_free = h2d_free if duplex else end
            stream = "d2h"
        elif kind == "swap_in":
            start = max(compute_end[action.op], swap_out_end[action.tensor], h2d_free)
            end = start + hardware.h2d_time_s(size_bytes[action.tensor])
            swap_in_end[(action.tensor, action.copy)] = h2d_free = end
            d2h_free = d2h_free if duplex else end
            stream = "h2d"
        else:  # wait: the compute stream stalls until the copy has landed
            start, end = compute_free, swap_in_end[(action.tensor, action.copy)]
            if end <= start:
                continue
            exposed_s += end - start
            compute_free = end
            stream = "compute"
        if labels is not None:
            intervals.append(Interval(stream, labels[index], start, end, kind))
    return max(compute_free, d2h_free, h2d_free, comm_free), exposed_s, recompute_s


def _run_sync(
    actions: Sequence[Action],
    time_s: Mapping[str, float],
    size_bytes: Mapping[str, int],
    hardware: Hardware,
    labels: Sequence[str] | None,
    intervals: list[Interval],
    communication: Mapping[str, str],
) -> tuple[float, float, float]:
    """Time the actions one after another on one thread; every copy is exposed.

    Note:
        This is the CPU executor: a "copy" is a memcpy on the compute thread, so it serializes
        with compute. Its intervals keep the stream names ``"d2h"``/``"h2d"`` so renderers still
        show where the copies went. A wait has nothing to wait for and takes no time.
    """
    clock = exposed_s = recompute_s = 0.0
    for index, action in enumerate(actions):
        kind = action.kind
        stream: Stream
        if kind == "compute":
            collective = communication.get(action.op) == COMM if communication else False
            duration, stream = time_s[action.op], "comm" if collective else "compute"
        elif kind == "recompute":
            duration, stream = time_s[action.op], "compute"
            recompute_s += duration
        elif kind == "swap_out":
            duration, stream = hardware.d2h_time_s(size_bytes[action.tensor]), "d2h"
            exposed_s += duration
        elif kind == "swap_in":
            duration, stream = hardware.h2d_time_s(size_bytes[action.tensor]), "h2d"
            exposed_s += duration
        else:
            continue
        if labels is not None:
            intervals.append(Interval(stream, labels[index], clock, clock + duration, kind))
        clock += duration
    return clock, exposed_s, recompute_s
