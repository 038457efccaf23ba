"""memfit's import rule, read from the source: layers import only downward, no module loops.

The import graph is built with ``ast`` from every file of the package: imports inside functions
count (a lazy import is still a dependency, only a later one), imports under
``if TYPE_CHECKING:`` do not (they never run): no two modules may import each other in a loop.
A second graph with those type-only imports added must hold the layer rule too, and has no loop
but those ``KNOWN_LOOPS`` lists (none): a type named across a loop is a type in the wrong
module. An import names the module it loads: ``from
memfit.data import plan`` is an edge to ``memfit.data.plan``, ``from memfit.data.plan import
Plan`` one to ``memfit.data.plan``. The package ``__init__`` files Python runs on the way are not
edges: every module would otherwise depend on ``memfit/__init__.py`` and through it on all others.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

import memfit

ROOT = Path(memfit.__file__).resolve().parent.parent

LAYER_OF_FOLDER = {  # folder (or top-level module) -> layer, in the pipeline's order
    "data": "data",  # the frozen types and units: no algorithms
    "model": "model",  # what a plan does to a step: lowering, simulation, explanation, separators
    "planning": "planning",  # strategies/, solvers/, the batch search
    "render": "render",  # text and plots of data: what a user reads
    "ops": "ops",  # the custom ops a rewritten graph calls, and the host buffers they fill
    "runtime": "runtime",  # the copy engine, memory trackers, measurement, hardware probes
    "tracing": "tracing",  # a step captured as an fx graph and analyzed into a CostGraph
    "lowering": "lowering",  # a graph rewritten by a Plan: swap and re-run ops, inductor's partition
    "compiler": "compiler",  # memfit as a torch.compile backend: regions planned, run, measured
    "fitting": "fitting",  # memfit.fit's model and traced steps, in the user's loop
    "": "surface",  # the package's own __init__: the public names
    "api": "surface",
    "cli": "surface",
    "demo": "surface",
    "examples": "surface",
    "search": "surface",
}

LAYER_ORDER = ("data", "model", "planning", "render", "ops", "runtime", "tracing", "lowering",
               "compiler", "fitting", "surface")
ALLOWED = {layer: set(LAYER_ORDER[:index + 1])  # layer -> the layers it may import: only downward
           for index, layer in enumerate(LAYER_ORDER)}

KNOWN_UPWARD: list[str] = []  # imports against ALLOWED that are known: delete each when gone

FORBIDDEN_PACKAGES = ("bench",)  # the source checkout's benchmarks: never installed with memfit

KNOWN_LOOPS: list[set[str]] = []  # type-only loops that are known: none (issue 15 broke the last)

SOLVERS = "planning.solvers"  # solvers take problems and return schedules of their own types ...
PLAN_MAKERS = ("data.plan", "model.simulate")  # ... so they never import the plan or its pricing


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _nodes(tree: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node of ``tree``; without ``type_checking``, not the bodies of ``if
    TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from _nodes(child, type_checking)
            continue
        yield node
        yield from _nodes(node, type_checking)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_modules(node: ast.AST, module: str, is_package: bool,
                      modules: dict[str, Path]) -> list[str]:
    """The modules an import statement loads (relative imports resolved); outside the package,
    the top-level name (``bench``, ``torch``)."""
    if isinstance(node, ast.Import):
        return [_nearest_module(alias.name, modules) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [_nearest_module(f"{base}.{alias.name}", modules) for alias in node.names]


def _nearest_module(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module of the package, else its top-level name:
    ``memfit.data.plan.Plan`` -> ``memfit.data.plan``, ``bench.run.main`` -> ``bench``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def import_graph(root: Path, package: str, type_checking: bool = False) -> nx.DiGraph:
    """The modules of ``package`` and what each imports at run time (with ``type_checking``,
    the imports only a type checker reads as well)."""
    modules = module_files(root, package)
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        is_package = path.name == "__init__.py"
        for node in _nodes(ast.parse(path.read_text(encoding="utf-8")), type_checking):
            for target in _imported_modules(node, module, is_package, modules):
                if target != module:
                    graph.add_edge(module, target)
    return graph


def layer_of(module: str, package: str) -> str:
    """The layer of a module: its folder's, or (a top-level module) its own entry; a module
    the table does not place is its own layer, which no other layer may import."""
    parts = module.split(".")[1:]
    return LAYER_OF_FOLDER.get(parts[0] if parts else "", f"unplaced {module}")


def upward_imports(graph: nx.DiGraph, package: str) -> list[str]:
    """``a -> b (layer -> layer)`` for each import the layer table does not allow."""
    found = []
    for importer, imported in sorted(graph.edges):
        if not imported.startswith(package + ".") and imported != package:
            continue
        source, target = layer_of(importer, package), layer_of(imported, package)
        if target not in ALLOWED.get(source, set()):
            found.append(f"{importer} -> {imported} ({source} -> {target})")
    return found


def import_loops(graph: nx.DiGraph) -> list[set[str]]:
    """The strongly connected components of more than one module: modules importing in a loop."""
    return sorted((set(c) for c in nx.strongly_connected_components(graph) if len(c) > 1),
                  key=sorted)


def forbidden_imports(graph: nx.DiGraph) -> list[str]:
    return [f"{a} -> {b}" for a, b in sorted(graph.edges) if b in FORBIDDEN_PACKAGES]


def solver_plan_imports(graph: nx.DiGraph, package: str) -> list[str]:
    """``a -> b`` for each solver module importing ``Plan``'s module or ``simulate``'s: building
    and pricing plans (and tightening by the simulated excess) is the strategies' job."""
    solvers = f"{package}.{SOLVERS}"
    forbidden = {f"{package}.{module}" for module in PLAN_MAKERS}
    return [f"{a} -> {b}" for a, b in sorted(graph.edges)
            if (a == solvers or a.startswith(solvers + ".")) and b in forbidden]


@pytest.fixture(scope="module")
def memfit_graph() -> nx.DiGraph:
    return import_graph(ROOT, "memfit")


@pytest.fixture(scope="module", params=[False, True], ids=["run-time", "with-type-only"])
def either_graph(request) -> nx.DiGraph:
    return import_graph(ROOT, "memfit", type_checking=request.param)


def test_no_module_imports_in_a_loop(memfit_graph):
    assert import_loops(memfit_graph) == []


def test_type_only_imports_make_only_the_known_loops():
    """A listed loop that is gone (or changed) must leave the list."""
    loops = import_loops(import_graph(ROOT, "memfit", type_checking=True))
    assert [loop for loop in loops if loop not in KNOWN_LOOPS] == []
    assert [loop for loop in KNOWN_LOOPS if loop not in loops] == [], (
        "a known loop is broken (or changed): remove it from KNOWN_LOOPS")


def test_layers_import_only_downward(either_graph):
    assert [found for found in upward_imports(either_graph, "memfit")
            if found not in KNOWN_UPWARD] == []


def test_known_upward_imports_are_still_there(memfit_graph):
    """A listed upward import that is gone (or moved) must leave the list."""
    assert [known for known in KNOWN_UPWARD
            if known not in upward_imports(memfit_graph, "memfit")] == []


def test_memfit_never_imports_bench(either_graph):
    assert forbidden_imports(either_graph) == []


def test_solvers_never_build_or_simulate_plans(either_graph):
    assert solver_plan_imports(either_graph, "memfit") == []


def test_types_never_import_renderers(either_graph):
    """Data, model and planning never reach ``memfit.render``, directly or through others."""
    below = [module for module in either_graph
             if layer_of(module, "memfit") in ("data", "model", "planning")]
    assert [f"{module} -> {reached}" for module in below
            for reached in nx.descendants(either_graph, module)
            if reached.startswith("memfit.render")] == []


def test_every_folder_and_top_level_module_has_a_layer(memfit_graph):
    """A new folder or top-level module is placed in the table on purpose."""
    names = {module.split(".")[1] for module in memfit_graph if module.startswith("memfit.")}
    assert sorted(names - set(LAYER_OF_FOLDER)) == []


def test_the_checker_finds_an_upward_import_a_loop_bench_and_a_solver_making_plans(tmp_path):
    """A small package with one of each mistake: the checks above would fail on it."""
    files = {
        "pkg/__init__.py": "",
        "pkg/data/__init__.py": "",
        "pkg/data/plan.py": "def explain():\n    from pkg.render import text\n",
        "pkg/data/json.py": "from . import loop\n",
        "pkg/data/loop.py": "import pkg.data.json\n",
        "pkg/data/typed.py": "from typing import TYPE_CHECKING\n"
                             "if TYPE_CHECKING:\n    from pkg.planning import register\n",
        "pkg/render/__init__.py": "",
        "pkg/render/text.py": "from pkg.data.plan import explain\n",
        "pkg/planning/__init__.py": "",
        "pkg/planning/solvers/__init__.py": "",
        "pkg/planning/solvers/dp.py": "from pkg.data.plan import explain\n",
        "pkg/planning/solvers/milp.py": "from pkg.model import simulate\n"
                                        "from pkg.data import json\n",
        "pkg/planning/strategies.py": "from pkg.model.simulate import simulate\n",
        "pkg/model/__init__.py": "",
        "pkg/model/simulate.py": "",
        "pkg/cli.py": "from bench.run import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert upward_imports(graph, "pkg") == ["pkg.data.plan -> pkg.render.text (data -> render)"]
    assert import_loops(graph) == [{"pkg.data.json", "pkg.data.loop"},
                                   {"pkg.data.plan", "pkg.render.text"}]
    assert forbidden_imports(graph) == ["pkg.cli -> bench"]
    assert solver_plan_imports(graph, "pkg") == ["pkg.planning.solvers.dp -> pkg.data.plan",
                                                 "pkg.planning.solvers.milp -> pkg.model.simulate"]
    typed = import_graph(tmp_path, "pkg", type_checking=True)
    assert upward_imports(typed, "pkg") == [
        "pkg.data.plan -> pkg.render.text (data -> render)",
        "pkg.data.typed -> pkg.planning (data -> planning)"]
