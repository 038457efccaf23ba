"""Work an ``auto`` planning call repeats no more than it must: the graph-wide tables re-run
pricing reads are built once per graph, the cyclic collector stays paused for the whole call,
and what the faster loops return is what the plain definitions give."""

from __future__ import annotations

import gc
import random
from collections import Counter

import memfit.model.recompute as recompute_module
import memfit.planning.step as plan_step_module
from memfit.data.hardware import get_hardware
from memfit.data.units import Budget
from memfit.model import synthetic
from memfit.model.recompute import decided_reruns, first_late_readers, rerun_deadlines
from memfit.planning.solvers.segments import find_blocks, segment_table
from memfit.planning.step import plan_step
from memfit.planning.strategies.recomputing.checkpoint import _speed_checkpoints


def _forward_sets(graph, count: int, seed: int = 0) -> list[set[str]]:
    """``count`` random sets of forward tensors (what a planner may recompute)."""
    forward = sorted(t for op in graph.forward_ops for t in op.outputs
                     if not graph.tensors[t].is_output)
    chosen = random.Random(seed)
    return [set(chosen.sample(forward, chosen.randint(1, len(forward)))) for _ in range(count)]


def _deadlines_by_definition(graph, recomputed: set[str]) -> dict[str, int]:
    """Each recomputed tensor's producer -> the first late reader of its recomputed outputs or
    the earliest deadline of a re-run reading them: the fixed point, found by iterating."""
    late, end = first_late_readers(graph), len(graph.ops)
    producers = {graph.tensors[t].producer for t in recomputed}
    deadline: dict[str, int] = {}
    while True:
        found = {}
        for producer in producers:
            outputs = [t for t in graph.op(producer).outputs if t in recomputed]
            times = [late.get(t, end) for t in outputs] + [
                deadline.get(c, end) for t in outputs for c in graph.tensors[t].consumers]
            if min(times, default=end) < end:
                found[producer] = min(times)
        if found == deadline:
            return deadline
        deadline = found


def test_rerun_deadlines_and_reruns_are_the_definitions_in_program_order():
    graph = synthetic.random_dag(60, seed=3)
    for recomputed in _forward_sets(graph, 20):
        deadline = rerun_deadlines(graph, recomputed)
        assert deadline == _deadlines_by_definition(graph, recomputed)
        positions = [graph.index[p] for p in deadline]
        assert positions == sorted(positions, reverse=True)  # reverse program order
        reruns = decided_reruns(graph, recomputed)
        assert [r.op for r in reruns] == sorted(deadline, key=graph.index.__getitem__)
        for rerun in reruns:
            assert graph.index[rerun.before] == deadline[rerun.op]
            assert rerun.replaces == recomputed & set(graph.op(rerun.op).outputs)


def test_a_segment_touches_what_it_recomputes_and_what_their_producers_read():
    graph = synthetic.resnet_like(6)
    blocks = find_blocks(graph)
    table = segment_table(graph, blocks, _speed_checkpoints(graph, 4))
    assert any(segment.recomputed for segment in table)
    for segment in table:
        read = {t for name in segment.recomputed if (p := graph.tensors[name].producer)
                for t in graph.op(p).inputs}
        assert segment.touched == segment.recomputed | read


def test_auto_with_what_ifs_finds_late_readers_once_and_never_collects(monkeypatch):
    graph, hardware = synthetic.resnet_like(6), get_hardware("h100-pcie")
    found: Counter = Counter()
    collector_on: list[bool] = []
    late_readers, explain = recompute_module.first_late_readers, plan_step_module.explain

    def counted(of_graph):
        found[of_graph.name] += 1
        return late_readers(of_graph)

    def explained(*args, **kwargs):
        collector_on.append(gc.isenabled())
        made = explain(*args, **kwargs)
        collector_on.append(gc.isenabled())
        return made

    monkeypatch.setattr(recompute_module, "first_late_readers", counted)
    monkeypatch.setattr(plan_step_module, "explain", explained)
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        planned = plan_step(graph, hardware, Budget(fraction=0.5), "auto", {}, 1 << 20,
                            what_ifs=True)
        assert gc.isenabled()  # on again once the call ends
    finally:
        if not was_enabled:
            gc.disable()
    assert len(planned.plan.explanation.what_if) == 2
    assert found == {graph.name: 1}  # three auto searches, every re-run priced on one table
    assert collector_on == [False, False]  # between the strategies too
