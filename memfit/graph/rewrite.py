"""Rewrite a captured graph by a Plan: insert swap_out / swap_in / wait ops.

Original nodes keep their names (they are the CostGraph's op names); inserted nodes are named
``memfit_*``, since fx would otherwise rename an original to make room for a copy's name.

The new graph is built by walking ``lower(graph, plan).actions``, the same program order the
simulator predicts, so the rewritten program and the prediction are one sequence. A consumer that
a swap-in serves reads the swapped-in copy; where it read a *view* of the swapped storage (a
``t``, ``view`` or ``detach`` made in the forward pass), the view chain is replayed on the copy, so
the original storage really dies after its last forward use.

Every inserted node carries ``node.meta["memfit"]`` (its kind and tensor), so tests and renderers
can read what was inserted where.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import memfit.graph.ops  # noqa: F401  (registers torch.ops.memfit.*)
from memfit.core.costgraph import CostGraph
from memfit.core.plan import Plan, Swap
from memfit.core.recompute import lower_recompute
from memfit.core.schedule import Action, PlanError, lower
from memfit.graph.analyze import storage_key, tensors_in
from memfit.graph.rng import RNG_REPLAY_BEGIN, RNG_REPLAY_END, RNG_SAVE, is_random

REBUILT = -1  # the copy index of a recomputed tensor's rebuilt copy


def storage_owners(graph_module: fx.GraphModule) -> dict:
    """Storage -> tensor name, named exactly as ``analyze`` names them."""
    owner: dict = {}
    for node in graph_module.graph.nodes:
        allocated = 0
        for tensor in tensors_in(node.meta.get("val")):
            key = storage_key(tensor)
            if key not in owner:
                owner[key] = node.name if not allocated else f"{node.name}.{allocated}"
                allocated += 1
    return owner


def _is_whole(tensor: torch.Tensor) -> bool:
    """Whether a tensor covers its whole storage densely: copying it copies the storage."""
    size = tensor.numel() * tensor.element_size()
    return (
        tensor.storage_offset() == 0
        and size == tensor.untyped_storage().nbytes()
        and _dense(tensor)
    )


def _dense(tensor: torch.Tensor) -> bool:
    """Strides that tile the elements with no gap or overlap, in some dimension order."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Rewriter:
    """Builds the rewritten graph action by action (one instance per rewrite)."""

    def __init__(self, graph_module: fx.GraphModule, graph: CostGraph, plan: Plan):
        self.old = {node.name: node for node in graph_module.graph.nodes}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.owner = storage_owners(graph_module)
        self.swapped = sorted(plan.swapped, key=lambda name: graph.index[graph.tensors[name].producer])
        self.out_key = {name: key for key, name in enumerate(self.swapped)}
        self.graph_module = graph_module
        self.roots: dict[str, fx.Node] = {}
        for name in self.swapped:
            self.root_of(name)
        self.redirect: dict[tuple[str, str], int] = {}
        for name in self.swapped:
            decision = plan.decision(name)
            assert isinstance(decision, Swap)
            for copy, swap_in in enumerate(decision.swap_ins):
                for consumer in swap_in.consumers:
                    self.redirect[(consumer, name)] = copy
        self.host: dict[str, fx.Node] = {}
        self.copies: dict[tuple[str, int], fx.Node] = {}
        self.copy_key: dict[tuple[str, int], int] = {}
        self.replayed: dict[tuple[fx.Node, str, int], fx.Node] = {}
        recompute = lower_recompute(graph, plan)
        for consumer, renamed in recompute.redirect.items():
            for name in renamed:
                self.redirect[(consumer, name)] = REBUILT
        self.recomputed = set(plan.recomputed)
        self.outputs = {op.name: op.outputs for op in graph.ops}
        reruns = [op for op in recompute.reads if is_random(self.old[op])]
        self.rng_key = {op: key for key, op in enumerate(reruns)}

    def root_of(self, name: str) -> fx.Node:
        if name not in self.roots:
            self.roots[name] = self._root(self.graph_module, name)
        return self.roots[name]

    def _root(self, graph_module: fx.GraphModule, name: str) -> fx.Node:
        """The first node whose value is the whole storage of tensor ``name``: what gets copied."""
        for node in graph_module.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and self.owner.get(storage_key(value)) == name:
                if _is_whole(value):
                    return node
                break
        raise PlanError(
            f"tensor {name!r} has no node that covers its whole storage, so it cannot be swapped; "
            "exclude it (excl_types / excl_scopes) or keep it"
        )

    # ---- emitting nodes ------------------------------------------------------------------------

    def emit(self, node: fx.Node) -> fx.Node:
        """Copy an original node (once), reading swapped-in copies where the plan says."""
        if node in self.env:
            return self.env[node]
        new = self.graph.node_copy(node, lambda arg: self._arg(node, arg))
        self.env[node] = new
        return new

    def _arg(self, consumer: fx.Node, arg: fx.Node) -> fx.Node:
        for tensor in tensors_in(arg.meta.get("val")):
            name = self.owner.get(storage_key(tensor))
            copy = self.redirect.get((consumer.name, name)) if name else None
            if copy is not None:
                return self._replay(arg, name, copy)
        return self.emit(arg) if arg not in self.env else self.env[arg]

    def _replay(self, node: fx.Node, name: str, copy: int) -> fx.Node:
        """``node`` (the swapped storage or a view of it) rebuilt on swapped-in copy ``copy``."""
        if node is self.root_of(name):
            return self.copies[(name, copy)]
        memo = (node, name, copy)
        if memo in self.replayed:
            return self.replayed[memo]
        base = next((a for a in node.all_input_nodes if self._holds(a, name)), None)
        if node.op != "call_function" or base is None:
            raise PlanError(
                f"cannot swap {name!r}: {node.name} reads it without being a view of "
                f"{self.root_of(name).name}; keep this tensor"
            )
        new_base = self._replay(base, name, copy)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: new_base if a is base else self.env[a])
        replayed = self.graph.create_node("call_function", node.target, args, kwargs,
                                          name=f"memfit_{node.name}_on_copy{copy}")
        replayed.meta = {**node.meta, "memfit": {"kind": "view_replay", "tensor": name, "copy": copy}}
        self.replayed[memo] = replayed
        return replayed

    def _holds(self, node: fx.Node, name: str) -> bool:
        return any(self.owner.get(storage_key(t)) == name for t in tensors_in(node.meta.get("val")))

    def _call(self, op, args: tuple, kind: str, name: str, copy: int = -1) -> fx.Node:
        # a memfit_ prefix never collides with an original name, which must survive unchanged
        node = self.graph.create_node("call_function", op, args, name=f"memfit_{kind}")
        node.meta["memfit"] = {"kind": kind, "tensor": name, "copy": copy}
        return node

    # ---- actions -------------------------------------------------------------------------------

    def run(self, action: Action) -> None:
        ops = torch.ops.memfit
        if action.kind == "compute":
            if action.op in self.rng_key:  # a random op re-run later: remember its state
                node = self.old[action.op]
                self._call(RNG_SAVE, (self._anchor(node, self.env.get), self.rng_key[action.op]),
                           "rng_save", action.op)
            self.emit(self.old[action.op])
        elif action.kind == "recompute":
            self._rerun(self.old[action.op])
        elif action.kind == "swap_out":
            root = self.emit(self.roots[action.tensor])
            args = (root, self.out_key[action.tensor])
            self.host[action.tensor] = self._call(ops.swap_out.default, args, "swap_out", action.tensor)
        elif action.kind == "swap_in":
            key = len(self.copy_key)
            self.copy_key[(action.tensor, action.copy)] = key
            device = self.roots[action.tensor].meta["val"].device
            args = (self.host[action.tensor], self.out_key[action.tensor], key, device)
            node = self._call(ops.swap_in.default, args, "swap_in", action.tensor, action.copy)
            self.copies[(action.tensor, action.copy)] = node
        elif action.kind == "wait":
            copy = (action.tensor, action.copy)
            args = (self.copies[copy], self.copy_key[copy])
            self._call(ops.wait.default, args, "wait", action.tensor, action.copy)


    # ---- recomputation -------------------------------------------------------------------------

    def _rerun(self, node: fx.Node) -> None:
        """Re-run a forward op on rebuilt inputs and register its rebuilt outputs."""

        def read(arg: fx.Node) -> fx.Node:
            for tensor in tensors_in(arg.meta.get("val")):
                name = self.owner.get(storage_key(tensor))
                if name in self.recomputed and (name, REBUILT) in self.copies:
                    return self._replay(arg, name, REBUILT)
            return self.emit(arg)

        args, kwargs = fx.map_arg((node.args, node.kwargs), read)
        key = self.rng_key.get(node.name)
        anchor = self._anchor(node, read) if key is not None else None
        if key is not None:
            self._call(RNG_REPLAY_BEGIN, (anchor, key), "rng_replay_begin", node.name)
        clone = self.graph.create_node("call_function", node.target, args, kwargs,
                                       name=f"memfit_recompute_{node.name}")
        clone.meta = {**node.meta, "memfit": {"kind": "recompute", "tensor": node.name, "copy": -1}}
        if key is not None:
            self._call(RNG_REPLAY_END, (anchor, key), "rng_replay_end", node.name)
        for name in self.outputs[node.name]:
            if name in self.recomputed:
                self.copies[(name, REBUILT)] = self._rebuilt_root(node, clone, name)

    def _rebuilt_root(self, node: fx.Node, clone: fx.Node, name: str) -> fx.Node:
        """The re-run's counterpart of the node that covers ``name``'s whole storage."""
        root = self.root_of(name)
        if root is node:
            return clone
        if root.target is operator.getitem and root.args[0] is node:
            item = self.graph.create_node("call_function", operator.getitem, (clone, root.args[1]),
                                          name=f"memfit_{root.name}_rebuilt")
            item.meta = {**root.meta, "memfit": {"kind": "recompute", "tensor": name, "copy": -1}}
            return item
        raise PlanError(f"cannot recompute {name!r}: its storage is not an output of {node.name}")

    @staticmethod
    def _anchor(node: fx.Node, lookup) -> fx.Node:
        """A tensor input of ``node`` (mapped by ``lookup``) that orders and places the rng ops."""
        for arg in node.all_input_nodes:
            if isinstance(arg.meta.get("val"), torch.Tensor):
                return lookup(arg)
        raise PlanError(f"{node.name} has no tensor input to anchor its random state on")


def rewrite(graph_module: fx.GraphModule, graph: CostGraph, plan: Plan) -> fx.GraphModule:
    """A new GraphModule that runs ``graph_module`` with ``plan``'s swaps.

    Raises:
        PlanError: if the plan does not fit the graph, or asks to swap a storage the graph only
            reads through non-view ops.
    """
    schedule = lower(graph, plan)
    rewriter = _Rewriter(graph_module, graph, plan)
    for node in graph_module.graph.nodes:  # inputs and constants first, in their order
        if node.op in ("placeholder", "get_attr"):
            rewriter.emit(node)
    for action in schedule.actions:
        rewriter.run(action)
    output = graph_module.graph.find_nodes(op="output")[0]
    rewriter.emit(output)
    rewriter.graph.lint()
    return fx.GraphModule(graph_module, rewriter.graph)
