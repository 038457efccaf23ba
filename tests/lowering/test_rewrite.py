"""The rewritten graph holds the swap ops where the plan says, and computes the same values."""

import pytest
import torch
from torch import nn

import memfit
from memfit.data.hardware import PROFILES
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.lowering.rewrite import rewrite
from memfit.model.schedule import PlanError, lower, memory_profile
from memfit.tracing.analyze import analyze
from memfit.tracing.capture import capture


def chain_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1))


def loss_fn(model, x):
    return model(x).square().mean()


@pytest.fixture(scope="module")
def captured():
    model = chain_model()
    result = capture(model, loss_fn, torch.randn(64, 32))
    return model, result, analyze(result, PROFILES["cpu"])


def first_tanh_plan(graph):
    """Swap the first tanh output; bring it back after the op before its first backward reader."""
    tanh = next(t for t in graph.saved_tensors() if graph.op(t.producer).kind == "aten.tanh")
    backward = tuple(c for c in tanh.consumers if graph.op(c).phase == "backward")
    control = graph.ops[graph.index[backward[0]] - 2].name
    return tanh, Plan("test", {tanh.name: Swap((SwapIn(control, backward),))},
                      graph_hash=graph.structure_hash)


def test_swap_ops_are_placed_as_planned(captured):
    model, result, graph = captured
    tanh, plan = first_tanh_plan(graph)
    program = rewrite(result.graph_module, graph, plan)
    nodes = list(program.graph.nodes)
    names = [n.name for n in nodes]
    inserted = [n for n in nodes if "memfit" in n.meta]
    kinds = [n.meta["memfit"]["kind"] for n in inserted]
    originals = {n.name for n in result.graph_module.graph.nodes}
    assert {n.name for n in nodes if "memfit" not in n.meta} == originals  # names survive
    assert all(n.name.startswith("memfit_") for n in inserted)
    assert kinds.count("swap_out") == 1 and kinds.count("swap_in") == 1 and kinds.count("wait") == 1
    swap_out, swap_in, wait = (next(n for n in inserted if n.meta["memfit"]["kind"] == k)
                               for k in ("swap_out", "swap_in", "wait"))
    # swap-out right after the producer, swap-in right after the control op, wait before the reader
    assert names[names.index(swap_out.name) - 1] == tanh.producer
    control = plan.decision(tanh.name).swap_ins[0].after
    assert names[names.index(swap_in.name) - 1] == control
    reader = plan.decision(tanh.name).swap_ins[0].consumers[0]
    assert names.index(wait.name) < names.index(reader)
    # the backward reader now reads the swapped-in copy, the forward reader still the original
    new_reader = next(n for n in nodes if n.name == reader)
    assert swap_in in new_reader.all_input_nodes or any(
        swap_in in a.all_input_nodes for a in new_reader.all_input_nodes
    )


def test_rewritten_graph_gives_identical_gradients_and_lower_peak():
    x = torch.randn(64, 32)
    keep = memfit.compile(chain_model(), loss_fn, strategy="keep")
    keep(x)
    graph = keep.graph  # the graph the backend plans for this step
    tanh, plan = first_tanh_plan(graph)
    step = memfit.compile(chain_model(), loss_fn, plan=plan, hardware="cpu")
    loss = step(x)
    assert step.plan is plan and step.graph.structure_hash == graph.structure_hash
    for a, b in zip(keep.model.parameters(), step.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    # nothing resident beyond the graph's inputs (no buffers, no .grad before the step) but
    # the previous step's loss, which a loop holds beside the next
    assert step.compiled.outside_bytes == loss.untyped_storage().nbytes()
    assert step.measured.peak_bytes == memory_profile(lower(graph, plan)).peak_bytes
    assert step.measured.peak_bytes <= keep.measured.peak_bytes
    kinds = [(node.meta.get("memfit") or {}).get("kind") for node in step.compiled.forward.graph.nodes]
    assert "swap_out" in kinds  # the swap-out sits in the forward module


def test_a_plan_for_another_graph_is_refused(captured):
    model, result, graph = captured
    plan = Plan("test", {}, graph_hash="0" * 16)
    with pytest.raises(PlanError, match="plan again"):
        rewrite(result.graph_module, graph, plan)


def test_a_swap_out_takes_the_graphs_strides_under_symbolic_sizes():
    """Each swap-out is given the strides of the value as the graph traced it, a symbolic one as
    an ``aten.sym_stride`` of that value (its size where it runs). Given none (its value's own
    layout where it runs), inductor, which lays an attention value out otherwise, copied the
    host copy back onto the device in the traced layout and saved that copy: a padded BERT's
    swap plan measured 7.64 MiB against its 5.51 MiB prediction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    fitted = memfit.fit(model, budget="64MB", strategy="vdnn_all", dynamic=True)
    for length in (12, 20):
        fitted(torch.randn(4, length, 16)).sum().backward()
    region = fitted._memfit_backend.regions[-1]
    assert region.shape_bound, "planned with symbolic sizes"
    swap_outs = [node for node in region.forward.graph.nodes
                 if node.target is torch.ops.memfit.swap_out.default]
    assert swap_outs
    for swap_out in swap_outs:
        value, strides = swap_out.args[0], swap_out.args[2]
        traced = value.meta["val"].stride()
        assert any(isinstance(step, torch.SymInt) for step in traced)
        for dim, (step, given) in enumerate(zip(traced, strides, strict=True)):
            if isinstance(step, torch.SymInt):
                assert given.target is torch.ops.aten.sym_stride.int
                assert given.args == (value, dim)
            else:
                assert given == step
        assert swap_out.meta["val"].stride() == traced
