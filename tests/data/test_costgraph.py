"""CostGraph.build checks and derivations, identity and JSON, on the hand-checked tiny step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.model import synthetic
from tests.model.tiny import RESIDENT_BYTES, tiny_graph, tiny_ops, tiny_tensors


def build_with(ops=None, tensors=None) -> CostGraph:
    return CostGraph.build(
        tiny_ops() if ops is None else ops, tiny_tensors() if tensors is None else tensors
    )


def replace_op(op_name: str, **changes) -> list[Op]:
    return [replace(op, **changes) if op.name == op_name else op for op in tiny_ops()]


@pytest.mark.parametrize(
    "ops, tensors, message",
    [
        (replace_op("b", inputs=("zz",)), None, "op 'b' names unknown tensor 'zz'"),
        (replace_op("b", outputs=("zz",)), None, "op 'b' names unknown tensor 'zz'"),
        (replace_op("a", depends_on=("b",)), None, "op 'a' depends on 'b', which runs later"),
        (replace_op("b", depends_on=("b",)), None, "op 'b' depends on 'b', which runs later"),
        (replace_op("b", depends_on=("zz",)), None, "op 'b' depends on unknown op 'zz'"),
        (replace_op("b", inputs=("a", "db")), None, "op 'b' reads 'db' before it is allocated"),
        (replace_op("b", outputs=("a",)), None, "tensor 'a' is allocated twice"),
        (replace_op("b", name="a"), None, "op names must be unique"),
        (None, [*tiny_tensors(), Tensor("a", 1, "activation")], "tensor names must be unique"),
        (
            None,
            [
                Tensor("a", 100, "activation", producer="b") if t.name == "a" else t
                for t in tiny_tensors()
            ],
            "tensor 'a' names producer 'b', but 'a' makes it",
        ),
    ],
    ids=[
        "unknown-input",
        "unknown-output",
        "later-dependency",
        "self-dependency",
        "unknown-dependency",
        "read-before-alloc",
        "double-alloc",
        "duplicate-op",
        "duplicate-tensor",
        "wrong-producer",
    ],
)
def test_build_rejects_with_a_useful_message(ops, tensors, message):
    with pytest.raises(ValueError, match=message):
        build_with(ops, tensors)


def test_build_derives_producers_and_consumers():
    graph = tiny_graph()
    derived = {name: (t.producer, t.consumers) for name, t in graph.tensors.items()}
    assert derived == {
        "x": (None, ("a",)),
        "w": (None, ("a",)),
        "a": ("a", ("b", "e")),
        "b": ("b", ("c", "d")),
        "loss": ("c", ("d",)),
        "db": ("d", ("e",)),
        "dw": ("e", ()),
    }


def test_lookups():
    graph = tiny_graph()
    assert dict(graph.index) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    assert graph.op("c").outputs == ("loss",)
    assert dict(graph.users) == {
        "a": ("b", "e"),
        "b": ("c", "d"),
        "c": ("d",),
        "d": ("e",),
        "e": (),
    }
    assert graph.resident_bytes == RESIDENT_BYTES
    assert [op.name for op in graph.forward_ops] == ["a", "b", "c"]
    assert graph.step_time_s == 15.0


def test_saved_tensors_are_forward_outputs_read_by_backward_ops():
    assert [t.name for t in tiny_graph().saved_tensors()] == ["a", "b", "loss"]
    # in a chain, the last activation is read only by the loss, a forward op
    assert [t.name for t in synthetic.chain(3).saved_tensors()] == ["f0", "f1", "loss"]


def test_with_times_replaces_only_the_named_ops():
    graph = tiny_graph()
    timed = graph.with_times({"a": 10.0, "e": 0.5})
    assert [op.time_s for op in timed.ops] == [10.0, 2.0, 3.0, 4.0, 0.5]
    assert [op.time_s for op in graph.ops] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert timed.tensors == graph.tensors
    assert timed.structure_hash == graph.structure_hash


def test_structure_hash_is_stable_and_follows_sizes_not_names_or_times():
    graph = tiny_graph()
    assert graph.structure_hash == tiny_graph().structure_hash
    assert len(graph.structure_hash) == 16
    assert int(graph.structure_hash, 16) >= 0
    renamed = CostGraph.build(tiny_ops(), tiny_tensors(), name="another name")
    assert renamed.structure_hash == graph.structure_hash
    bigger = build_with(
        tensors=[replace(t, size_bytes=101) if t.name == "a" else t for t in tiny_tensors()]
    )
    assert bigger.structure_hash != graph.structure_hash
    assert synthetic.chain(4).structure_hash != synthetic.chain(5).structure_hash


def test_json_round_trip():
    graph = synthetic.resnet_like(2)
    text = json.dumps(graph.to_json())
    loaded = CostGraph.from_json(json.loads(text))
    assert loaded == graph
    assert loaded.name == "resnet2"
    assert loaded.structure_hash == graph.structure_hash
    assert loaded.tensors["stem"].consumers == graph.tensors["stem"].consumers


def test_graph_is_frozen():
    graph = tiny_graph()
    with pytest.raises(AttributeError):
        graph.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        graph.tensors["a"] = Tensor("a", 1, "activation")  # type: ignore[index]
