"""The module paths from before the layer folders still import (``memfit.moved``), as the same
module objects, with a warning that names the new path."""

import contextlib
import importlib
import subprocess
import sys

import pytest

from memfit import moved

OLD_PATHS = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import memfit.solvers.milp_swap
    from memfit.core import plan
import memfit
import memfit.planning.solvers.milp_swap
assert memfit.solvers.milp_swap is memfit.planning.solvers.milp_swap
assert plan is memfit.data.plan and plan.__spec__.name == "memfit.data.plan"
print(sorted(str(warning.message) for warning in caught))
"""


def test_an_old_path_is_the_module_at_its_new_one_and_warns():
    result = subprocess.run([sys.executable, "-c", OLD_PATHS], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted([
        "memfit.core.plan is now memfit.data.plan",
        "memfit.solvers is now memfit.planning.solvers",
        "memfit.solvers.milp_swap is now memfit.planning.solvers.milp_swap"]))


GROUPED_PATHS = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import memfit.planning.strategies.swap
    import memfit.strategies.optimal_recompute
import memfit.planning.strategies.recomputing.optimal_recompute
import memfit.planning.strategies.swapping.tflms as tflms
assert memfit.planning.strategies.swap is tflms
assert tflms.__spec__.name == "memfit.planning.strategies.swapping.tflms"
assert (memfit.strategies.optimal_recompute
        is memfit.planning.strategies.recomputing.optimal_recompute)
print(sorted(str(warning.message) for warning in caught))
"""


def test_a_strategy_grouped_by_technique_imports_from_both_old_paths_and_warns():
    """The TFLMS module was ``strategies.swap`` before and after the layer folders; the package
    ``swapping/`` holds it as ``tflms``, so ``strategies.swap`` stays free for the alias."""
    result = subprocess.run([sys.executable, "-c", GROUPED_PATHS], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted([
        "memfit.planning.strategies.swap is now memfit.planning.strategies.swapping.tflms",
        "memfit.strategies is now memfit.planning.strategies",
        "memfit.strategies.optimal_recompute is now "
        "memfit.planning.strategies.recomputing.optimal_recompute"]))


def test_grouping_by_technique_keeps_every_strategy_name():
    """The names the registry held before the strategies were grouped: plans and commands name
    them."""
    from memfit.planning.strategies import strategy_names

    assert strategy_names() == ("auto", "checkpoint", "keep", "memory-poor", "optimal-recompute",
                                "swap", "vdnn_all", "vdnn_conv", "vdnn_dyn")


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_every_moved_module_imports_from_its_old_path(old):
    with pytest.warns(DeprecationWarning) if old not in sys.modules else (
            contextlib.nullcontext()):
        module = importlib.import_module(old)
    assert module is importlib.import_module(moved.MOVED[old])


def test_memfit_backend_stays_the_function_once_its_module_is_imported():
    """On main before the move, importing ``memfit.backend`` (``memfit.fit`` does) replaced the
    function ``memfit.backend`` with the module; from ``memfit/compiler/`` it cannot."""
    import memfit
    import memfit.compiler.backend

    assert callable(memfit.backend) and memfit.backend.__name__ == "backend"

