"""The planner's tuning constants: one frozen dataclass, the old module-level names its references."""

import dataclasses

import pytest

from memfit.planning.solvers import milp
from memfit.planning.strategies.recomputing import optimal_recompute
from memfit.planning.tuning import TUNING, Tuning


def test_old_names_read_the_one_place():
    assert milp.NODE_LIMIT == TUNING.milp_node_limit
    assert optimal_recompute.MILP_MAX_OPS == TUNING.milp_max_ops
    assert optimal_recompute.POOR_MAX_FORWARD_OPS == TUNING.memory_poor_max_forward_ops


def test_frozen_and_checked_when_built():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TUNING.milp_node_limit = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="chain_tighten_rounds"):
        Tuning(chain_tighten_rounds=0)
    with pytest.raises(ValueError, match="shares non-negative"):
        Tuning(auto_hybrid_shares=(1.0, -0.5))
    assert Tuning(segment_max_blocks=8).segment_max_blocks == 8
