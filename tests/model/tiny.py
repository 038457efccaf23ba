"""A five-op training step small enough to check every number by hand.

``a = x @ w; b = f(a); loss = g(b)`` forward, then ``db = dloss(loss, b)`` and
``dw = da(db, a)`` backward. Sizes are distinct so a sum of bytes names its buffers.
"""

from __future__ import annotations

from memfit.data.costgraph import CostGraph, Op, Tensor

SIZES = {"x": 1, "w": 2, "a": 100, "b": 200, "loss": 4, "db": 10, "dw": 20}
RESIDENT_BYTES = 3  # x and w


def tiny_ops() -> list[Op]:
    return [
        Op("a", "aten.mm", "forward", inputs=("x", "w"), outputs=("a",), time_s=1.0),
        Op("b", "aten.relu", "forward", inputs=("a",), outputs=("b",), depends_on=("a",), time_s=2.0),
        Op("c", "aten.sum", "forward", inputs=("b",), outputs=("loss",), depends_on=("b",), time_s=3.0),
        Op("d", "aten.relu_backward", "backward", inputs=("loss", "b"), outputs=("db",),
           depends_on=("c", "b"), time_s=4.0),
        Op("e", "aten.mm_backward", "backward", inputs=("db", "a"), outputs=("dw",),
           depends_on=("d", "a"), time_s=5.0),
    ]  # fmt: skip


def tiny_tensors() -> list[Tensor]:
    return [
        Tensor("x", SIZES["x"], "input"),
        Tensor("w", SIZES["w"], "parameter"),
        Tensor("a", SIZES["a"], "activation"),
        Tensor("b", SIZES["b"], "activation"),
        Tensor("loss", SIZES["loss"], "activation", is_output=True),
        Tensor("db", SIZES["db"], "gradient"),
        Tensor("dw", SIZES["dw"], "gradient", is_output=True),
    ]


def tiny_graph() -> CostGraph:
    return CostGraph.build(tiny_ops(), tiny_tensors(), name="tiny")
