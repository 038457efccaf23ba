"""The registry's parameter check in a fresh process, before any strategy module is loaded."""

import subprocess
import sys

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
