"""Rewrite a captured graph by a Plan: insert swap_out / swap_in / wait ops.

Original nodes keep their names (they are the CostGraph's op names); inserted nodes are named
``memfit_*``, since fx would otherwise rename an original to make room for a copy's name.

The new graph is built by walking ``lower(graph, plan).actions``, the same program order the
simulator predicts, so the rewritten program and the prediction are one sequence. A consumer that
a swap-in serves reads the swapped-in copy (so does a re-run a swap-in feeds: a checkpoint brought
back from the host for recomputation); where it read a *view* of the swapped storage (a
``t``, ``view`` or ``detach`` made in the forward pass), the view chain is replayed on the copy, so
the original storage really dies after its last forward use.

Every inserted node carries ``node.meta["memfit"]`` (its kind and tensor), so tests and renderers
can read what was inserted where.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import memfit.ops.swap  # noqa: F401  (registers torch.ops.memfit.*)
from memfit.data.costgraph import CostGraph
from memfit.data.plan import Plan
from memfit.model.schedule import Action, PlanError, copy_buffer, lower
from memfit.ops.rng import RNG_REPLAY_BEGIN, RNG_REPLAY_END, RNG_SAVE, is_random
from memfit.tracing.analyze import storage_key, tensors_in


def storage_names(graph_module: fx.GraphModule) -> dict:
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


class _Rewriter:
    """Builds the rewritten graph action by action (one instance per rewrite).

    Every device buffer that is not an original storage (a swapped-in copy, a re-run's instance)
    maps to the fx node that plays its *root* (the node that first holds the storage; every other
    holder is a view of it); a reader gets, for each argument, the buffer its action reads, with
    any view chain replayed on it.
    """

    def __init__(self, graph_module: fx.GraphModule, graph: CostGraph, plan: Plan,
                 actions: tuple[Action, ...]):
        self.graph_module = graph_module
        self.cost = graph
        self.old = {node.name: node for node in graph_module.graph.nodes}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.owner = storage_names(graph_module)
        swapped = sorted(plan.swapped, key=lambda name: graph.index[graph.tensors[name].producer])
        self.out_key = {name: key for key, name in enumerate(swapped)}
        self.roots: dict[str, fx.Node] = {}
        for name in swapped:
            self.root_of(name)
        self.buffers: dict[str, fx.Node] = {}  # copy or instance buffer -> its root node
        self.host: dict[str, fx.Node] = {}
        self.copy_key: dict[str, int] = {}
        self.replayed: dict[tuple[fx.Node, str, str], fx.Node] = {}
        self.read_buffers = {buffer for action in actions for buffer in action.reads}
        rerun_ops = {a.op for a in actions if a.kind == "recompute"}
        self.random_reruns = {op for op in rerun_ops if is_random(self.old[op])}
        self.rng_state: dict[str, fx.Node] = {}  # random op -> the node holding its saved state
        self.reading: dict[str, str] = {}  # tensor -> buffer, for the action being emitted

    def root_of(self, name: str) -> fx.Node:
        """The first node whose value lies in tensor ``name``'s storage (``_roots``).

        Raises:
            PlanError: if no node's value lies in it.
        """
        if not self.roots:
            self.roots = _roots(self.graph_module, self.owner)
        if name not in self.roots:
            raise PlanError(f"tensor {name!r} is held by no tensor node of the graph; keep it")
        return self.roots[name]


    # ---- emitting nodes ------------------------------------------------------------------------

    def emit(self, node: fx.Node) -> fx.Node:
        """Copy an original node (once), its arguments read from the buffers its action reads."""
        if node in self.env:
            return self.env[node]
        new = self.graph.node_copy(node, self._arg)
        self.env[node] = new
        return new

    def _arg(self, arg: fx.Node) -> fx.Node:
        for tensor in tensors_in(arg.meta.get("val")):
            name = self.owner.get(storage_key(tensor))
            buffer = self.reading.get(name) if name else None
            if buffer is not None and buffer != name:
                return self._replay(arg, name, buffer)
        return self.emit(arg)

    def _replay(self, node: fx.Node, name: str, buffer: str) -> fx.Node:
        """``node`` (tensor ``name``'s storage or a view of it) rebuilt on device buffer ``buffer``."""
        if node is self.root_of(name):
            return self.buffers[buffer]
        memo = (node, name, buffer)
        if memo in self.replayed:
            return self.replayed[memo]
        base = next((a for a in node.all_input_nodes if self._holds(a, name)), None)
        if node.op != "call_function" or base is None:
            raise PlanError(
                f"cannot swap or recompute {name!r}: {node.name} reads it without being a view of "
                f"{self.root_of(name).name}; keep this tensor"
            )
        new_base = self._replay(base, name, buffer)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: new_base if a is base else self.env[a])
        replayed = self.graph.create_node("call_function", node.target, args, kwargs,
                                          name=f"memfit_{node.name}_view")
        replayed.meta = {**node.meta, "memfit": {"kind": "view_replay", "tensor": name,
                                                 "buffer": buffer}}
        self.replayed[memo] = replayed
        return replayed

    def _holds(self, node: fx.Node, name: str) -> bool:
        return any(self.owner.get(storage_key(t)) == name for t in tensors_in(node.meta.get("val")))

    def _call(self, op, args: tuple, kind: str, name: str, buffer: str = "") -> fx.Node:
        # a memfit_ prefix never collides with an original name, which must survive unchanged
        node = self.graph.create_node("call_function", op, args, name=f"memfit_{kind}")
        node.meta["memfit"] = {"kind": kind, "tensor": name, "buffer": buffer}
        return node

    # ---- actions -------------------------------------------------------------------------------

    def run(self, action: Action) -> None:
        ops = torch.ops.memfit
        if action.kind in ("compute", "recompute"):
            self.reading = dict(zip(self.cost.op(action.op).inputs, action.reads, strict=True))
        if action.kind == "compute":
            if action.op in self.random_reruns:  # a random op re-run later: remember its state
                anchor = self._anchor(self.old[action.op], self._arg)
                self.rng_state[action.op] = self._call(RNG_SAVE, (anchor,), "rng_save", action.op)
            self.emit(self.old[action.op])
        elif action.kind == "recompute":
            self._rerun(self.old[action.op], action)
        elif action.kind == "swap_out":
            root = self.emit(self.root_of(action.tensor))
            args = (root, self.out_key[action.tensor], self._strides(root, action.tensor))
            self.host[action.tensor] = self._call(ops.swap_out.default, args, "swap_out", action.tensor)
        elif action.kind == "swap_in":
            buffer = copy_buffer(action.tensor, action.copy)
            self.copy_key[buffer] = len(self.copy_key)
            device = self.root_of(action.tensor).meta["val"].device
            args = (self.host[action.tensor], self.out_key[action.tensor], self.copy_key[buffer], device)
            self.buffers[buffer] = self._call(ops.swap_in.default, args, "swap_in", action.tensor, buffer)
        elif action.kind == "wait":
            buffer = copy_buffer(action.tensor, action.copy)
            args = (self.buffers[buffer], self.copy_key[buffer])
            self._call(ops.wait.default, args, "wait", action.tensor, buffer)
        self.reading = {}

    def _strides(self, root: fx.Node, name: str) -> list:
        """The strides a swap-out of ``root`` lays its host copy out with: the graph's, each
        symbolic one as an ``aten.sym_stride`` node (the size it evaluates to at run).

        Under a compiler that lays values out as it likes (inductor), only these keep the host
        copy in the layout the backward was traced with: a copy in the layout the value ran in
        is copied again on the device where the two differ, and that device copy is what the
        forward saves."""
        strides: list = []
        for dim, step in enumerate(root.meta["val"].stride()):
            if isinstance(step, torch.SymInt):
                node = self.graph.create_node("call_function", torch.ops.aten.sym_stride.int,
                                              (root, dim), name="memfit_swap_out_stride")
                node.meta = {"val": step, "memfit": {"kind": "swap_out_stride", "tensor": name,
                                                     "buffer": ""}}
                strides.append(node)
            else:
                strides.append(step)
        return strides

    # ---- recomputation -------------------------------------------------------------------------

    def _rerun(self, node: fx.Node, action: Action) -> None:
        """Re-run a forward op on the buffers it reads; register the instances others read."""
        args, kwargs = fx.map_arg((node.args, node.kwargs), self._arg)
        random = node.name in self.random_reruns
        anchor = self._anchor(node, self._arg) if random else None
        if random:
            stashed = self._call(RNG_REPLAY_BEGIN, (anchor, self.rng_state[node.name]),
                                 "rng_replay_begin", node.name)
        clone = self.graph.create_node("call_function", node.target, args, kwargs,
                                       name=f"memfit_recompute_{node.name}")
        clone.meta = {**node.meta, "memfit": {"kind": "recompute", "tensor": node.name,
                                              "buffer": ",".join(action.allocates)}}
        if random:
            self._call(RNG_REPLAY_END, (anchor, stashed), "rng_replay_end", node.name)
        outputs = self.cost.op(node.name).outputs
        for name, buffer in zip(outputs, action.allocates, strict=True):
            if buffer in self.read_buffers:
                self.buffers[buffer] = self._rebuilt_root(node, clone, name, buffer)

    def _rebuilt_root(self, node: fx.Node, clone: fx.Node, name: str, buffer: str) -> fx.Node:
        """The re-run's counterpart of the node that covers ``name``'s whole storage."""
        root = self.root_of(name)
        if root is node:
            return clone
        if root.target is operator.getitem and root.args[0] is node:
            item = self.graph.create_node("call_function", operator.getitem, (clone, root.args[1]),
                                          name=f"memfit_{root.name}_rebuilt")
            item.meta = {**root.meta, "memfit": {"kind": "recompute", "tensor": name,
                                                 "buffer": buffer}}
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
    rewriter = _Rewriter(graph_module, graph, plan, schedule.actions)
    for node in graph_module.graph.nodes:  # inputs and constants first, in their order
        if node.op in ("placeholder", "get_attr"):
            rewriter.emit(node)
    for action in schedule.actions:
        rewriter.run(action)
    output = graph_module.graph.find_nodes(op="output")[0]
    rewriter.emit(output)
    rewriter.graph.lint()
    return fx.GraphModule(graph_module, rewriter.graph)


def reorder(graph_module: fx.GraphModule, order: list[str] | tuple[str, ...]) -> fx.GraphModule:
    """A new GraphModule whose ``call_function`` nodes run in ``order`` (fx node order is the
    program order, so this is how a reordered ``CostGraph`` becomes the program).

    Inputs and constants come first in their order, the output last; every node keeps its name
    and ``meta`` (the fake values ``analyze`` sizes storages by).

    Raises:
        PlanError: if ``order`` does not name each ``call_function`` node once, or puts a node
            before one it reads.
    """
    nodes = {node.name: node for node in graph_module.graph.nodes}
    calls = [node.name for node in graph_module.graph.nodes if node.op == "call_function"]
    if sorted(order) != sorted(calls):
        raise PlanError("a new order must name every call_function node of the graph once")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            raise PlanError(f"the new order runs a reader of {node.name} before it")
        return env[node]

    head = [node for node in graph_module.graph.nodes if node.op in ("placeholder", "get_attr")]
    for node in (*head, *(nodes[name] for name in order)):
        env[node] = graph.node_copy(node, lookup)
    graph.node_copy(graph_module.graph.find_nodes(op="output")[0], lookup)
    graph.lint()
    return fx.GraphModule(graph_module, graph)


def _roots(graph_module: fx.GraphModule, owner: dict) -> dict[str, fx.Node]:
    """Per tensor, the first node whose value lies in its storage (``owner``: storage key ->
    tensor name): its producer's output, or the ``getitem`` that takes it from a tuple. Every
    later holder is a view of it. One pass over the nodes, for every tensor at once.

    The root need not cover its storage: ``aten.copy`` into a slice keeps the slice's gapped
    strides, ``slice_scatter`` into a slice its offset. A re-run of the producer lays the
    storage out again as the original run did, and a swap moves the whole storage with the
    root's layout (``memfit::swap_out``), so readers and views see what they saw before.
    """
    roots: dict[str, fx.Node] = {}
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            name = owner.get(storage_key(value))
            if name is not None and name not in roots:
                roots[name] = node
    return roots
