"""The registry: its parameter check in a fresh process, before any strategy module is loaded;
strategy names read with ``_`` and ``-`` alike."""

import json
import subprocess
import sys

import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.data.units import parse_budget
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.planning.strategies import (
    canonical_name,
    check_params,
    get_strategy,
    resolve_budget_and_strategy,
    strategy_names,
)

FIRST_CHECK = """
import memfit
from memfit.planning.strategies import check_params, resolve_budget_and_strategy
check_params("vdnn_conv", {"attention": "math"})
print(resolve_budget_and_strategy("0.5", "checkpoint", {"max_chain": 2}))
"""


def test_the_first_check_loads_the_strategies_it_looks_up():
    """On main the check was looked up before the strategies were loaded: vdnn's own
    ``check_params(strategy, **params)`` answered for ``vdnn_conv`` and raised a TypeError."""
    result = subprocess.run([sys.executable, "-c", FIRST_CHECK], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(Budget(bytes=None, fraction=0.5), 'checkpoint')"


# ---- names: '_' and '-' alike on input, the registered spelling on output ------------------------


@pytest.mark.parametrize(("spelled", "registered"), [
    ("vdnn-all", "vdnn_all"), ("optimal_recompute", "optimal-recompute"),
    ("memory_poor", "memory-poor"), ("vdnn-dyn", "vdnn_dyn")])
def test_either_spelling_plans_what_the_registered_name_plans(spelled, registered):
    """The same plan, byte for byte in its JSON, whose ``strategy`` is the registered name."""
    graph, hardware = synthetic.chain(8), get_hardware("h100-pcie")
    budget_bytes = int(0.6 * simulate(graph, Plan("keep"), hardware).peak_bytes)
    assert canonical_name(spelled) == registered
    check_params(spelled, {})
    made = get_strategy(spelled)(graph, hardware, budget_bytes)
    expected = get_strategy(registered)(graph, hardware, budget_bytes)
    assert made.strategy == registered
    assert json.dumps(made.to_json()) == json.dumps(expected.to_json())
    assert resolve_budget_and_strategy("0.5", spelled, {}) == (parse_budget("0.5"), registered)


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError) as refused:
        get_strategy("vdnn-al")
    assert str(refused.value) == (f"unknown strategy 'vdnn-al': use one of "
                                  f"{sorted(strategy_names())} ('_' and '-' alike)")
    for name in ("vdnn_all", "optimal-recompute", "keep"):
        assert repr(name) in str(refused.value)
    with pytest.raises(ValueError, match="unknown strategy 'magic'"):
        check_params("magic", {})
