"""``realias_views``: a view left on the storage of a copy that a graph pass erased lies in its
base's storage again, as it will when it runs."""

import operator

import torch
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.lowering.joint import realias_views
from memfit.tracing.analyze import storage_key, tensors_in


def _copied_then_viewed(inputs: torch.Tensor, weight: torch.Tensor):
    """A copy (dropout with p=0 decomposes to one) read only through views: a view chain and a
    split whose pieces are taken by ``getitem``."""
    hidden = torch.relu(inputs).clone()
    return hidden.view(-1, 16).t() @ weight, hidden.split(2)[0].sum()


def _storages(graph_module: torch.fx.GraphModule) -> dict[str, set]:
    return {node.name: {storage_key(tensor) for tensor in tensors_in(node.meta.get("val"))}
            for node in graph_module.graph.nodes if node.op == "call_function"}


def test_views_of_a_copy_inductor_erased_lie_in_its_sources_storage():
    graph_module = make_fx(_copied_then_viewed, tracing_mode="fake")(
        torch.randn(4, 8, 16), torch.randn(32, 3))
    remove_noop_ops(graph_module.graph)  # inductor's joint-graph pass: the clone is gone
    assert not graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    views = [node.name for node in graph_module.graph.nodes
             if getattr(node.target, "is_view", False) or node.target is operator.getitem]
    assert {"view", "t", "split", "getitem", "getitem_1"} <= set(views)
    before = _storages(graph_module)
    assert all(before[name] != before["relu"] for name in views)  # left on the erased copy's

    assert realias_views(graph_module) == len(views)

    after = _storages(graph_module)
    assert all(after[name] == after["relu"] for name in views)
    assert after["mm"] == before["mm"] and after["mm"] != after["relu"]  # non-views untouched
    assert realias_views(graph_module) == 0  # consistent values are left alone
