"""Synthetic training graphs for tests and benchmarks: chains, towers, residual nets, random DAGs.

``from_forward`` turns a forward DAG into the joint forward+backward graph that autograd would
run: each forward op ``v`` reads a weight and saves its inputs; its backward op reads those saved
inputs and the gradient of ``v``, and writes one gradient per input plus the weight's gradient (a
step output). Gradients of a value with several consumers are summed by an accumulation op.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from memfit.data.costgraph import CostGraph, Op, Tensor


@dataclass(frozen=True)
class Node:
    """One forward op: its name, the forward ops it reads, its output size and its run time."""

    name: str
    inputs: tuple[str, ...]
    size_bytes: int = 1 << 20
    time_s: float = 1e-3
    kind: str = "aten.mm"
    scope: str = ""


def from_forward(nodes: Sequence[Node], input_bytes: int = 1 << 20, weight_bytes: int = 1 << 10,
                 name: str = "synthetic") -> CostGraph:
    """The joint graph of a forward DAG given in execution order.

    A node with no inputs reads the graph input ``x``; nodes no other node reads feed the loss.
    """
    ops: list[Op] = []
    tensors: list[Tensor] = [Tensor("x", input_bytes, "input")]
    size = {"x": input_bytes}
    readers: dict[str, list[str]] = {"x": []}
    for node in nodes:
        sources = node.inputs or ("x",)
        for source in sources:
            readers[source].append(node.name)
        weight = f"w_{node.name}"
        tensors += [Tensor(weight, weight_bytes, "parameter"),
                    Tensor(node.name, node.size_bytes, "activation")]
        size[node.name] = node.size_bytes
        readers[node.name] = []
        depends = tuple(s for s in sources if s != "x")
        ops.append(Op(node.name, node.kind, "forward", node.scope, inputs=(*sources, weight),
                      outputs=(node.name,), depends_on=depends, time_s=node.time_s))
    sinks = [n.name for n in nodes if not readers[n.name]]
    tensors += [Tensor("loss", 4, "activation", is_output=True)]
    ops.append(Op("loss", "aten.sum", "forward", inputs=tuple(sinks), outputs=("loss",),
                  depends_on=tuple(sinks), time_s=1e-5))
    # gradient contributions to each value, filled in reverse order
    contributions: dict[str, list[tuple[str, str]]] = {s: [] for s in size}
    for sink in sinks:
        grad = f"d{sink}@loss"
        tensors.append(Tensor(grad, size[sink], "gradient"))
        contributions[sink].append((grad, "loss_backward"))
    ops.append(Op("loss_backward", "aten.expand", "backward", inputs=("loss",),
                  outputs=tuple(f"d{s}@loss" for s in sinks), depends_on=("loss",), time_s=1e-5))
    for node in reversed(nodes):
        grad, grad_op = _accumulate(node.name, contributions[node.name], size, ops, tensors)
        sources = node.inputs or ("x",)
        outputs = [f"dw_{node.name}"]
        tensors.append(Tensor(f"dw_{node.name}", weight_bytes, "gradient", is_output=True))
        for source in sources:
            if source == "x":
                continue
            part = f"d{source}@{node.name}"
            tensors.append(Tensor(part, size[source], "gradient"))
            contributions[source].append((part, f"{node.name}_backward"))
            outputs.append(part)
        saved = tuple(s for s in sources)  # the op saved its inputs for backward
        ops.append(Op(f"{node.name}_backward", f"{node.kind}_backward", "backward", node.scope,
                      inputs=(grad, *saved, f"w_{node.name}"), outputs=tuple(outputs),
                      depends_on=(grad_op, *(s for s in saved if s != "x")),
                      time_s=2 * node.time_s))
    return CostGraph.build(ops, tensors, name=name)


def _accumulate(value: str, parts: list[tuple[str, str]], size: dict[str, int], ops: list[Op],
                tensors: list[Tensor]) -> tuple[str, str]:
    """Sum the gradient contributions to ``value``; returns (gradient tensor, op producing it)."""
    if len(parts) == 1:
        return parts[0]
    total = f"d{value}"
    tensors.append(Tensor(total, size[value], "gradient"))
    ops.append(Op(f"{value}_grad_sum", "aten.add", "backward", inputs=tuple(p for p, _ in parts),
                  outputs=(total,), depends_on=tuple(dict.fromkeys(o for _, o in parts)),
                  time_s=1e-5))
    return total, f"{value}_grad_sum"


def chain(length: int, size_bytes: int = 1 << 20, time_s: float = 1e-3, **kw) -> CostGraph:
    """A chain of ``length`` forward ops (an MLP): the pebble game's and TFLMS's basic case."""
    nodes = [Node(f"f{i}", (f"f{i - 1}",) if i else (), size_bytes, time_s, scope=f"layers.{i}")
             for i in range(length)]
    return from_forward(nodes, name=f"chain{length}", **kw)


def multi_tower(towers: int, depth: int, size_bytes: int = 1 << 20, **kw) -> CostGraph:
    """``towers`` parallel chains of ``depth`` ops from one stem, joined at the end."""
    nodes = [Node("stem", (), size_bytes, scope="stem")]
    for t in range(towers):
        for d in range(depth):
            source = f"t{t}_{d - 1}" if d else "stem"
            nodes.append(Node(f"t{t}_{d}", (source,), size_bytes, scope=f"tower{t}.{d}"))
    nodes.append(Node("join", tuple(f"t{t}_{depth - 1}" for t in range(towers)), size_bytes,
                      kind="aten.cat", scope="join"))
    return from_forward(nodes, name=f"towers{towers}x{depth}", **kw)


def resnet_like(blocks: int, size_bytes: int = 1 << 20, **kw) -> CostGraph:
    """Residual blocks: conv, conv, add(skip): every block input is read again at its end."""
    nodes = [Node("stem", (), size_bytes, kind="aten.convolution", scope="stem")]
    previous = "stem"
    for b in range(blocks):
        scope = f"layer.{b}"
        nodes += [
            Node(f"b{b}_conv1", (previous,), size_bytes, kind="aten.convolution", scope=scope),
            Node(f"b{b}_relu", (f"b{b}_conv1",), size_bytes, 2e-4, "aten.relu", scope),
            Node(f"b{b}_conv2", (f"b{b}_relu",), size_bytes, kind="aten.convolution", scope=scope),
            Node(f"b{b}_add", (f"b{b}_conv2", previous), size_bytes, 2e-4, "aten.add", scope),
        ]
        previous = f"b{b}_add"
    return from_forward(nodes, name=f"resnet{blocks}", **kw)


def random_dag(size: int, seed: int = 0, max_inputs: int = 3, **kw) -> CostGraph:
    """A random forward DAG of ``size`` ops with random sizes and times (fixed by ``seed``)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(size):
        count = rng.randint(1, max_inputs) if i else 0
        inputs = tuple(sorted({f"v{rng.randrange(i)}" for _ in range(count)})) if i else ()
        nodes.append(Node(f"v{i}", inputs, rng.randint(1, 64) << 14, rng.uniform(1e-4, 2e-3),
                          rng.choice(["aten.mm", "aten.relu", "aten.add"]), f"block{i // 4}"))
    return from_forward(nodes, name=f"random{size}s{seed}", **kw)
