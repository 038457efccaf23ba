"""The memory mode's branch and bound picks what pricing every count would, and its bounds bound."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.hardware import get_hardware
from memfit.model import separators, synthetic
from memfit.model.profile import BaseProfile
from memfit.planning.strategies.recomputing._separator_count_search import (
    CountBounds,
    least_recompute_fitting,
    lowest_peak,
)
from memfit.planning.strategies.recomputing.checkpoint import _separator_tensors, recompute_all_but

HARDWARE = get_hardware("h100-pcie")


def bounds_of(graph):
    points = separators.articulation_points(graph)
    candidates = [(p,) for p in points] or list(separators.separator_sets(graph))
    droppable = frozenset(recompute_all_but(graph, (), HARDWARE, None, {}).recomputed)
    held = [frozenset(_separator_tensors(graph, separator)) for separator in candidates]
    bounds = CountBounds(BaseProfile.of(graph), droppable, held)
    return bounds, range(1, len(candidates) + 1)


def priced_all(bounds, counts):
    return {count: bounds.priced(bounds.recomputed(count)) for count in counts}


GRAPHS = [synthetic.chain(40), synthetic.resnet_like(12), synthetic.multi_tower(3, 8)]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.name)
def test_bounds_are_lower_bounds(graph):
    bounds, counts = bounds_of(graph)
    for count, profile in priced_all(bounds, counts).items():
        assert bounds.time_s(count) <= profile.recompute_s * (1 + 1e-9)
        assert bounds.peak_bytes(count) <= profile.peak_bytes


@settings(max_examples=25, deadline=None)
@given(graph=st.sampled_from(GRAPHS) | st.builds(synthetic.random_dag, st.integers(8, 40),
                                                 st.integers(0, 1000)),
       fraction=st.floats(0.2, 1.0))
def test_same_count_as_pricing_every_count(graph, fraction):
    bounds, counts = bounds_of(graph)
    if not counts:
        return
    priced = priced_all(bounds, counts)
    budget = int(fraction * max(p.peak_bytes for p in priced.values()))
    fitting = [(p.recompute_s, c) for c, p in priced.items() if p.peak_bytes <= budget]
    assert least_recompute_fitting(bounds, counts, budget) == (min(fitting)[1] if fitting else None)
    assert lowest_peak(bounds, counts) == min(
        (p.peak_bytes, p.recompute_s, c) for c, p in priced.items())[2]
