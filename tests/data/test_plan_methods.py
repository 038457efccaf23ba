"""Plan's methods are its own: they work with only ``memfit.data.plan`` imported, in a fresh
process, and nothing above the data layer is loaded for them (no module attaches them to the
class at run time)."""

import subprocess
import sys

FRESH_PROCESS = """
import sys
from memfit.data.plan import Keep, Plan, Recompute
plan = Plan("keep", {"a": Keep("x"), "b": Recompute()}, graph_hash="0123")
path = sys.argv[1]
plan.save(path)
loaded = Plan.load(path)
assert loaded == plan and Plan.from_json(plan.to_json()) == plan
assert "explain" in dir(plan) and Plan.load.__doc__ and Plan.explain.__doc__
assert "keep" in plan.explain()
above = sorted(m for m in sys.modules if m.startswith("memfit.") and not m.startswith("memfit.data"))
assert not above, above  # the methods need no layer above the data
print("ok")
"""


def test_plan_methods_work_with_only_the_data_module_imported(tmp_path):
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "p.json")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
