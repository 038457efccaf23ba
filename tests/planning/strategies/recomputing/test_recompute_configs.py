"""The recomputing strategies' parameters as frozen configs: the same checks and messages as the
hand-written ``check_params`` they replace, from the registry and from ``plan`` alike."""

import dataclasses

import pytest

from memfit.data.hardware import get_hardware
from memfit.model import synthetic
from memfit.planning.solvers.milp import NODE_LIMIT
from memfit.planning.strategies import check_params, get_strategy
from memfit.planning.strategies.recomputing.checkpoint import CheckpointConfig
from memfit.planning.strategies.recomputing.memory_poor import MemoryPoorConfig
from memfit.planning.strategies.recomputing.optimal_recompute import OptimalRecomputeConfig

HARDWARE = get_hardware("h100-pcie")
CHECKPOINT_UNKNOWN = ("strategy 'checkpoint' got unknown parameters {}; it accepts checkpoints=, "
                      "max_chain= and forward_recompute=")
CHECKPOINTS_MODES = ("checkpoints must be 'memory', 'speed' or a non-empty list of module-path "
                     "globs or op names, got {}")
TIME_LIMIT = ("optimal-recompute no longer takes time_limit_s: a clock made the plan depend on "
              "the machine's load. Bound the MILP's work with node_limit= (branch-and-bound "
              f"nodes, default {NODE_LIMIT}) and its size with max_ops=, or use method='segments'")

REFUSED = [  # (strategy, params, the message the hand-written check_params gave)
    ("checkpoint", {"bogus": 1}, CHECKPOINT_UNKNOWN.format(["bogus"])),
    ("checkpoint", {"config": 1}, CHECKPOINT_UNKNOWN.format(["config"])),
    ("checkpoint", {"forward_recompute": "yes"},
     "forward_recompute must be True, False or None (automatic), got 'yes'"),
    ("checkpoint", {"max_chain": 0}, "max_chain must be a positive int, got 0"),
    ("checkpoint", {"max_chain": True}, "max_chain must be a positive int, got True"),
    ("checkpoint", {"checkpoints": "fast"}, CHECKPOINTS_MODES.format("'fast'")),
    ("checkpoint", {"checkpoints": []}, CHECKPOINTS_MODES.format("[]")),
    ("checkpoint", {"checkpoints": ["a", 1]}, CHECKPOINTS_MODES.format("['a', 1]")),
    ("optimal-recompute", {"time_limit_s": 2.0, "zz": 1}, TIME_LIMIT),
    ("optimal-recompute", {"zz": 1}, "strategy 'optimal-recompute' got unknown parameters "
                                     "['zz']; it accepts method=, max_ops= and node_limit="),
    ("optimal-recompute", {"method": "dp"},
     "method must be one of ('auto', 'milp', 'segments'), got 'dp'"),
    ("optimal-recompute", {"max_ops": 0}, "max_ops must be a positive int, got 0"),
    ("optimal-recompute", {"node_limit": False},
     "node_limit must be a positive int (branch-and-bound nodes), got False"),
    ("memory-poor", {"b": 2, "a": 1}, "strategy 'memory-poor' takes no parameters, got ['a', 'b']"),
]


@pytest.mark.parametrize(("name", "params", "message"), REFUSED,
                         ids=[f"{name}-{sorted(params)}" for name, params, _ in REFUSED])
def test_a_bad_parameter_is_refused_with_the_message_it_had(name, params, message):
    with pytest.raises(ValueError) as checked:
        check_params(name, params)
    assert str(checked.value) == message
    with pytest.raises(ValueError) as planned:
        get_strategy(name)(synthetic.chain(4), HARDWARE, 10**12, **params)
    assert str(planned.value) == message


@pytest.mark.parametrize("config", [CheckpointConfig, OptimalRecomputeConfig, MemoryPoorConfig])
def test_a_config_is_frozen_and_its_defaults_pass_its_checks(config):
    built = config.from_params({})
    assert built == config()
    for field in dataclasses.fields(config):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(built, field.name, getattr(built, field.name))


def test_the_plan_keeps_the_parameters_as_given():
    """A list of checkpoints stays the list the user gave: plans compare equal to their JSON."""
    graph = synthetic.chain(4)
    made = get_strategy("checkpoint")(graph, HARDWARE, checkpoints=["f1"], max_chain=2)
    assert made.params == {"checkpoints": ["f1"], "max_chain": 2, "forward_recompute": None}
