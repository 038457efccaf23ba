"""Capture binds inputs and outputs by descriptor, records phases and scopes, fails clearly."""

import collections
import copy

import pytest
import torch
from torch import nn

from memfit import examples
from memfit.data.errors import CaptureError
from memfit.tracing.capture import SCOPE_KEY, capture


def _nodes(captured):
    return [n for n in captured.graph_module.graph.nodes if n.op == "call_function"]


def test_gpt2_binds_tied_weights_and_gradients_by_name():
    example = examples.gpt2(layers=1, width=32, sequence=16, batch_size=2)
    captured = capture(example.model, example.loss_fn, *example.inputs())
    kinds = collections.Counter(b.kind for b in captured.inputs)
    assert kinds["input"] == 2 and kinds["tangent"] == 1
    parameters = {b.target for b in captured.inputs if b.kind == "parameter"}
    # lm_head.weight is tied to transformer.wte.weight: aot gives each name its own placeholder
    # (and its own partial gradient); both names resolve to the one Parameter
    assert {"lm_head.weight", "transformer.wte.weight"} <= parameters
    model = example.model
    assert model.get_parameter("lm_head.weight") is model.get_parameter("transformer.wte.weight")
    assert {id(model.get_parameter(n)) for n in parameters} == {id(p) for p in model.parameters()}
    gradients = {b.target for b in captured.outputs if b.kind == "gradient"}
    assert gradients == parameters
    assert [b.kind for b in captured.outputs].count("loss") == 1


def test_phases_and_scopes_reach_forward_and_backward_nodes():
    example = examples.gpt2(layers=2, width=32, sequence=16, batch_size=2)
    captured = capture(example.model, example.loss_fn, *example.inputs())
    tags = collections.Counter(n.meta.get("partitioner_tag") for n in _nodes(captured))
    assert tags["is_forward"] > 50 and tags["is_backward"] > 50
    scoped = collections.defaultdict(set)
    for node in _nodes(captured):
        scope = (node.meta.get("custom") or {}).get(SCOPE_KEY)
        if scope:
            scoped[node.meta["partitioner_tag"]].add(scope)
    assert "transformer.h.1.attn" in scoped["is_forward"]
    assert "transformer.h.1.attn" in scoped["is_backward"]


def test_batchnorm_running_stats_are_buffer_updates():
    example = examples.resnet50_shaped(widths=(8, 8, 8, 8), image=32, batch_size=2)
    captured = capture(example.model, example.loss_fn, *example.inputs())
    buffers = {b.target for b in captured.inputs if b.kind == "buffer"}
    updates = [b.target for b in captured.outputs if b.kind == "buffer_update"]
    running = {n for n, _ in example.model.named_buffers() if "running" in n}
    assert running <= buffers
    assert running <= set(updates)
    assert len(updates) == len(set(updates))  # each buffer updated exactly once


def test_meta_inputs_capture_without_data():
    example = examples.mlp(depth=2, width=16, batch_size=4)
    inputs = tuple(t.to("meta") for t in example.inputs())
    captured = capture(example.model, example.loss_fn, *inputs)
    assert len(_nodes(captured)) > 10
    assert all(p.device.type == "cpu" for p in example.model.parameters())  # model untouched


def test_data_dependent_code_raises_capture_error_naming_the_line():
    model = nn.Linear(4, 4)

    def loss_fn(model, x):
        y = model(x)
        if y.sum() > 0:  # reads a tensor value into Python
            y = y * 2
        return y.mean()

    with pytest.raises(CaptureError) as error:
        capture(model, loss_fn, torch.randn(2, 4))
    assert "test_capture.py" in str(error.value)
    assert "tensor values" in str(error.value)


@pytest.mark.parametrize("read", [
    lambda x: x.sum().item(),  # a value into Python
    lambda x: x[x.sum(1) > 0].shape[0],  # a shape that depends on values
    lambda x: float(x.numpy().sum()),  # non-PyTorch code on a tensor
], ids=["item", "boolean-mask", "numpy"])
def test_each_kind_of_data_dependence_gets_the_advice(read):
    model = nn.Linear(4, 4)

    def loss_fn(model, x):
        return model(x).mean() * read(x)

    with pytest.raises(CaptureError, match="independent of tensor values") as error:
        capture(model, loss_fn, torch.randn(2, 4))
    assert f"test_capture.py:{read.__code__.co_firstlineno}" in str(error.value)  # innermost


def test_a_shape_error_in_the_loss_keeps_its_own_message_and_names_the_line():
    """Not data-dependent: no advice about tensor values, torch's own message and the line."""
    model = nn.Linear(4, 3)

    def loss_fn(model, x, y):
        return nn.functional.cross_entropy(model(x), y)

    with pytest.raises(CaptureError) as error:
        capture(model, loss_fn, torch.randn(16, 4), torch.randint(0, 3, (8,)))
    message = str(error.value)
    assert message.startswith(
        "ValueError: Expected input batch_size (16) to match target batch_size (8).")
    assert f"test_capture.py:{loss_fn.__code__.co_firstlineno + 1}" in message
    assert "tensor values" not in message
    assert isinstance(error.value.__cause__, ValueError)


def test_an_empty_batch_steps_like_eager_pytorch():
    """torch's fake ``mse_loss_backward`` divides by the element count in Python, so an empty
    batch failed to capture (``ZeroDivisionError``); eager PyTorch gives a nan loss and zero
    gradients, and so does the step now. A non-empty batch still traces the op itself."""
    import memfit

    example = examples.mlp(depth=2, width=8)
    eager = copy.deepcopy(example.model)
    inputs = (torch.randn(0, 8), torch.randn(0, 1))
    loss = memfit.compile(example.model, example.loss_fn, strategy="keep")(*inputs)
    eager_loss = example.loss_fn(eager, *inputs)
    eager_loss.backward()
    assert torch.isnan(loss) and torch.isnan(eager_loss)
    for name, parameter in eager.named_parameters():
        assert torch.equal(example.model.get_parameter(name).grad, parameter.grad), name
    captured = capture(example.model, example.loss_fn, *example.inputs(4))
    assert torch.ops.aten.mse_loss_backward.default in {n.target for n in _nodes(captured)}


def test_non_scalar_loss_and_non_tensor_inputs_are_refused():
    model = nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="scalar"):
        capture(model, lambda m, x: m(x), torch.randn(2, 4))
    with pytest.raises(ValueError, match="tensors only"):
        capture(model, lambda m, x, k: m(x).sum() * k, torch.randn(2, 4), 3)


@pytest.mark.slow
def test_real_models_plan_from_meta_inputs():
    """A CPU laptop plans a GPU step without data: meta inputs, no allocation of activations."""
    import memfit

    for build in (examples.gpt2, examples.resnet50_shaped, examples.unet3d):
        example = build()
        inputs = tuple(t.to("meta") for t in example.inputs())
        plan = memfit.plan(example.model, example.loss_fn, *inputs, budget="0.5",
                           hardware="h100-pcie")
        assert plan.swapped and plan.hardware == "h100-pcie", example.name
        assert all(p.grad is None for p in example.model.parameters())


def test_a_step_without_gradients_is_refused_with_the_reason():
    """A detached loss, or GPT-2 built on the meta device (its loss comes out detached), would
    plan a forward pass only: refused, saying what to do."""
    example = examples.mlp(depth=2, width=8)
    with pytest.raises(CaptureError, match="no gradient.*detach"):
        capture(example.model, lambda m, x, y: example.loss_fn(m, x, y).detach(), *example.inputs())
    with torch.device("meta"):
        meta_gpt2 = examples.gpt2(layers=1)
    inputs = tuple(t.to("meta") for t in meta_gpt2.inputs())
    with pytest.raises(CaptureError, match="meta device.*to_empty"):
        capture(meta_gpt2.model, meta_gpt2.loss_fn, *inputs)
