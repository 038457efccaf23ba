"""The methods of ``Plan`` that reach above the data layer: explain, and the JSON file form.

``Plan`` (``memfit.data.plan``) is frozen data that every layer builds and reads, so it imports
nothing above itself. Yet ``plan.explain()`` renders text (``memfit.render``) and a plan read
from a file names a strategy checked against the registry (``memfit.planning.strategies``). The bodies
live here, in the surface layer, and ``memfit/__init__.py`` attaches them to ``Plan`` with
``attach``: Python runs that file before any memfit module, so the methods are there whichever
module a program imports first, and ``plan.explain()``, ``plan.save(path)``, ``Plan.load(path)``
read as before. ``Plan`` declares them under ``TYPE_CHECKING`` for type checkers.

Note:
    Why not a subclass of ``Plan`` with the methods: strategies build ``Plan`` in a layer below
    any such subclass, so a plan they return would lack the methods. Why not lazy imports in
    ``Plan``'s own methods: an import inside a function is still an upward dependency, and the
    loop it made (``data.plan`` -> ``render.explain`` -> ``model.explain`` -> ``data.plan``) is
    what ``tests/test_layers.py`` forbids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from memfit.data.files import write_text
from memfit.data.plan import Plan


def explain(plan: Plan, depth: int = 3, width: int = 100, rows: int | None = 40) -> str:
    """The decisions grouped by module, the time each costs, and what-if budgets, as text.

    Args:
        depth: module-path parts to group by (``transformer.h.3``: 3); deeper paths are cut.
        width: terminal columns; wide tables turn on their side.
        rows: the most per-tensor rows to print, most costly first (``None``: all).
    """
    from memfit.render.explain import explain_text

    return explain_text(plan, depth=depth, width=width, rows=rows)


def to_json(plan: Plan) -> dict:
    """The plan's JSON form (``memfit.data.plan_json`` holds the schema)."""
    from memfit.data.plan_json import plan_to_json

    return plan_to_json(plan)


def from_json(data: Mapping, source: str = "the saved plan") -> Plan:
    """A plan from its JSON form, checked against the schema first.

    Raises:
        ValueError: naming the field that is missing, unknown, or of the wrong type or value
            (an unregistered strategy, a budget that is not a positive int, a blank
            ``graph_hash``); for a plan of another format version (made by another memfit).
    """
    from memfit.data.plan_json import plan_from_json
    from memfit.planning.strategies import strategy_names

    return plan_from_json(data, strategy_names(), source=source)


def save(plan: Plan, path: str | Path) -> None:
    """Write the plan as JSON, atomically: an existing file is replaced only when complete."""
    write_text(path, json.dumps(to_json(plan), indent=1))


def load(path: str | Path) -> Plan:
    """Read a plan ``save`` wrote. ``memfit.compile(..., plan=plan)`` checks that it fits.

    Raises:
        ValueError: if the file is not a memfit plan, is one of another format version, or
            breaks the schema (the message names the field; see ``from_json``).
        OSError: if the file cannot be read.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a memfit plan (not JSON: {error})") from None
    return from_json(data, source=str(path))


def attach() -> None:
    """Make the functions above ``Plan``'s methods (``memfit/__init__.py`` calls this once)."""
    methods = {"explain": explain, "to_json": to_json, "from_json": staticmethod(from_json),
               "save": save, "load": staticmethod(load)}
    for name, method in methods.items():
        setattr(Plan, name, method)
