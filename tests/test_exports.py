"""``memfit``'s public names: the errors a user catches are exported beside the plan types, the
README's ``memfit.X`` names all resolve, and the lazy exports import no torch."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import memfit
from memfit.data import errors
from memfit.data.errors import BudgetWarning
from memfit.data.plan_json import PlanFileError

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("error", [errors.BudgetError, errors.CaptureError, errors.PlanError,
                                   PlanFileError, BudgetWarning])
def test_every_error_and_warning_raised_to_users_is_exported(error):
    """``Plan.load`` raises ``PlanFileError``, planning ``BudgetError``, a mismatched plan
    ``PlanError``: each catchable as ``memfit.<name>``."""
    assert getattr(memfit, error.__name__) is error and error.__name__ in memfit.__all__


def test_every_name_the_readme_uses_resolves():
    """A ``memfit.X`` in the README or the docs is an export or a module (old module paths
    included)."""
    pages = [README, *sorted((README.parent / "docs").glob("*.md"))]
    used = sorted({name for page in pages
                   for name in re.findall(r"\bmemfit\.([A-Za-z_]+)", page.read_text())})
    assert "Plan" in used and "BudgetError" in used
    missing = [name for name in used
               if name not in memfit.__all__ and importlib.util.find_spec(f"memfit.{name}") is None]
    assert missing == []


TORCH_FREE = """
import sys
import memfit
for name in ("Plan", "Keep", "Swap", "SwapIn", "Recompute", "Rerun", "Decision", "Explanation",
             "BudgetError", "CaptureError", "PlanError", "PlanFileError", "strategy_names"):
    getattr(memfit, name)
print("torch" in sys.modules)
"""


def test_the_plan_types_and_errors_import_without_torch():
    result = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
