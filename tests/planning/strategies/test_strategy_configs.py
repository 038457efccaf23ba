"""Every registered strategy checks its parameters with a frozen config (``StrategyConfig``):
each refuses a bad parameter with the message the hand-written ``check_params`` it replaces
gave (swap's unknown-parameter message now reads as the others do), from the registry and from
``plan`` alike, and every config's defaults pass its own checks."""

import dataclasses

import pytest

from memfit.data.hardware import get_hardware
from memfit.model import synthetic
from memfit.planning.solvers.milp import NODE_LIMIT
from memfit.planning.strategies import (
    _CONFIGS,
    check_params,
    get_strategy,
    register,
    strategy_names,
)
from memfit.planning.strategies._strategy_config import StrategyConfig

HARDWARE = get_hardware("h100-pcie")
SWAP_UNKNOWN = ("strategy 'swap' got unknown parameters ['optimizer_scopes']; it accepts "
                "threshold=, n_tensors=, starting_scope=, starting_op_names=, incl_scopes=, "
                "excl_scopes=, incl_types=, excl_types=, lb=, ub=, ctrld_strategy=, fuse_swapins=, "
                "fuse_distance=, swap_branches= and branch_threshold=")
AUTO_UNKNOWN = ("strategy 'auto' got unknown parameters ['a', 'speed']; it takes none: name a "
                "strategy (swap, checkpoint, ...) to set its parameters")

CHECKPOINT_UNKNOWN = ("strategy 'checkpoint' got unknown parameters {}; it accepts checkpoints=, "
                      "max_chain= and forward_recompute=")
CHECKPOINTS_MODES = ("checkpoints must be 'memory', 'speed' or a non-empty list of module-path "
                     "globs or op names, got {}")
TIME_LIMIT = ("optimal-recompute no longer takes time_limit_s: a clock made the plan depend on "
              "the machine's load. Bound the MILP's work with node_limit= (branch-and-bound "
              f"nodes, default {NODE_LIMIT}) and its size with max_ops=, or use method='segments'")

REFUSED = [  # (strategy, params, the message)
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
    ("swap", {"optimizer_scopes": ["adam"]}, SWAP_UNKNOWN),
    ("swap", {"lb": 5, "ub": 3}, "swap: lb (5) must not exceed ub (3)"),
    ("swap", {"threshold": True}, "swap: threshold must be an int >= 0, got True"),
    ("swap", {"incl_scopes": 5}, "swap: incl_scopes must be a string or a list of strings, got 5"),
    ("keep", {"b": 1, "a": 2}, "strategy 'keep' takes no parameters, got ['a', 'b']"),
    ("auto", {"speed": True, "a": 1}, AUTO_UNKNOWN),
    *[(policy, {"attention": "flash"},
       f"{policy}: attention must be one of ['auto', 'math', 'fused'], got 'flash'")
      for policy in ("vdnn_all", "vdnn_conv", "vdnn_dyn")],
    *[(policy, {"lb": 3}, f"strategy {policy!r} got unknown parameters ['lb']; it accepts attention=")
      for policy in ("vdnn_all", "vdnn_conv", "vdnn_dyn")],
]


@pytest.mark.parametrize(("name", "params", "message"), REFUSED,
                         ids=[f"{name}-{sorted(params)}" for name, params, _ in REFUSED])
def test_a_bad_parameter_is_refused_from_the_registry_and_the_plan_alike(name, params, message):
    with pytest.raises(ValueError) as checked:
        check_params(name, params)
    assert str(checked.value) == message
    with pytest.raises(ValueError) as planned:
        get_strategy(name)(synthetic.chain(4), HARDWARE, 10**12, **params)
    assert str(planned.value) == message


@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_has_a_frozen_config_whose_defaults_pass(name):
    config = _CONFIGS[name]
    assert issubclass(config, StrategyConfig) and config.strategy == name
    built = config.from_params({})
    assert built == config()
    check_params(name, {}, config.compilers[0])
    for field in dataclasses.fields(config):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(built, field.name, getattr(built, field.name))


def test_the_plan_keeps_the_parameters_as_given():
    """A list of checkpoints stays the list the user gave: plans compare equal to their JSON."""
    graph = synthetic.chain(4)
    made = get_strategy("checkpoint")(graph, HARDWARE, checkpoints=["f1"], max_chain=2)
    assert made.params == {"checkpoints": ["f1"], "max_chain": 2, "forward_recompute": None}


def test_swap_reads_a_single_string_as_a_list_of_one():
    config = _CONFIGS["swap"].from_params({"incl_scopes": "h.1", "excl_types": ["mm", "bmm"]})
    assert config.incl_scopes == ("h.1",) and config.excl_types == ("mm", "bmm")


def test_a_name_that_differs_only_in_underscore_against_hyphen_is_refused():
    """Users may spell either, so ``vdnn-all`` beside ``vdnn_all`` would be one name twice."""
    with pytest.raises(ValueError, match="'vdnn-all' would shadow 'vdnn_all'"):
        register("vdnn-all", config=_CONFIGS["vdnn_all"])
    assert "vdnn-all" not in strategy_names()
