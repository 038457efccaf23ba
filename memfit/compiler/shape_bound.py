"""The bound a dynamic region's plan is priced at, and the check before each of its runs.

Dynamo traces a region whose input shapes changed (or that the user marked,
``torch._dynamo.mark_dynamic(x, 1, max=...)``) with symbolic sizes. memfit plans it once at a
bound (``memfit.tracing.shapes``): each symbol at the maximum the user declared, else at the
value it had when traced. Before each run, ``InputSizes.beyond`` reads the symbols' values off
the arguments; a run within the bound runs the plan as it is, and one past it has the region
planned again at the raised bound first (``memfit.compiler.replanning``), from the same trace.

Example:
    >>> sizes = InputSizes.of(example_inputs)      # None for a static region
    >>> raised = sizes.beyond(args, region.shape_bound)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from memfit.tracing.shapes import (
    Bound,
    declared_maximum,
    declared_maximums,
    not_provably_monotone,
    symbol_hints,
    symbols_of,
)


@dataclass(frozen=True)
class InputSizes:
    """Where a region's symbols are read off its arguments: ``(argument, dimension, symbol)``
    (dimension ``None`` for a symbolic int argument), and the symbols' declared maximums."""

    places: tuple[tuple[int, int | None, sympy.Symbol], ...]
    declared: tuple[tuple[sympy.Symbol, int], ...]
    hints: tuple[tuple[sympy.Symbol, int], ...]
    users: tuple[tuple[sympy.Symbol, int], ...] = ()  # the maximums the user declared
    fake_inputs: tuple = ()  # Dynamo's symbolic fake inputs: what a new plan is traced from
    fake_mode: Any = None  # their fake mode, with the shape environment of the symbols

    @staticmethod
    def of(graph_module: fx.GraphModule) -> InputSizes | None:
        """The places of the inputs of Dynamo's graph whose size is a bare symbol; ``None``
        where there are none (a static region)."""
        fakes = tuple(node.meta.get("example_value")
                      for node in graph_module.graph.find_nodes(op="placeholder"))
        places: list[tuple[int, int | None, sympy.Symbol]] = []
        env = None
        for position, value in enumerate(fakes):
            sizes = ([(None, value)] if isinstance(value, torch.SymInt) else
                     list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else [])
            for dimension, size in sizes:
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    places.append((position, dimension, size.node.expr))
                    env = size.node.shape_env
        if env is None:
            return None
        symbols = {symbol for _, _, symbol in places}
        declared = tuple((s, upper) for s in symbols
                         if (upper := declared_maximum(env, s)) is not None)
        hints = tuple((s, int(env.backed_var_to_val[s])) for s in symbols
                      if s in env.backed_var_to_val)
        mode = next(value.fake_mode for value in fakes if isinstance(value, FakeTensor))
        derived = dict(declared)
        users = tuple((s, min(upper, derived.get(s, upper)))
                      for s, upper in users_maximums(graph_module, places).items())
        return InputSizes(tuple(places), declared, hints, users, fakes, mode)

    def traced_again(self) -> contextlib.AbstractContextManager:
        """Where AOTAutograd traces ``fake_inputs`` again with their symbols (Dynamo's own
        tracing context is gone by a later run)."""
        from torch._guards import TracingContext, tracing

        return tracing(TracingContext(self.fake_mode))

    def first_bound(self) -> dict[sympy.Symbol, int]:
        """The bound of the first plan: each declared maximum, else the traced value."""
        return {**dict(self.hints), **dict(self.declared)}

    def seen_bound(self) -> dict[sympy.Symbol, int]:
        """The bound of a first plan where none fits ``first_bound``: each maximum the user
        declared, else the traced value. A maximum Dynamo derived from its guards may be a
        limit of the graph, not of the loop's sizes (a CPU convolution guards ``batch < 16``
        to pick its kernel: a plan for batches of 4 priced at 15); a later run past this bound
        has the region planned again at its sizes."""
        return {**dict(self.hints), **dict(self.users)}

    def values(self, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """Each symbol's value in this run's arguments (the largest place, should two differ)."""
        found: dict[sympy.Symbol, int] = {}
        for position, dimension, symbol in self.places:
            value = args[position]
            size = int(value) if dimension is None else int(value.shape[dimension])
            found[symbol] = max(size, found.get(symbol, 0))
        return found

    def beyond(self, args: Sequence[Any], bound: Bound | None) -> dict[sympy.Symbol, int] | None:
        """The raised bound where a symbol of this run is past ``bound``; ``None`` within it."""
        if not bound:
            return None
        now = self.values(args)
        if all(value <= bound.get(symbol, value) for symbol, value in now.items()):
            return None
        return {symbol: max(bound.get(symbol, 0), now.get(symbol, 0))
                for symbol in {*bound, *now}}


def users_maximums(graph_module: fx.GraphModule,
                   places: Sequence[tuple[int, int | None, sympy.Symbol]]
                   ) -> dict[sympy.Symbol, int]:
    """The maximums the user declared for the symbols at ``places`` of Dynamo's graph
    (``torch._dynamo.mark_dynamic(x, dim, max=...)``, read off the example tensors Dynamo
    keeps with its placeholders)."""
    examples = [getattr(node.meta.get("grapharg"), "example", None)
                for node in graph_module.graph.find_nodes(op="placeholder")]
    found: dict[sympy.Symbol, int] = {}
    for position, dimension, symbol in places:
        example = examples[position] if position < len(examples) else None
        for declared in getattr(example, "_dynamo_dynamic_range", ()):
            if declared.dim == dimension and declared.max is not None:
                found[symbol] = min(int(declared.max), found.get(symbol, int(declared.max)))
    return found


def priced_bound(joint: fx.GraphModule, bound: Bound | None) -> dict[sympy.Symbol, int]:
    """The bound ``joint`` is priced at: ``bound``, with every other symbol of the graph at its
    declared maximum or traced value; empty for a static graph. Warns where a storage's size is
    not provably monotone in the symbols (a plan priced at the bound may not hold below it)."""
    symbols = symbols_of(joint)
    if not symbols:
        return {}
    priced = {**symbol_hints(joint), **declared_maximums(joint), **dict(bound or {})}
    missing = symbols - priced.keys()
    if missing:
        raise ValueError(f"memfit: no value for the symbolic sizes {sorted(map(str, missing))}")
    doubtful = not_provably_monotone(joint)
    if doubtful:
        from memfit.data.errors import BudgetWarning

        warnings.warn(
            f"memfit: the sizes of {len(doubtful)} values of a dynamic region (first "
            f"{doubtful[0]}) are not provably non-decreasing in its dynamic sizes, so its plan, "
            "priced at the largest sizes, may not hold for smaller ones; compile with "
            "dynamic=False for a plan per shape", BudgetWarning, stacklevel=2)
    return {symbol: priced[symbol] for symbol in symbols}
