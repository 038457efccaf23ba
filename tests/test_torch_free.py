"""The torch-free layers (data, model, planning, render: the types, the simulator, strategies
and solvers, text and plots) import with torch blocked."""

import subprocess
import sys

BLOCK_TORCH = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _Blocker())
import importlib, pkgutil
import memfit.data, memfit.model, memfit.planning, memfit.render
for package in (memfit.data, memfit.model, memfit.planning, memfit.render):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
from memfit.planning.strategies import strategy_names
print(",".join(strategy_names()))
assert "torch" not in sys.modules
"""


def test_torch_free_layers_import_without_torch():
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "keep" in result.stdout.strip().split(",")
