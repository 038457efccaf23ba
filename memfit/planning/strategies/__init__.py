"""Strategies: one entry point each, ``plan(graph, hardware, budget_bytes=None, **params)``.

Grouped by technique: ``swapping/`` (TFLMS in ``tflms``, the vDNN policies in ``vdnn``),
``recomputing/`` (``checkpoint``, ``optimal_recompute``, ``memory_poor``); at this level what is
neither (``keep``, ``auto``, the shared ``_budget_checks``, ``milp_swap_plan``: the swap +
recompute MILP's plan, the reference ``auto`` is measured against, not registered) and this
registry. Solvers (``memfit.planning.solvers``) return schedules; the strategies here turn them
into plans and price them.

Each module registers its entry point by name, so ``memfit.compile(..., strategy="swap", lb=3)``
and the command line reach it the same way.
"""

from __future__ import annotations

import functools
import gc
import sys
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
_CHECKS: dict[str, Callable[..., None]] = {}  # strategy name -> its own parameter check


def register(name: str, check_params: Callable[..., None] | None = None,
             config: type[StrategyConfig] | None = None) -> Callable[[Strategy], Strategy]:
    """Register a strategy's ``plan`` function under ``name``.

    Its parameters are checked without a graph by ``config`` (a frozen ``StrategyConfig`` that
    checks itself when built from them), else by ``check_params`` (default: the module's own
    ``check_params``; a module that registers several strategies, such as ``vdnn``, gives each
    its own)."""

    def decorate(function: Strategy) -> Strategy:
        if config is not None:
            _CHECKS[name] = functools.partial(_build_config, config)
        elif check_params is not None:
            _CHECKS[name] = check_params

        @functools.wraps(function)
        def planned(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None,
                    **params) -> Plan:
            with collector_paused():
                return function(graph, hardware, budget_bytes, **params)

        _REGISTRY[name] = planned
        return function

    return decorate


def _build_config(config: type[StrategyConfig], /, **params: Any) -> None:
    """Build ``config`` from ``params`` for its checks (positional-only: a user parameter named
    ``config`` is an unknown one, not this argument)."""
    config.from_params(params)


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
    each burst triggers full collections that walk every object the process holds: with a
    transformers model and its captured graphs loaded that is ~450,000 objects, and a
    simulation of GPT-2 small took 30 ms instead of 6. Planning makes no reference cycles
    worth collecting early; the collector resumes (if it was on) when the last plan in
    progress, in any thread, ends.
    """
    _COLLECTOR_PAUSE.enter()
    try:
        yield
    finally:
        _COLLECTOR_PAUSE.exit()


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the registered ones.
    """
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}: use one of {sorted(_REGISTRY)}") from None


def check_params(name: str, params: Mapping[str, Any]) -> None:
    """Validate a strategy's parameters without a graph, so bad ones fail before any capture.

    Each strategy registers a ``StrategyConfig`` or defines ``check_params(**params)`` (or
    registers one per strategy), raising ``ValueError`` that names the accepted values.
    """
    strategy = get_strategy(name)  # first: it loads the modules that fill ``_CHECKS``
    check = _CHECKS.get(name) or sys.modules[strategy.__module__].check_params
    check(**params)


def resolve_budget_and_strategy(budget: str | int | float | Budget | None, strategy: str | None,
                                params: Mapping[str, Any]) -> tuple[Budget | None, str]:
    """Parse the budget and pick the strategy (``auto`` with a budget, ``keep`` without); check
    its parameters now, so a mistake fails at ``compile``, not at the first step.

    Torch-free, so the command line checks its arguments with it before importing torch.

    ``auto`` is the default because a user who names only a budget wants the fastest step that
    fits it, whatever mix of swapping and recomputation that takes on their hardware."""
    parsed = parse_budget(budget)
    chosen = strategy or ("auto" if parsed is not None else "keep")
    check_params(chosen, params)
    return parsed, chosen


def strategy_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def _load_builtin() -> None:
    """Import every module of this package and its technique folders (``swapping/``,
    ``recomputing/``) once: each registers its strategy when imported."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
        importlib.import_module(info.name)
