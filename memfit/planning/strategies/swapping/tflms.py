"""TFLMS (Le et al.): swap long-lived activations to host memory by graph rewriting.

The passes read like the paper (sections 4 and 5):

1. **candidates**: forward-produced tensors, not step outputs, reachable by a breadth-first search
   over forward ops from the starting ops (``starting_scope`` / ``starting_op_names``, by default
   the graph entry), in BFS order (ties by execution order);
2. **filter**: ``excl_scopes`` / ``excl_types`` remove a producer, a non-empty ``incl_scopes`` /
   ``incl_types`` keeps only theirs (includes restrict, excludes win);
3. **rewrite**: an edge producer -> consumer is rewritten when the consumer is a backward op more
   than ``threshold`` ops later (with ``swap_branches``, also a forward op more than
   ``branch_threshold`` ops later); a tensor with no rewritten edge is kept; the first
   ``n_tensors`` rewritten tensors are swapped;
4. **swap-ins**: one per rewritten consumer, or (``fuse_swapins``) one per run of consumers each
   within ``fuse_distance`` ops of the previous one; swap-outs are always fused (one per tensor);
5. **control ops**: direct-order or chain-rule within ``[lb, ub]`` (``_swap_control``);
6. **tune** (only with a budget): ``n_tensors``, ``lb`` and ``swap_branches`` (``_swap_tune``).

Note:
    Where the paper is vague, memfit decides as follows. A rewritten consumer that runs before the
    tensor's last non-rewritten consumer reads the original instead: the original is still on the
    device then, and a copy would only add memory. A control op must run at or after the last
    read of the original (so the two buffers never coexist) and before its first consumer; the
    search result is clamped to that, and when the search finds nothing in ``[lb, ub]`` the swap-in
    is issued right before its first consumer (the latest possible swap-in). Each decision's
    reason says which of these happened. ``n_tensors`` counts tensors actually swapped (as
    TFLMS's code does), and ``n_tensors=0`` swaps nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from numbers import Integral

from memfit.data.costgraph import CostGraph, Op
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.model.host_memory import host_prefix
from memfit.model.plan_memo import remembered_result
from memfit.planning.strategies import register
from memfit.planning.strategies._budget_checks import host_params
from memfit.planning.strategies.swapping._swap_config import SwapConfig
from memfit.planning.strategies.swapping._swap_control import OpGraph, control_op
from memfit.planning.strategies.swapping._swap_tune import tune


@register("swap", config=SwapConfig)
def plan(graph: CostGraph, hardware: Hardware, budget_bytes: int | None = None, **params) -> Plan:
    """Swap activations to host memory as TFLMS does; with a budget, tune it to fit.

    Args:
        graph: the captured step.
        hardware: the device profile; the tuner simulates candidate plans on it.
        budget_bytes: device bytes the step may use at its peak. ``None``: apply ``params`` as
            given (swapping the first tensors that ``hardware.host_bytes`` holds). Otherwise ``n_tensors``, ``lb`` and ``swap_branches`` are tuned unless given,
            and the fastest simulated plan that fits is returned.
        **params: the fields of ``SwapConfig`` (TFLMS's Table 2), each with its default there.

    Raises:
        ValueError: for an unknown parameter, a bad value, or a start that names no forward op.
        BudgetError: if no plan fits ``budget_bytes``; it reports the smallest peak reached.

    Example:
        >>> from memfit.data.hardware import get_hardware
        >>> from memfit.model.synthetic import chain
        >>> result = plan(chain(8), get_hardware("h100-pcie"), lb=3, ctrld_strategy="direct_order")
        >>> result.decision("f0").swap_ins[0].after  # 3 ops before f1_backward, f0's reader
        'f4_backward'
    """
    if budget_bytes is not None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, Integral) \
                or budget_bytes <= 0:
            raise ValueError(f"swap: budget_bytes must be a positive int or None (parse '11GiB' "
                             f"with memfit.data.units.parse_bytes), got {budget_bytes!r}")
        budget_bytes = int(budget_bytes)
    config = SwapConfig.from_params(params)
    planner = remembered_result("swap planner", (graph, hardware), None,
                                lambda: _Planner(graph, hardware))
    if budget_bytes is None:  # as given, up to what the host holds (hardware.host_bytes)
        decisions = planner.decisions(config)
        held = host_prefix(graph, decisions, hardware.host_bytes)
        made = planner.make_plan(config, decisions[:held], None)
        dropped = tuple(name for name, _ in decisions[held:])
        return replace(made, params={**made.params, **host_params(dropped)})
    return tune(graph, hardware, budget_bytes, config, frozenset(params), planner.decisions,
                lambda used, decisions: planner.make_plan(used, decisions, budget_bytes))


@dataclass(frozen=True)
class _Rewrite:
    """A candidate tensor with its rewritten consumers grouped into swap-ins (all by index)."""

    tensor: str
    producer: int
    floor: int  # the last op that reads the original (its producer if none)
    groups: tuple[tuple[int, ...], ...]
    saved_for: str  # "backward" or "forward branch"


class _Planner:
    """The passes over one graph, which no budget changes: rewrites are cached per filter
    setting and decisions per setting, so tuning reuses them, and inside
    ``memfit.model.plan_memo.plans_remembered`` so do the tunings at other budgets (``auto``'s
    what-if budgets). The lists it returns are shared: callers slice them, never change them."""

    def __init__(self, graph: CostGraph, hardware: Hardware):
        self.graph, self.hardware = graph, hardware
        self.ops = OpGraph(graph)
        self._rewrites: dict[SwapConfig, list[_Rewrite]] = {}
        self._decisions: dict[SwapConfig, list[tuple[str, Swap]]] = {}

    def decisions(self, config: SwapConfig) -> list[tuple[str, Swap]]:
        """Every tensor that ``config`` swaps, in BFS order (``n_tensors`` applied)."""
        if config not in self._decisions:
            rewrites = self.rewrites(config)
            if config.n_tensors >= 0:
                rewrites = rewrites[: config.n_tensors]
            self._decisions[config] = [(r.tensor, self.swap(r, config)) for r in rewrites]
        return self._decisions[config]

    def make_plan(self, config: SwapConfig, decisions: Iterable[tuple[str, Swap]],
                  budget_bytes: int | None) -> Plan:
        return Plan("swap", dict(decisions), graph_hash=self.graph.structure_hash,
                    params=config.params(), budget_bytes=budget_bytes,
                    hardware=self.hardware.name)

    # ---- candidates -> filter -> order -> rewrite ------------------------------------------------

    def rewrites(self, config: SwapConfig) -> list[_Rewrite]:
        key = replace(config, n_tensors=-1, lb=0, ub=0, ctrld_strategy="chain_rule")
        if key not in self._rewrites:
            selected = _selector(config)
            found = []
            for op in _bfs_forward(self.ops, _start_ops(self.graph, config)):
                for tensor in op.outputs if selected(op) else ():
                    rewrite = self.rewrite(tensor, config)
                    if rewrite is not None:
                        found.append(rewrite)
            self._rewrites[key] = found
        return self._rewrites[key]

    def rewrite(self, tensor_name: str, config: SwapConfig) -> _Rewrite | None:
        """The rewritten edges of one tensor (``None`` when it has none: it is kept)."""
        tensor = self.graph.tensors[tensor_name]
        if tensor.producer is None or tensor.is_output:
            return None
        producer = self.ops.index[tensor.producer]
        rewritten, kept = [], [producer]
        for consumer in map(self.ops.index.__getitem__, tensor.consumers):
            phase, distance = self.ops.phase[consumer], consumer - producer
            if (phase == "backward" and distance > config.threshold) or (
                    phase == "forward" and config.swap_branches
                    and distance > config.branch_threshold):
                rewritten.append(consumer)
            else:
                kept.append(consumer)
        floor = max(kept)
        rewritten = [c for c in rewritten if c > floor]  # earlier ones read the live original
        if not rewritten:
            return None
        saved_for = "backward" if self.ops.phase[rewritten[0]] == "backward" else "forward branch"
        return _Rewrite(tensor_name, producer, floor, _groups(rewritten, config), saved_for)

    # ---- control ops -----------------------------------------------------------------------------

    def swap(self, rewrite: _Rewrite, config: SwapConfig) -> Swap:
        ops = self.graph.ops
        swap_ins: list[SwapIn] = []
        hows: list[str] = []
        for group in rewrite.groups:
            control = control_op(self.ops, config.ctrld_strategy, rewrite.producer, rewrite.floor,
                                 group[0], config.lb, config.ub)
            swap_ins.append(SwapIn(ops[control.index].name, tuple(ops[c].name for c in group)))
            hows.append(control.how)
        first = rewrite.groups[0][0]
        reason = (f"saved for {rewrite.saved_for}, {first - rewrite.producer} ops apart; "
                  + _control_note(ops[first].name, self.graph.op(swap_ins[0].after), hows[0], config)
                  + _more_note(hows[1:], config))
        return Swap(tuple(swap_ins), reason=reason)


def _more_note(hows: list[str], config: SwapConfig) -> str:
    """``"; 2 more swap-ins: 1 by chain_rule, 1 latest possible"`` (empty for none)."""
    if not hows:
        return ""
    counts = Counter(hows)
    words = {"found": f"by {config.ctrld_strategy}", "clamped": "clamped",
             "fallback": "latest possible"}
    return f"; {len(hows)} more swap-in{'s' if len(hows) > 1 else ''}: " + ", ".join(
        f"{counts[how]} {word}" for how, word in words.items() if counts[how])


def _control_note(consumer: str, after: Op, how: str, config: SwapConfig) -> str:
    where = f"swap-in after {after.name} ({after.kind})"
    if how == "found":
        return f"{where} at lb={config.lb} ({config.ctrld_strategy})"
    if how == "clamped":
        return f"{where}, the original's last use ({config.ctrld_strategy} chose an earlier op)"
    return (f"{where}, right before {consumer}: {config.ctrld_strategy} found no control op "
            f"in [lb={config.lb}, ub={config.ub}]")


def _groups(consumers: list[int], config: SwapConfig) -> tuple[tuple[int, ...], ...]:
    """One swap-in per consumer, or with fusing one per run of consumers ``fuse_distance`` apart."""
    if not config.fuse_swapins:
        return tuple((c,) for c in consumers)
    groups = [[consumers[0]]]
    for consumer in consumers[1:]:
        if consumer - groups[-1][-1] <= config.fuse_distance:
            groups[-1].append(consumer)
        else:
            groups.append([consumer])
    return tuple(tuple(g) for g in groups)


# ---- the start, the breadth-first order, the filters ---------------------------------------------


def _start_ops(graph: CostGraph, config: SwapConfig) -> list[Op]:
    """Forward ops the search starts from: those named, else the entry (no forward dependency)."""
    forward = graph.forward_ops
    if config.starting_scope is None and not config.starting_op_names:
        is_forward = {op.name for op in forward}
        return [op for op in forward if not any(d in is_forward for d in op.depends_on)]
    unknown = [n for n in config.starting_op_names if n not in graph.index]
    if unknown:
        raise ValueError(f"swap: starting_op_names {unknown} are not ops of this graph")
    named = set(config.starting_op_names)
    starts = [op for op in forward if op.name in named
              or (config.starting_scope is not None and _in_scopes(op.scope, (config.starting_scope,)))]
    if not starts:
        raise ValueError(f"swap: starting_scope={config.starting_scope!r} / starting_op_names="
                         f"{list(config.starting_op_names)} name no forward op: give a module path "
                         "glob such as 'layers.0*' or forward op names")
    return starts


def _bfs_forward(ops: OpGraph, starts: list[Op]) -> list[Op]:
    """Forward ops reachable from ``starts``, level by level, each level in execution order."""
    level = sorted({ops.index[op.name] for op in starts})
    seen, order = set(level), []
    while level:
        order += level
        following = {u for op in level for u in ops.forward_users[op] if u not in seen}
        seen |= following
        level = sorted(following)
    return [ops.graph.ops[i] for i in order]


def _selector(config: SwapConfig) -> Callable[[Op], bool]:
    """Whether an op's outputs may be swapped: excludes win, a non-empty include list restricts."""
    incl_kinds = {_normal_kind(t) for t in config.incl_types}
    excl_kinds = {_normal_kind(t) for t in config.excl_types}

    def selected(op: Op) -> bool:
        kind = _normal_kind(op.kind)
        if _in_scopes(op.scope, config.excl_scopes) or kind in excl_kinds \
                or op.module_type in config.excl_types:
            return False
        if not (config.incl_scopes or config.incl_types):
            return True
        return (_in_scopes(op.scope, config.incl_scopes) or kind in incl_kinds
                or op.module_type in config.incl_types)

    return selected


def _normal_kind(kind: str) -> str:
    """``"mm"``, ``"aten.mm"`` and ``"aten.mm.default"`` all name ``"aten.mm"``."""
    parts = kind.split(".")
    return f"aten.{kind}" if len(parts) == 1 else ".".join(parts[:2])


def _in_scopes(scope: str, globs: Iterable[str]) -> bool:
    """A glob matches a module path and everything under it (``"h.1"`` matches ``"h.1.attn"``)."""
    return any(fnmatchcase(scope, g) or fnmatchcase(scope, g + ".*") for g in globs)
