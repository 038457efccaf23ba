"""Strategies: one entry point each, ``plan(graph, hardware, budget_bytes=None, **params)``.

Grouped by technique: ``swapping/`` (TFLMS in ``tflms``, the vDNN policies in ``vdnn``),
``recomputing/`` (``checkpoint``, ``optimal_recompute``, ``memory_poor``); at this level what is
neither (``keep``, ``auto``, the shared ``_budget_checks``, ``milp_swap_plan``: the swap +
recompute MILP's plan, the reference ``auto`` is measured against, not registered) and this
registry. Solvers (``memfit.planning.solvers``) return schedules; the strategies here turn them
into plans and price them.

Each module registers its entry point by name, so ``memfit.compile(..., strategy="swap", lb=3)``
and the command line reach it the same way. A user may spell a name with ``_`` or ``-`` alike
(``vdnn-all``, ``optimal_recompute``): input is read as the registered name, and everything
written (the plan's ``strategy``, reports) keeps the registered spelling.
"""

from __future__ import annotations

import contextvars
import functools
import gc
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.units import Budget, parse_budget

if TYPE_CHECKING:
    from memfit.planning.strategies._strategy_config import StrategyConfig


class Strategy(Protocol):
    def __call__(
        self, graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params
    ) -> Plan: ...


_REGISTRY: dict[str, Strategy] = {}
# the name each of this package's modules registers (tests/test_argument_errors.py holds it to
# the registry): a name that is none of these nor registered is refused, and one strategy's
# parameters checked, without loading every strategy and the solvers they import
BUILTIN_MODULES = {
    "auto": "auto", "checkpoint": "recomputing.checkpoint", "keep": "keep",
    "fused-chains": "recomputing.fused_chains", "memory-poor": "recomputing.memory_poor",
    "optimal-recompute": "recomputing.optimal_recompute",
    "swap": "swapping.tflms", "vdnn_all": "swapping.vdnn", "vdnn_conv": "swapping.vdnn",
    "vdnn_dyn": "swapping.vdnn",
}
_CONFIGS: dict[str, type[StrategyConfig]] = {}  # strategy name -> its parameters' config


def register(name: str, config: type[StrategyConfig]) -> Callable[[Strategy], Strategy]:
    """Register a strategy's ``plan`` function under ``name``; ``config`` (a frozen
    ``StrategyConfig`` that checks itself when built) checks its parameters without a graph.

    Raises:
        ValueError: if ``name`` differs from a registered name only in ``_`` against ``-``
            (users may spell either, so the two would be one name).
    """
    taken = _by_spelling().get(_spelling(name), name)
    if taken != name:
        raise ValueError(f"strategy {name!r} would shadow {taken!r}: names that differ only in "
                         "'_' against '-' are one name")

    def decorate(function: Strategy) -> Strategy:
        _CONFIGS[name] = config

        @functools.wraps(function)
        def planned(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
                    **params) -> Plan:
            started = STRATEGY_STARTED.get()
            if started is not None:
                started(name)
            with collector_paused():
                return function(graph, hardware, budget_bytes, **params)

        _REGISTRY[name] = planned
        return function

    return decorate


# called with a strategy's name as each plan of it starts (a progress line shows it), if set
STRATEGY_STARTED: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "memfit_strategy_started", default=None)


class _CollectorPause:
    """A process-wide count of plans in progress, so that threads pause the collector together.

    ``gc.disable()`` is process-wide: with a plain save-and-restore per plan, a thread whose plan
    ends first would switch the collector back on under another thread's plan, and a thread that
    starts while another plans would save "off" and leave it off for good. The first plan to
    start remembers whether the collector was on and switches it off; the last one to end
    switches it back on, only if it was on.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active_plans = 0
        self.was_enabled = False

    def enter(self) -> None:
        with self.lock:
            if self.active_plans == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.active_plans += 1

    def exit(self) -> None:
        with self.lock:
            self.active_plans -= 1
            if self.active_plans == 0 and self.was_enabled:
                gc.enable()


_COLLECTOR_PAUSE = _CollectorPause()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while planning (threads and nesting included).

    Why: planners build and drop hundreds of thousands of small objects (actions, plans), and
    each burst triggers full collections that walk every object the process holds (with a
    transformers model and its captured graphs loaded, hundreds of thousands), which can cost
    more than the planning itself. Planning makes no reference cycles
    worth collecting early; the collector resumes (if it was on) when the last plan in
    progress, in any thread, ends.
    """
    _COLLECTOR_PAUSE.enter()
    try:
        yield
    finally:
        _COLLECTOR_PAUSE.exit()


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name`` (``_`` and ``-`` alike).

    Raises:
        ValueError: for an unknown name, listing the registered ones.
    """
    chosen = canonical_name(name)
    if chosen not in _REGISTRY:  # a built-in not loaded yet: its own module only
        _load_builtin(chosen)
    return _REGISTRY[chosen]


def canonical_name(name: str) -> str:
    """The registered name that ``name`` spells, ``_`` and ``-`` alike: ``"vdnn-all"`` is
    ``"vdnn_all"``, ``"optimal_recompute"`` is ``"optimal-recompute"``.

    Why: the registered names mix the two (``"optimal-recompute"``, ``"vdnn_all"``), and a user
    should not have to remember which; the registered spelling stays the one written out (plan
    JSON, reports), so saved plans do not change.

    Raises:
        ValueError: for an unknown name, listing the registered ones (checked against the
            built-in names first, so that a mistyped name loads no strategy).
    """
    known = {_spelling(known): known for known in (*BUILTIN_MODULES, *_REGISTRY)}
    if not isinstance(name, str) or _spelling(name) not in known:
        raise ValueError(f"unknown strategy {name!r}: use one of {sorted(known.values())} "
                         "('_' and '-' alike)")
    return known[_spelling(name)]


def _spelling(name: str) -> str:
    """The form two spellings of one strategy name share."""
    return name.replace("-", "_")


def _by_spelling() -> dict[str, str]:
    """Each registered name by its spelling (``_spelling``)."""
    return {_spelling(registered): registered for registered in _REGISTRY}


def check_params(name: str, params: Mapping[str, Any], compiler: str = "aot_eager") -> None:
    """Validate a strategy's parameters and compiler without a graph, so bad ones fail before
    any capture.

    Builds the strategy's registered ``StrategyConfig``, which raises ``ValueError`` naming the
    accepted values, and raises ``ValueError`` where the strategy does not plan ``compiler``'s
    programs.
    """
    name = canonical_name(name)
    if name not in _CONFIGS:
        _load_builtin(name)
    config = _CONFIGS[name]
    config.from_params(params)
    if compiler not in config.compilers:
        raise ValueError(f"strategy {name!r} plans the programs of compiler="
                         f"{' or '.join(repr(c) for c in config.compilers)} only, got "
                         f"compiler={compiler!r}: pass compiler={config.compilers[0]!r} "
                         "(memfit.fit, memfit.backend) or choose another strategy")


def resolve_budget_and_strategy(budget: str | int | float | Budget | None, strategy: str | None,
                                params: Mapping[str, Any], compiler: str = "aot_eager"
                                ) -> tuple[Budget | None, str]:
    """Parse the budget and pick the strategy (``auto`` with a budget, ``keep`` without) by its
    registered name (``canonical_name``); check its parameters and ``compiler`` now, so a
    mistake fails at ``compile``, not at the first step.

    Torch-free, so the command line checks its arguments with it before importing torch.

    ``auto`` is the default because a user who names only a budget wants the fastest step that
    fits it, whatever mix of swapping and recomputation that takes on their hardware."""
    parsed = parse_budget(budget)
    chosen = canonical_name(strategy or ("auto" if parsed is not None else "keep"))
    check_params(chosen, params, compiler)
    return parsed, chosen


def strategy_names(compiler: str | None = None) -> tuple[str, ...]:
    """The registered strategies' names, sorted; with ``compiler``, those that plan its
    programs (``StrategyConfig.compilers``)."""
    _load_builtin()
    return tuple(sorted(name for name in _REGISTRY
                        if compiler is None or compiler in _CONFIGS[name].compilers))


def _load_builtin(name: str | None = None) -> None:
    """Import the module of built-in strategy ``name``, or (``None``) every module of this
    package and its technique folders (``swapping/``, ``recomputing/``): each registers its
    strategy when imported."""
    import importlib
    import pkgutil

    if name is not None and name in BUILTIN_MODULES:
        importlib.import_module(f"{__name__}.{BUILTIN_MODULES[name]}")
        return
    for info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
        importlib.import_module(info.name)
