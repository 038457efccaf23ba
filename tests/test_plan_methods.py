"""Plan's methods that live in ``memfit.plan_methods`` are there whichever module comes first."""

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
assert "memfit.render.explain" not in sys.modules  # rendering is imported when asked for
print("ok")
"""


def test_plan_methods_work_with_only_the_data_module_imported(tmp_path):
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "p.json")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
