"""The backend's split program, predicted against the CPU allocator's measured peak."""

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak


def dropout_mlp(layers: int, width: int) -> nn.Module:
    """Dropout after every ReLU, the last one right before the output layer: the unplanned peak
    sits on that dropout's backward, whose CPU kernel allocates buffers of its own."""
    torch.manual_seed(0)
    blocks = [module for _ in range(layers)
              for module in (nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1))]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


@pytest.mark.parametrize("strategy, budget", [("keep", None), ("swap", 0.7)])
def test_predicted_region_peak_is_the_measured_one_with_dropout(strategy, budget):
    """Exact but for the scalar loss, which lives outside the region while backward runs, and
    for what eager code was seen to hold beside the region: without a budget, the prediction
    counts it over the whole region (``count_eager_in_prediction``: the loss's elementwise
    buffer, the target, and the previous iteration's loss buffer under the ``loss.detach()``
    this loop keeps); with one, from the backward's start, in place of the output eager code
    read (``observe_loop``), so the prediction is above the measurement by exactly that
    previous buffer (on the device, but allocated before this measurement started)."""
    model = dropout_mlp(layers=4, width=64)
    compiled = memfit.fit(model, budget=budget, strategy=strategy)
    inputs, targets = torch.randn(512, 64), torch.randn(512, 1)

    def iteration() -> torch.Tensor:
        loss = nn.functional.mse_loss(compiled(inputs), targets)
        loss.backward()
        return loss.detach()

    results = []
    for _ in range(2):  # the first call compiles; the second runs what was compiled
        for parameter in model.parameters():
            parameter.grad = None
        measured = measure_allocator_peak(iteration, track=(list(model.parameters()), inputs, targets))
        results.append(measured.result)
    region = compiled._memfit_backend.regions[0]
    counted = region.planned_eager_bytes  # eager code's bytes in the prediction
    assert (counted > 0) == (budget is None)  # with a budget, this plan had room for them
    if counted:  # an upper bound then: they are counted alive over the whole region
        loss_bytes = measured.result.nbytes
        assert 0 <= measured.peak_bytes - (region.predicted_peak_bytes - counted) <= loss_bytes
        assert 0 <= region.predicted_peak_bytes - measured.peak_bytes <= counted
    else:
        earlier_bytes = results[0].untyped_storage().nbytes()
        assert region.predicted_peak_bytes - measured.peak_bytes == earlier_bytes


class _ZeroDropoutThenView(nn.Module):
    """Dropout with p=0 decomposes to ``relu.clone()``, and a view of that clone feeds a linear."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.first, self.dropout = nn.Linear(width, width), nn.Dropout(0.0)
        self.rest = nn.Sequential(*(module for _ in range(4)
                                    for module in (nn.Linear(width, width), nn.Tanh())))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(torch.relu(self.first(inputs)))
        return self.rest(hidden.view(-1, hidden.shape[-1])).sum()


def test_an_elided_clones_views_are_views_of_its_source():
    """The clone is gone and its view is no storage of its own: it lies in ``relu``'s, so a plan
    that swaps or re-runs ``relu`` replays the view on the copy (``rewrite`` refused a view it
    took for a fresh storage); training is eager's bit for bit."""
    torch.manual_seed(0)
    model, reference = _ZeroDropoutThenView(), _ZeroDropoutThenView()
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(4, 8, 16)
    compiled = memfit.fit(model, strategy="keep")
    loss = compiled(inputs)
    loss.backward()
    expected = reference(inputs)
    expected.backward()
    region = compiled._memfit_backend.regions[0]
    nodes = list(region.forward.graph.nodes)
    views = {node.name for node in nodes if node.target is torch.ops.aten.view.default}
    assert not any(node.target is torch.ops.aten.clone.default for node in nodes)
    assert "relu" in region.graph.tensors
    assert not views & set(region.graph.tensors)
    assert torch.equal(loss, expected)
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter.grad, reference_parameter.grad)


class _TwoOutputs(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.first(inputs))
        return self.second(hidden).sum(), hidden


@pytest.mark.parametrize("uses_hidden", [False, True])
def test_an_unused_outputs_gradient_is_zeros_only_where_read(uses_hidden):
    """The backward gets ``None`` for ``hidden`` when the loss does not read it (zeros are made
    at its first reader; ``test_fit_keep`` measures what that saves), the gradient itself when
    it does: both give eager's gradients bit for bit."""
    torch.manual_seed(0)
    model, reference = _TwoOutputs(), _TwoOutputs()
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(32, 16)
    compiled = memfit.fit(model, strategy="keep")
    losses = []
    for module in (compiled, reference):
        loss, hidden = module(inputs)
        (loss + hidden.square().sum() if uses_hidden else loss).backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter.grad, reference_parameter.grad)


def _conv_batch_norm() -> nn.Module:
    return nn.Sequential(*(module for width in (3, 8) for module in (
        nn.Conv2d(width, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))))


@pytest.mark.slow
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_backward_saves_no_running_statistics_in_training(training):
    """In training the backward normalizes by the saved mean and inverse deviation, so the
    forward saves no copy of the updated running statistics (eager holds none; the buffers
    themselves are resident); in eval it reads the buffers. Training is eager's bit for bit,
    buffers included."""
    torch.manual_seed(0)
    model, reference = _conv_batch_norm().train(training), _conv_batch_norm().train(training)
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(2, 3, 8, 8)
    compiled = memfit.fit(model, strategy="keep")
    losses = []
    for module in (compiled, reference):
        loss = module(inputs).square().sum()
        loss.backward()
        losses.append(loss)
    backward = compiled._memfit_backend.regions[0].backward.graph
    readers = backward.find_nodes(op="call_function",
                                  target=torch.ops.aten.native_batch_norm_backward.default)
    assert len(readers) == 2
    assert all((node.args[3:5] == (None, None)) == training for node in readers)
    assert torch.equal(losses[0], losses[1])
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter.grad, reference_parameter.grad)
    for buffer, reference_buffer in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(buffer, reference_buffer)


@pytest.mark.parametrize("dynamo_path, prefix, expected", [
    ("L['self'].model.transformer.h[0].attn", "model.", "transformer.h.0.attn"),
    ("L['self'].model.0", "model.", "0"),
    ("L['self'].model", "model.", ""),  # the model itself: the root scope, as capture names it
    ("L['self'].layer1._modules['0']", "", "layer1._modules.0"),
    ("L['self'].encoder.blocks[11]", "", "encoder.blocks.11"),
])
def test_module_paths_are_the_users_from_dynamo_s(dynamo_path, prefix, expected):
    from memfit.lowering.joint import module_path

    assert module_path(dynamo_path, prefix) == expected


def test_compile_plans_module_path_checkpoints():
    """``checkpoints=`` names modules of the user's model, as on the old capture path: the scopes
    come from Dynamo's module stack, the backward's from the forward nodes they derive from."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)))
    x = torch.randn(64, 32)
    step = memfit.compile(model, lambda m, x: m(x).square().mean(), strategy="checkpoint",
                          checkpoints=["1", "3"], measure=False)
    step(x)
    scopes = {op.scope for op in step.graph.ops}
    assert {"0.0", "1.1", "3.0"} <= scopes
    backward = [op for op in step.graph.ops if op.phase == "backward" and op.scope]
    assert backward and all(op.scope.split(".")[0] in "0123" for op in backward)
    assert step.plan.recomputed  # blocks between the checkpoints are re-run


class _Gated(nn.Module):
    """``relu(a(x)) * tanh(b(x))``: the backward's first op reads the ReLU's output, which
    ``checkpoint`` re-runs from the kept ``a(x)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(16, 64)

    def forward(self, x):
        return torch.relu(self.a(x)) * torch.tanh(self.b(x))


def test_a_value_re_run_for_the_first_backward_op_is_not_saved_by_the_forward():
    """The rewrite re-runs an op right before its first backward reader; for the first backward
    op that is before the first original backward node, where the cut between forward and
    backward falls. The re-run goes to the backward side: the forward returns the checkpoint,
    not the rebuilt value, so the rebuilt value is not alive between the two (across the loss
    computed outside, and across later regions under FSDP2). Gradients are eager's."""
    torch.manual_seed(0)
    model, reference = _Gated(), _Gated()
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(32, 16)
    fitted = memfit.fit(model, strategy="checkpoint", checkpoints=["a"])  # the rest re-run
    for module in (fitted, reference):
        module(inputs).square().sum().backward()
    region = fitted._memfit_backend.regions[0]
    assert region.plan.recomputed
    returned = region.forward.graph.find_nodes(op="output")[0].args[0]
    kinds = [node.meta.get("memfit", {}).get("kind") for node in returned
             if isinstance(node, torch.fx.Node)]
    assert "recompute" not in kinds and "view_replay" not in kinds, kinds
    rebuilt = [node for node in region.backward.graph.nodes
               if node.meta.get("memfit", {}).get("kind") == "recompute"]
    assert rebuilt
    for parameter, reference_parameter in zip(model.parameters(), reference.parameters(),
                                              strict=True):
        assert torch.equal(parameter.grad, reference_parameter.grad)


class _Scaled(nn.Module):
    """A float argument of the forward, as a loss weight or a temperature is passed."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                                    nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))

    def forward(self, inputs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.layers(inputs) * scale


@pytest.mark.usefixtures("compiled_fresh")
@pytest.mark.parametrize("budget", [None, 0.9])
def test_a_float_argument_that_changes_trains_as_eager(budget):
    """A float that changes between calls is traced again as a 0-dim tensor input, whose ops
    AOTAutograd's passes add without a phase tag: the gradient's ``mul`` by it is a backward
    node, which the split must not cut into the forward (it failed with "Node mul_tensor_1 was
    invalid, but is output" at the second call)."""
    torch.manual_seed(0)
    model, reference = _Scaled(), _Scaled()
    reference.load_state_dict(model.state_dict())
    fitted = memfit.fit(model, budget=budget, strategy=None if budget else "keep")
    inputs = torch.randn(1024, 16)
    for scale in (1.0, 2.0, 0.5):
        got, expected = fitted(inputs, scale=scale), reference(inputs, scale=scale)
        got.square().sum().backward()
        expected.square().sum().backward()
        assert torch.equal(got, expected)
        for parameter, reference_parameter in zip(model.parameters(), reference.parameters(),
                                                  strict=True):
            assert torch.equal(parameter.grad, reference_parameter.grad)
