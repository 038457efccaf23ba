"""Module paths from before issue 15's layer folders, still importable.

``memfit.solvers.milp_swap`` is now ``memfit.planning.solvers.milp_swap``, ``memfit.core.plan``
``memfit.data.plan``: ``install`` (run by ``memfit/__init__.py``) puts a finder first on
``sys.meta_path`` that answers an old path with the module at its new one (the same module
object, so ``isinstance`` and module state agree) and warns with a ``DeprecationWarning``. Old
paths that are public names today are left out: ``memfit.backend`` is the function, and
``memfit.planning`` the new folder. Written by the script that moved the files.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {  # old module -> new module
    'memfit.batches': 'memfit.planning.batches',
    'memfit.closed_loop': 'memfit.compiler.closed_loop',
    'memfit.core.costgraph': 'memfit.data.costgraph',
    'memfit.core.errors': 'memfit.data.errors',
    'memfit.core.explain': 'memfit.model.explain',
    'memfit.core.files': 'memfit.data.files',
    'memfit.core.graphs': 'memfit.model.separators',
    'memfit.core.hardware': 'memfit.data.hardware',
    'memfit.core.hardware_json': 'memfit.data.hardware_json',
    'memfit.core.host_memory': 'memfit.model.host_memory',
    'memfit.core.lifetimes': 'memfit.model.lifetimes',
    'memfit.core.linearize': 'memfit.model.linearize',
    'memfit.core.op_classes': 'memfit.data.op_classes',
    'memfit.core.plan': 'memfit.data.plan',
    'memfit.core.plan_json': 'memfit.data.plan_json',
    'memfit.core.recompute': 'memfit.model.recompute',
    'memfit.core.schedule': 'memfit.model.schedule',
    'memfit.core.sharding': 'memfit.model.sharding',
    'memfit.core.simulate': 'memfit.model.simulate',
    'memfit.core.synthetic': 'memfit.model.synthetic',
    'memfit.core.timeline': 'memfit.data.timeline',
    'memfit.core.units': 'memfit.data.units',
    'memfit.fitted': 'memfit.compiler.fitted',
    'memfit.graph_breaks': 'memfit.compiler.graph_breaks',
    'memfit.planning.strategies._forward_recompute': 'memfit.planning.strategies.recomputing._forward_recompute',
    'memfit.planning.strategies._free_swaps': 'memfit.planning.strategies.swapping._free_swaps',
    'memfit.planning.strategies._just_in_time_swap': 'memfit.planning.strategies.swapping._just_in_time_swap',
    'memfit.planning.strategies._separator_count_search': 'memfit.planning.strategies.recomputing._separator_count_search',
    'memfit.planning.strategies._swap_config': 'memfit.planning.strategies.swapping._swap_config',
    'memfit.planning.strategies._swap_control': 'memfit.planning.strategies.swapping._swap_control',
    'memfit.planning.strategies._swap_tune': 'memfit.planning.strategies.swapping._swap_tune',
    'memfit.planning.strategies._vdnn_layers': 'memfit.planning.strategies.swapping._vdnn_layers',
    'memfit.planning.strategies.checkpoint': 'memfit.planning.strategies.recomputing.checkpoint',
    'memfit.planning.strategies.memory_poor': 'memfit.planning.strategies.recomputing.memory_poor',
    'memfit.planning.strategies.optimal_recompute': 'memfit.planning.strategies.recomputing.optimal_recompute',
    'memfit.planning.strategies.swap': 'memfit.planning.strategies.swapping.tflms',
    'memfit.planning.strategies.vdnn': 'memfit.planning.strategies.swapping.vdnn',
    'memfit.replanning': 'memfit.compiler.replanning',
    'memfit.runtime.host': 'memfit.graph.host',
    'memfit.sharding': 'memfit.compiler.sharding',
    'memfit.strategies._forward_recompute': 'memfit.planning.strategies.recomputing._forward_recompute',
    'memfit.strategies._free_swaps': 'memfit.planning.strategies.swapping._free_swaps',
    'memfit.strategies._just_in_time_swap': 'memfit.planning.strategies.swapping._just_in_time_swap',
    'memfit.strategies._separator_count_search': 'memfit.planning.strategies.recomputing._separator_count_search',
    'memfit.strategies._swap_config': 'memfit.planning.strategies.swapping._swap_config',
    'memfit.strategies._swap_control': 'memfit.planning.strategies.swapping._swap_control',
    'memfit.strategies._swap_tune': 'memfit.planning.strategies.swapping._swap_tune',
    'memfit.strategies._vdnn_layers': 'memfit.planning.strategies.swapping._vdnn_layers',
    'memfit.strategies.checkpoint': 'memfit.planning.strategies.recomputing.checkpoint',
    'memfit.strategies.memory_poor': 'memfit.planning.strategies.recomputing.memory_poor',
    'memfit.strategies.optimal_recompute': 'memfit.planning.strategies.recomputing.optimal_recompute',
    'memfit.strategies.swap': 'memfit.planning.strategies.swapping.tflms',
    'memfit.strategies.vdnn': 'memfit.planning.strategies.swapping.vdnn',
    'memfit.traced': 'memfit.compiler.traced',
}
PACKAGES = {  # old package -> new: everything under it moved with it
    'memfit.solvers': 'memfit.planning.solvers',
    'memfit.strategies': 'memfit.planning.strategies',
}
OLD_PACKAGES = {'memfit.core'}  # folders that are gone


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module now at its new path."""

    def find_spec(self, name, path=None, target=None):
        if name in OLD_PACKAGES or _new_name(name) is not None:
            is_package = name in OLD_PACKAGES or name in PACKAGES
            return importlib.util.spec_from_loader(name, self, is_package=is_package)
        return None

    def create_module(self, spec):
        new = _new_name(spec.name)
        if new is None:  # a folder that is gone (``memfit.core``): an empty package
            module = types.ModuleType(spec.name)
            module.__path__ = []
            return module
        warnings.warn(f"{spec.name} is now {new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs = getattr(self, "_specs", {})
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        """The import system set ``__spec__`` to the alias's: give the module its own back."""
        specs = getattr(self, "_specs", {})
        own = specs.pop(getattr(module.__spec__, "name", None), None)
        if own is not None:
            module.__spec__ = own


def _new_name(name: str) -> str | None:
    if name in MOVED:
        return MOVED[name]
    if name in PACKAGES:
        return PACKAGES[name]
    for package, new in PACKAGES.items():
        if name.startswith(package + "."):
            return new + name[len(package):]
    return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
