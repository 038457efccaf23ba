"""A joint graph with symbolic sizes, priced at a bound.

Where Dynamo traces a region with dynamic dimensions, AOTAutograd hands memfit a joint graph whose
``node.meta["val"]`` sizes are ``SymInt`` expressions of a few symbols (a batch size ``s0``, a
sequence length ``s1``). memfit plans such a graph at a *bound*: one value per symbol, the largest
seen or the one the user declared (``torch._dynamo.mark_dynamic(x, 1, max=...)``). ``at_bound``
gives a copy of the graph whose values are concrete fake tensors at the bound, with the same node
names and the same storage sharing, so every pass that reads sizes (``analyze``, the kernel
temporaries, lifetimes) reads plain ints and adds no guard to Dynamo's shape environment. The plan
names graph values, so the program rewritten from it serves every shape below the bound.

A plan priced at the bound holds below it where every storage's size is monotone in the symbols
(``not_provably_monotone``): the schedule does not depend on sizes, so each step's live bytes, and the peak,
can only shrink with them.

Example:
    >>> bound = symbol_bound(joint)            # {s0: 256, s1: 512}
    >>> priced = at_bound(joint, bound)        # same names, concrete sizes
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.tracing.analyze import storage_key, tensors_in

Bound = Mapping[sympy.Symbol, int]


def is_symbolic(graph_module: fx.GraphModule) -> bool:
    """Whether any value of the graph has a symbolic size, stride or offset."""
    return bool(symbols_of(graph_module))


def symbols_of(graph_module: fx.GraphModule) -> frozenset[sympy.Symbol]:
    """The free symbols of every size, stride and storage size of the graph's values."""
    found: set[sympy.Symbol] = set()
    for node in graph_module.graph.nodes:
        for value in _leaves(node.meta.get("val")):
            for size in _sizes_of(value):
                if isinstance(size, torch.SymInt):
                    found |= size.node.expr.free_symbols
    return frozenset(found)


def symbol_hints(graph_module: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """Each symbol's value in the example the graph was traced with (its ShapeEnv hint)."""
    env = shape_env_of(graph_module)
    if env is None:
        return {}
    return {symbol: int(env.backed_var_to_val[symbol]) for symbol in symbols_of(graph_module)
            if symbol in env.backed_var_to_val}


def declared_maximums(graph_module: fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The symbols whose range the user bounded (``mark_dynamic(x, dim, max=...)``), with it."""
    env = shape_env_of(graph_module)
    if env is None:
        return {}
    found = {}
    for symbol in symbols_of(graph_module):
        upper = declared_maximum(env, symbol)
        if upper is not None:
            found[symbol] = upper
    return found


def declared_maximum(env: Any, symbol: sympy.Symbol) -> int | None:
    """``symbol``'s upper end in ``env`` where it is finite (declared), else ``None``."""
    from torch.utils._sympy.numbers import int_oo

    found = env.var_to_range.get(symbol)
    if found is None or found.upper in (int_oo, sympy.oo) or not found.upper.is_number:
        return None
    return int(found.upper)


def shape_env_of(graph_module: fx.GraphModule) -> Any:
    """The ShapeEnv of the graph's symbolic sizes (``None`` for a static graph)."""
    for node in graph_module.graph.nodes:
        for value in _leaves(node.meta.get("val")):
            for size in _sizes_of(value):
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def evaluate(size: Any, bound: Bound) -> int:
    """``size`` (an int or a ``SymInt``) with each symbol at its bound."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    return int(size.node.expr.xreplace(dict(bound)))


def at_bound(graph_module: fx.GraphModule, bound: Bound) -> fx.GraphModule:
    """A copy of ``graph_module`` (same node names, targets and meta) whose values are concrete
    fake tensors with every symbol at ``bound``; tensors that shared a storage still share one."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    copied = fx.GraphModule(graph_module, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    bases: dict = {}
    with mode:
        for node in copied.graph.nodes:
            node.meta = dict(node.meta)
            if "val" in node.meta:
                node.meta["val"] = _concrete(node.meta["val"], bound, bases)
    return copied


def _concrete(value: Any, bound: Bound, bases: dict) -> Any:
    if isinstance(value, torch.Tensor):
        key = storage_key(value)
        base = bases.get(key)
        if base is None:
            nbytes = evaluate(value.untyped_storage().nbytes(), bound)
            base = bases[key] = torch.empty(nbytes, dtype=torch.uint8, device=value.device)
        shape = [evaluate(size, bound) for size in value.shape]
        stride = [evaluate(step, bound) for step in value.stride()]
        offset = evaluate(value.storage_offset(), bound)
        typed = base.view(value.dtype) if value.dtype != torch.uint8 else base
        result = typed.as_strided(shape, stride, offset)
        return result.requires_grad_(value.requires_grad) if value.is_floating_point() else result
    if isinstance(value, torch.SymInt):
        return evaluate(value, bound)
    if isinstance(value, (tuple, list)):
        return type(value)(_concrete(item, bound, bases) for item in value)
    return value


def not_provably_monotone(graph_module: fx.GraphModule) -> list[str]:
    """The values of the graph whose storage size is not provably non-decreasing in every symbol
    (a polynomial with nonnegative coefficients is): empty where a plan priced at a bound holds
    for every shape below it."""
    doubtful = []
    for node in graph_module.graph.nodes:
        for tensor in tensors_in(node.meta.get("val")):
            nbytes = tensor.untyped_storage().nbytes()
            if isinstance(nbytes, torch.SymInt) and not _nonnegative_polynomial(nbytes.node.expr):
                doubtful.append(node.name)
                break
    return doubtful


def _nonnegative_polynomial(expression: sympy.Expr) -> bool:
    symbols = sorted(expression.free_symbols, key=str)
    try:
        polynomial = sympy.Poly(sympy.expand(expression), *symbols)
    except sympy.PolynomialError:
        return False
    return all(coefficient >= 0 for coefficient in polynomial.coeffs())


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value


def _sizes_of(value: Any) -> Iterable[Any]:
    if isinstance(value, torch.Tensor):
        yield from value.shape
        yield from value.stride()
        yield value.storage_offset()
        yield value.untyped_storage().nbytes()
    elif isinstance(value, torch.SymInt):
        yield value
