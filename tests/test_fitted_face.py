"""A fitted model behaves like the model: its keys, parameters, signature, attributes, hooks and
modes are its own; checkpoints go both ways; copies and pickles train bitwise like eager, each
with planning state of its own; ``memfit.unfit`` makes it plain again."""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

import memfit

pytestmark = pytest.mark.usefixtures("compiled_fresh")


class Net(nn.Module):
    """A small model with a keyword argument and an attribute, as a Hugging Face model has."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.config = {"width": width}
        self.first = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.last = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.last(self.norm(self.first(x)).relu()) * scale


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def inputs(count: int = 3, size: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 64, generator=generator), torch.randn(size, 1, generator=generator))
            for _ in range(count)]


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
         y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    nn.functional.mse_loss(model(x), y).backward()
    found = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


def test_the_fitted_model_is_the_model_with_its_keys_parameters_and_signature():
    model = build()
    plain = build()
    parameters = dict(model.named_parameters())
    fitted = memfit.fit(model, budget=0.9)
    assert fitted is model and type(fitted) is Net
    assert list(fitted.state_dict()) == list(plain.state_dict())
    assert all(parameter is parameters[name] for name, parameter in fitted.named_parameters())
    assert inspect.signature(fitted.forward) == inspect.signature(plain.forward)
    assert fitted.config == {"width": 64}
    x, y = inputs(count=1)[0]
    fitted(x).sum().backward()  # planned: the keys stay the plain model's
    assert list(fitted.state_dict()) == list(plain.state_dict())


def test_checkpoints_load_both_ways():
    fitted = memfit.fit(build(), budget=0.9)
    x, _ = inputs(count=1)[0]
    fitted(x)
    other = build(seed=1)
    fitted.load_state_dict(other.state_dict())  # a plain checkpoint into the fitted model
    assert all(torch.equal(a, b) for a, b in zip(fitted.parameters(), other.parameters(),
                                                 strict=True))
    plain = build(seed=2)
    plain.load_state_dict(fitted.state_dict())  # and the fitted model's into a plain one
    assert torch.equal(plain(x), other(x))


@pytest.mark.slow
def test_copies_and_pickles_after_a_step_train_bitwise_like_eager_with_their_own_plans():
    data = inputs()
    reference = build()
    model = build()
    fitted = memfit.fit(model, budget=0.9)
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    assert torch.equal(step(fitted, optimizer, *data[0]), step(reference, reference_optimizer,
                                                                 *data[0]))
    planner = fitted._memfit_backend
    regions = list(planner.regions)
    assert regions
    copies = [copy.deepcopy(fitted), pickle.loads(pickle.dumps(fitted))]
    expected = gradients(reference, *data[1])
    for copied in copies:
        assert type(copied) is Net
        assert copied._memfit_backend is not planner and not copied._memfit_backend.regions
        assert copied._memfit_backend.model is copied
        assert not any(a is b for a, b in zip(copied.parameters(), model.parameters(),
                                                     strict=True))
        got = gradients(copied, *data[1])  # plans afresh at its first call
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert copied._memfit_backend.regions and memfit.report(copied)
    assert planner.regions == regions  # the copies planned nothing for the original
    got = gradients(fitted, *data[1])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_copy_before_the_first_call_is_fitted_too():
    fitted = memfit.fit(build(), budget=0.9)
    copied = copy.deepcopy(fitted)
    x, y = inputs(count=1)[0]
    assert all(torch.equal(a, b) for a, b in zip(gradients(copied, x, y),
                                                 gradients(build(), x, y), strict=True))
    assert len(copied._memfit_backend.regions) == 1 and not fitted._memfit_backend.regions


def test_a_backend_alone_is_not_copied():
    with pytest.raises(TypeError, match="copy the model returned by memfit.fit"):
        copy.deepcopy(memfit.backend(budget=0.5))


def test_unfit_gives_the_plain_model_back():
    model = build()
    fitted = memfit.fit(model, budget=0.9)
    x, _ = inputs(count=1)[0]
    fitted(x)
    plain = memfit.unfit(fitted)
    assert plain is model and plain._compiled_call_impl is None
    assert not hasattr(plain, "_memfit_backend")
    assert torch.equal(plain(x), build()(x))
    with pytest.raises(ValueError, match="memfit.fit"):
        memfit.report(plain)


def test_modes_hooks_and_to_reach_the_model():
    fitted = memfit.fit(build(), budget=0.9)
    seen = []
    fitted.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    x, _ = inputs(count=1)[0]
    fitted(x)
    assert seen == [torch.Size([2048, 1])]
    fitted.eval()
    assert not fitted.training and not fitted.norm.training
    with torch.no_grad():
        assert torch.equal(fitted(x), build().eval()(x))
    fitted.train()
    assert fitted.training and fitted.norm.training
    doubled = fitted.to(torch.float64)
    assert doubled is fitted and fitted.first.weight.dtype == torch.float64


class Looped(nn.Module):
    """Blocks called in a loop: a graph break inside it makes Dynamo skip the whole forward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(3))
        self.last = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.last(x)


def test_hooks_registered_or_removed_between_steps_run_as_in_eager_and_planning_resumes():
    torch.manual_seed(0)
    model = Looped()
    reference = copy.deepcopy(model)
    fitted = memfit.fit(model, budget=0.9)
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (model, reference)]
    seen: dict[str, list] = {"memfit": [], "eager": []}
    handles: dict[str, list] = {"memfit": [], "eager": []}

    def record(into: list, as_float: bool):  # a logging hook; .item() stops Dynamo
        return lambda module, args, output: into.append(
            output.detach().norm().item() if as_float else output.detach().norm())

    for name, net, optimizer in (("memfit", fitted, optimizers[0]),
                                 ("eager", reference, optimizers[1])):
        for index, (x, y) in enumerate(inputs(count=5)):
            if index in (1, 2):  # a hook Dynamo traces, then one it cannot
                handles[name].append(net.blocks[1].register_forward_hook(
                    record(seen[name], as_float=index == 2)))
            if index == 3:
                for handle in handles[name]:
                    handle.remove()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step(net, optimizer, x, y)
            said = [str(w.message) for w in caught if w.category is memfit.BudgetWarning]
            if name == "memfit":  # eagerly while the untraceable hook is on, and said; planned after
                assert bool(said) == (index == 2), (index, said)
                assert not said or ("ran eagerly, outside any plan" in said[0]
                                    and "capture_scalar_outputs = True" in said[0]), said
    assert len(seen["memfit"]) == len(seen["eager"]) == 3
    for mine, theirs in zip(seen["memfit"], seen["eager"], strict=True):
        assert torch.equal(torch.as_tensor(mine), torch.as_tensor(theirs))
    assert all(torch.equal(mine, theirs)
               for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_retained_graph_backs_up_twice_as_in_eager_after_normal_steps():
    """``loss.backward(retain_graph=True)`` then a second backward, on an iteration after plain
    ones (whose backward compiled the region's): eager allows it, and so does a fitted model, with
    eager's gradients (AOTAutograd's donated buffers refused it, with a plan's timing deciding)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                              nn.Linear(64, 4))
    model = memfit.fit(copy.deepcopy(reference), budget="10MB")
    generator = torch.Generator().manual_seed(1)
    for index in range(4):
        x = torch.randn(32, 64, generator=generator)
        for net in (reference, model):
            loss = net(x).square().mean()
            if index >= 2:
                loss.backward(retain_graph=True)
                (0.5 * loss).backward()
            else:
                loss.backward()
        for expected, parameter in zip(reference.parameters(), model.parameters(), strict=True):
            assert torch.equal(parameter.grad, expected.grad), index


def test_a_retained_graph_after_measured_steps_is_over_budget_only_with_a_warning_at_that_call():
    """A backward with ``retain_graph=True`` frees none of the saves it reads, so a plan made for
    backwards that free them (one save swapped, three kept) peaks higher under it. Its first
    such backward, after the region's measured runs, says so at that call; the region is then
    planned with the saves kept to its backward's end, and the next retained backward fits.
    Losses and weights stay eager's."""
    from memfit.runtime.measure import measure_allocator_peak

    def iterate(net, optimizer, x, retain):
        loss = net(x).square().mean()
        if retain:
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    def train(net, budget=None):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        if budget is not None:
            memfit.fit(net, budget=budget, optimizer=optimizer)
        generator = torch.Generator().manual_seed(1)
        peaks, said, losses = [], [], []
        for index in range(6):
            x = torch.randn(256, 128, generator=generator)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                measured = measure_allocator_peak(
                    iterate, net, optimizer, x, index in (3, 5),
                    track=(list(net.parameters()), optimizer.state,
                           [parameter.grad for parameter in net.parameters()]))
            peaks.append(measured.peak_bytes)
            losses.append(measured.result)
            said.append([str(warning.message) for warning in caught
                         if issubclass(warning.category, memfit.BudgetWarning)])
        return peaks, said, losses

    torch.manual_seed(0)
    reference = nn.Sequential(*[layer for _ in range(4)
                                for layer in (nn.Linear(128, 128), nn.Tanh())], nn.Linear(128, 4))
    model = copy.deepcopy(reference)
    eager_peaks, _, eager_losses = train(reference)
    budget = int(0.97 * max(eager_peaks[:3]))  # under the plain iterations' peak: a swap
    peaks, said, losses = train(model, budget)
    for index, (peak, warned) in enumerate(zip(peaks, said, strict=True)):
        assert peak <= budget or warned, (index, peaks, budget, said)
    assert any("retain_graph" in message for message in said[3]), said
    assert peaks[5] <= budget and not said[5], (peaks, budget, said)
    assert all(torch.equal(loss, expected)
               for loss, expected in zip(losses, eager_losses, strict=True))
    for expected, parameter in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(parameter, expected)


def test_an_optimizer_step_the_loop_compiles_trains_as_in_eager_and_leaves_torch_usable():
    """``torch.compile(optimizer.step)``, as GPU loops do for speed: memfit's optimizer hook runs
    inside that compiled call, where it took memfit's watch of eager code off the mode stack;
    Dynamo put the Python dispatch key back on return, with no mode left, so every later op
    failed ("Hit Python dispatch key but no arguments had PyInterpreter"), torch.empty too.
    Now the watch leaves the stack only outside such a call, and three steps train bitwise like
    eager's with the same compiled step."""
    from memfit.runtime.measure import measure_allocator_peak

    data = inputs()

    def train(model: nn.Module, fit_budget: int | None = None) -> tuple[list, list[int]]:
        optimizer = torch.optim.AdamW(model.parameters())
        if fit_budget is not None:
            memfit.fit(model, budget=fit_budget, optimizer=optimizer)
        compiled_step = torch.compile(optimizer.step, backend="aot_eager")
        losses, peaks = [], []
        for x, y in data:
            def iteration(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                compiled_step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            measured = measure_allocator_peak(iteration, track=(list(model.parameters()),
                                                                optimizer.state, x, y))
            losses.append(measured.result)
            peaks.append(measured.peak_bytes)
        return losses, peaks

    reference = build()
    reference_losses, eager_peaks = train(reference)
    torch._dynamo.reset()
    model = build()
    budget = int(0.9 * max(eager_peaks))
    losses, peaks = train(model, budget)
    assert torch.empty(3).shape == (3,)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(losses, reference_losses,
                                                                  strict=True))
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(model.parameters(),
                                                                  reference.parameters(),
                                                                  strict=True))
    assert max(peaks) <= budget, (peaks, budget)
