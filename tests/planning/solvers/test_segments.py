"""The separator-block DP: blocks cut the forward pass; its plans fit exactly; the MILP bounds it."""

import networkx as nx
import numpy as np
import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Recompute
from memfit.model import separators, synthetic
from memfit.model.profile import BaseProfile
from memfit.model.simulate import simulate
from memfit.planning.solvers.milp import solve_milp
from memfit.planning.solvers.segments import find_blocks, segment_table, solve_segments

HARDWARE = get_hardware("h100-pcie")
GRAPHS = {
    "chain": lambda: synthetic.chain(12),
    "resnet_like": lambda: synthetic.resnet_like(4),
    "towers": lambda: synthetic.multi_tower(2, 6),
}


def table_for(graph):
    blocks = find_blocks(graph)
    return blocks, segment_table(graph, blocks, cheap_kept=())


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_blocks_are_nested_cuts_covering_the_forward_pass(name):
    graph = GRAPHS[name]()
    blocks = find_blocks(graph)
    assert blocks.count == len(blocks.separators) + 1 >= 3
    droppable = [t for block in blocks.droppable for t in block]
    closing = [t for block in blocks.closing for t in block]
    assert len(set(droppable)) == len(droppable) and not set(droppable) & set(closing)
    allocating = {t for op in graph.forward_ops for t in op.outputs if not graph.tensors[t].is_output}
    assert set(droppable) | set(closing) == allocating
    forward = list(blocks.owner[: len(graph.forward_ops)])
    if name != "towers":  # a trace runs one tower after the other, across the cuts
        assert forward == sorted(forward)  # forward positions go block by block


def test_two_towers_are_cut_by_pairs():
    blocks = find_blocks(synthetic.multi_tower(2, 6))
    assert any(len(separator) == 2 for separator in blocks.separators)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_plans_fit_exactly_and_never_beat_the_milp(name):
    graph = GRAPHS[name]()
    blocks, table = table_for(graph)
    keep_bytes = int(BaseProfile.of(graph).high_bytes.max())
    for fraction in (0.9, 0.8, 0.7):
        budget = int(fraction * keep_bytes)
        chosen = solve_segments(table, blocks.count, budget)
        assert chosen is not None, fraction
        assert [s.first for s in chosen] == [0, *(s.last + 1 for s in chosen[:-1])]
        assert chosen[-1].last == blocks.count - 1
        recomputed = frozenset().union(*(s.recomputed for s in chosen))
        plan = Plan("t", {t: Recompute() for t in recomputed})
        timeline = simulate(graph, plan, HARDWARE, record_intervals=False)
        assert timeline.peak_bytes <= budget
        assert timeline.recompute_s == pytest.approx(sum(s.recompute_s for s in chosen))
        optimum = solve_milp(graph, budget)
        assert timeline.recompute_s >= optimum.recompute_time_s - 1e-12


def test_equals_the_milp_on_a_chain():
    """On a chain, recomputing each segment once is optimal down to about 0.6 of the peak."""
    graph = synthetic.chain(12)
    blocks, table = table_for(graph)
    keep_bytes = int(BaseProfile.of(graph).high_bytes.max())
    for fraction in (0.9, 0.8, 0.7, 0.6):
        budget = int(fraction * keep_bytes)
        chosen = solve_segments(table, blocks.count, budget)
        assert sum(s.recompute_s for s in chosen) == pytest.approx(
            solve_milp(graph, budget).recompute_time_s)


def test_no_plan_below_the_smallest_segment_need():
    graph = synthetic.chain(12)
    blocks, table = table_for(graph)
    assert solve_segments(table, blocks.count, graph.resident_bytes) is None


def test_merging_blocks_bounds_the_count():
    graph = synthetic.chain(40)
    assert find_blocks(graph).count > 12
    merged = find_blocks(graph, max_blocks=12)
    assert merged.count == 12
    assert set().union(*merged.droppable, *merged.closing) == set().union(
        *find_blocks(graph).droppable, *find_blocks(graph).closing)


def test_separators_are_graph_separators():
    graph = synthetic.resnet_like(4)
    for separator in find_blocks(graph).separators:
        rest = separators.separation_graph(graph).subgraph(
            set(separators.separation_graph(graph)) - set(separator))
        assert not nx.has_path(rest, separators.INPUT, separators.LOSS)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_segments_priced_incrementally_as_the_whole_graph_profile_prices_them(name):
    graph = GRAPHS[name]()
    blocks, table = table_for(graph)
    model = BaseProfile.of(graph)
    for segment in table:
        high = model.folded(model.recomputes(segment.recomputed)).high_bytes
        own = (blocks.owner >= segment.first) & (blocks.owner <= segment.last)
        later = blocks.owner > segment.last
        change = high - model.high_bytes
        assert segment.own_positions.tolist() == np.nonzero(own)[0].tolist()
        assert segment.own_delta.tolist() == change[own].tolist()
        assert segment.need_bytes == int(high[own].max(initial=0))
        assert segment.carried_bytes == (int(change[later].max()) if later.any() else 0)
