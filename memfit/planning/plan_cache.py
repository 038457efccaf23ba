"""Plans kept on disk across processes, keyed by everything ``plan_step`` reads.

``plan_step`` is a function of its arguments: the region's ``CostGraph`` (its ops, sizes at the
shape bound, kernel scratch, op times), the hardware profile, the budget, the strategy and its
options, the bytes outside the graph (parameters, optimizer state, eager code's bytes), whether it
explains with what-if rows, and memfit's own code. The cache key is a hash of all of them (memfit's
source files, torch's and Python's versions included), so an entry is only found for the call that
made it; the second process of the same script chooses no plan, as inductor's FX graph cache
compiles no graph.

A found plan is trusted no more than a new one: ``plan_step`` simulates it on the graph and drops
it where its predicted peak is over the budget, and its first runs are measured like every plan's
(``memfit.compiler.region_peak``). A file that cannot be read, of another format, or whose key does
not match is ignored, said in ``memfit.report`` and written again. Files are written atomically
(``memfit.data.files``).

Where: ``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit`` (``~/.cache/memfit``);
``MEMFIT_CACHE=0`` turns it off.

Example:
    >>> with planning_tally() as tally:
    ...     planned = plan_step(graph, hardware, budget, "auto", {})
    >>> tally.cached, tally.seconds
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import operator
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from memfit.data.costgraph import (
    STRUCTURE_OP_FIELDS,
    STRUCTURE_TENSOR_FIELDS,
    CostGraph,
    Op,
    Tensor,
)
from memfit.data.errors import BudgetError
from memfit.data.files import cache_dir, write_text
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.units import Budget

CACHE_FORMAT = "memfit-plan-cache"
CACHE_FORMAT_VERSION = 1


@lru_cache(maxsize=1)
def code_versions() -> dict[str, str]:
    """What else a plan depends on: memfit's source files (a new release changes them, and so
    does an edit in a development checkout, whose version stays), torch's and Python's
    versions. A source file is known by its path, size and modification
    time: an edit, a checkout or another copy changes them. torch's version is its installed
    distribution's, read without importing it (this layer is torch-free)."""
    root = Path(__file__).resolve().parents[1]  # the memfit package
    sources = hashlib.sha256()
    for relative, found in sorted(_source_files(str(root), "")):
        sources.update(f"{relative} {found.st_size} {found.st_mtime_ns}\n".encode())
    return {"sources": sources.hexdigest()[:16], "torch": _installed_version("torch"),
            "python": ".".join(map(str, sys.version_info[:2]))}


def _source_files(folder: str, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every ``.py`` file under ``folder`` (``__pycache__`` left out) as (its path relative to
    the package, its ``stat``): ``os.scandir`` hands the stat over with the listing, where
    ``os.walk`` with ``relpath`` and ``stat`` took several times longer."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    yield from _source_files(entry.path, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                yield f"{prefix}{entry.name}", entry.stat()


def _installed_version(distribution: str) -> str:
    """The version of ``distribution``: its module's where this process imported it already
    (reading the distribution's metadata takes milliseconds), else the installed one's; ``""``
    where it is not installed."""
    imported = sys.modules.get(distribution)
    if isinstance(getattr(imported, "__version__", None), str):
        return imported.__version__  # type: ignore[union-attr]
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def plan_key(graph: CostGraph, hardware: Hardware, budget: Budget | None, strategy: str,
             params: Mapping[str, Any], outside_bytes: int, what_ifs: bool) -> str | None:
    """The hash of everything ``plan_step`` reads, ``None`` where an option has no stable text
    (an object without a JSON form: such a call is never cached)."""
    try:
        text = json.dumps({"graph": graph_digest(graph), "hardware": hardware.to_json(),
                           "budget": None if budget is None else asdict(budget),
                           "strategy": strategy, "params": dict(params),
                           "outside_bytes": outside_bytes, "what_ifs": what_ifs,
                           "versions": code_versions(), "format": CACHE_FORMAT_VERSION},
                          sort_keys=True)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


_GRAPH_DIGESTS: dict[int, str] = {}  # id(graph) -> its record's hash, while the graph lives


def graph_digest(graph: CostGraph) -> str:
    """The hash of every field of every op and tensor of ``graph``, once per graph object: a
    region's graph is keyed at each of its budgets (a graph is frozen). It hashes the graph's
    ``structure_text`` (its plans' ``graph_hash`` made it already) and the fields that text
    leaves out (``_rest_record``)."""
    found = _GRAPH_DIGESTS.get(id(graph))
    if found is None:
        hashed = hashlib.sha256(graph.structure_text.encode())
        hashed.update(_RECORD_ENCODER.encode(_rest_record(graph)).encode())
        found = hashed.hexdigest()
        _GRAPH_DIGESTS[id(graph)] = found
        weakref.finalize(graph, _GRAPH_DIGESTS.pop, id(graph), None)
    return found


def _rest_record(graph: CostGraph) -> list:
    """The graph's name and compiler and every field of its ops and tensors that
    ``structure_text`` leaves out, ops in program order and tensors in the graph's order (each
    with its name)."""
    return [graph.name, graph.compiler, [_OP_REST(op) for op in graph.ops],
            [_TENSOR_REST(tensor) for tensor in graph.tensors.values()]]


_OP_REST = operator.attrgetter(*(item.name for item in fields(Op)
                                 if item.name not in STRUCTURE_OP_FIELDS))
_TENSOR_REST = operator.attrgetter("name", *(item.name for item in fields(Tensor)
                                             if item.name not in STRUCTURE_TENSOR_FIELDS))
# the record holds no cycles: the encoder's check for them costs a fifth of the encoding
_RECORD_ENCODER = json.JSONEncoder(check_circular=False)


@dataclass
class PlanningTally:
    """What the plans chosen inside ``planning_tally`` cost: seconds choosing them (the
    strategy, its explanation and simulation, or reading the cache), how many were made and how
    many came from the cache, and the cache files ignored (why)."""

    seconds: float = 0.0
    made: int = 0
    cached: int = 0
    ignored: list[str] = field(default_factory=list)
    progress: Any = None  # a tqdm line the stages are shown on (``note_stage``), if any


_TALLY: contextvars.ContextVar[PlanningTally | None] = contextvars.ContextVar(
    "memfit_planning_tally", default=None)


@contextlib.contextmanager
def planning_tally() -> Iterator[PlanningTally]:
    """Count the plans ``plan_step`` chooses inside the block (nested blocks count their own)."""
    tally = PlanningTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def note_planned(seconds: float, cached: bool) -> None:
    """Add one plan chosen in ``seconds`` to the current tally, if any."""
    tally = _TALLY.get()
    if tally is not None:
        tally.seconds += seconds
        tally.cached += cached
        tally.made += not cached


def note_stage(stage: str) -> None:
    """Show ``stage`` on the current tally's progress line, if it has one."""
    tally = _TALLY.get()
    if tally is not None and tally.progress is not None:
        tally.progress.set_postfix_str(stage, refresh=False)
        tally.progress.update(1)


def note_ignored(why: str) -> None:
    tally = _TALLY.get()
    if tally is not None:
        tally.ignored.append(why)


def _entry_path(key: str) -> Path | None:
    folder = cache_dir()
    return None if folder is None else folder / "plans" / f"{key}.json"


def recall(key: str | None, strategy: str) -> Plan | None:
    """The plan of ``strategy`` cached under ``key``, ``None`` where there is none (or the cache
    is off).

    Raises:
        BudgetError: the refusal cached under ``key`` (no plan of the strategy fit).
    """
    path = _entry_path(key) if key else None
    if path is None or not path.exists():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("format") != CACHE_FORMAT or entry.get("version") != CACHE_FORMAT_VERSION:
            raise ValueError(f"format {entry.get('format')!r} version {entry.get('version')!r}")
        if entry.get("key") != key:
            raise ValueError("its key is not its name's")
        if entry.get("refused") is not None:
            refused = entry["refused"]
            error = BudgetError(refused["budget_bytes"], refused["minimum_bytes"],
                                [tuple(item) for item in refused["dominant"]],
                                refused["strategy"], refused["note"], refused["host_bytes"])
        else:
            from memfit.planning.strategies import canonical_name

            plan, wanted = Plan.from_json(entry["plan"], source=str(path)), canonical_name(strategy)
            if plan.strategy != wanted:
                raise ValueError(f"its plan is of strategy {plan.strategy!r}, not {wanted!r}")
            return plan
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as why:
        note_ignored(f"{path.name[:16]}: {type(why).__name__}: {str(why)[:120]}")
        return None
    raise error


def remember(key: str | None, plan: Plan | None = None, refused: BudgetError | None = None
             ) -> None:
    """Write ``plan`` (or the ``refused`` error) under ``key``, atomically; a folder that cannot
    be written leaves the cache unused, never the step stopped."""
    path = _entry_path(key) if key else None
    if path is None:
        return
    entry: dict[str, Any] = {"format": CACHE_FORMAT, "version": CACHE_FORMAT_VERSION,
                             "key": key, "versions": code_versions()}
    if refused is not None:
        entry["refused"] = {"budget_bytes": refused.budget_bytes,
                            "minimum_bytes": refused.minimum_bytes,
                            "dominant": [list(item) for item in refused.dominant],
                            "strategy": refused.strategy, "note": refused.note,
                            "host_bytes": refused.host_bytes}
    elif plan is not None:
        entry["plan"] = plan.to_json()
    else:
        raise ValueError("remember takes a plan or a refusal")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(entry))
    except OSError as why:
        note_ignored(f"not written ({type(why).__name__}: {str(why)[:120]})")
