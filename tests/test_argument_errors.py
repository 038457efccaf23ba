"""Errors at the call that received the input: every argument of fit, backend, compile, plan and
max_batch_size refused there, fast, before torch traces anything, naming the valid choices; an
empty batch and a float64 batch get the errors that name their real cause; messages name only
strategies a user can pass."""

import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import memfit
from memfit.planning.strategies import BUILTIN_MODULES, strategy_names


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).mean()


def _inputs(batch: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 8),)


def _foreign_optimizer() -> torch.optim.Optimizer:
    """An optimizer of another model: made for the original before ``copy.deepcopy``."""
    return torch.optim.AdamW(_mlp().parameters())


X = torch.randn(4, 8)
OTHERS = "steps none of the model's parameters"
CASES = {
    "fit hardware": (lambda: memfit.fit(_mlp(), 0.5, hardware="h999"), "h100-pcie"),
    "fit compiler": (lambda: memfit.fit(_mlp(), 0.5, compiler="inductr"), "aot_eager"),
    "fit strategy": (lambda: memfit.fit(_mlp(), 0.5, strategy="autoo"), "'auto'"),
    "fit parameter": (lambda: memfit.fit(_mlp(), 0.5, strategy="swap", lbb=3), "lb="),
    "fit parameter value": (lambda: memfit.fit(_mlp(), 0.5, strategy="swap", lb=-3), "lb"),
    "fit budget": (lambda: memfit.fit(_mlp(), "abc"), "fraction"),
    "fit optimizer": (lambda: memfit.fit(_mlp(), 0.5, optimizer="adam"), "Optimizer"),
    "fit dynamic": (lambda: memfit.fit(_mlp(), 0.5, dynamic="yes"), "True or"),
    "fit inductor-only strategy": (lambda: memfit.fit(_mlp(), 0.5, strategy="fused-chains"),
                                   "compiler='inductor'"),
    "fit another model's optimizer": (
        lambda: memfit.fit(_mlp(), 0.5, optimizer=_foreign_optimizer()), OTHERS),
    "backend another model's optimizer": (
        lambda: memfit.backend(0.5, optimizer=_foreign_optimizer(), model=_mlp()), OTHERS),
    "plan another model's optimizer": (lambda: memfit.plan(
        _mlp(), _loss, X, budget=0.5, optimizer=_foreign_optimizer()), OTHERS),
    "max_batch_size another model's optimizer": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs, "1MiB", optimizer=_foreign_optimizer()), OTHERS),
    "backend hardware": (lambda: memfit.backend(0.5, hardware="h999"), "h100-pcie"),
    "backend measure_runs": (lambda: memfit.backend(0.5, measure_runs="2"), "int"),
    "compile hardware": (lambda: memfit.compile(_mlp(), _loss, 0.5, hardware="h999"), "cpu"),
    "compile strategy": (lambda: memfit.compile(_mlp(), _loss, 0.5, strategy="autoo"), "keep"),
    "compile measure": (lambda: memfit.compile(_mlp(), _loss, 0.5, measure="no"), "True or False"),
    "compile model": (lambda: memfit.compile(_loss, _mlp(), 0.5), "nn.Module"),
    "compile loss_fn": (lambda: memfit.compile(_mlp(), X, 0.5), "callable"),
    "plan hardware": (lambda: memfit.plan(_mlp(), _loss, X, budget=0.5, hardware="h999"), "a100"),
    "plan strategy": (lambda: memfit.plan(_mlp(), _loss, X, budget=0.5, strategy="autoo"), "swap"),
    "plan inductor-only strategy": (lambda: memfit.plan(
        _mlp(), _loss, X, budget=0.5, strategy="fused-chains"), "compiler='inductor'"),
    "plan loss_fn": (lambda: memfit.plan(_mlp(), X, budget=0.5), "callable"),
    "plan inputs": (lambda: memfit.plan(_mlp(), _loss, [X], budget=0.5), "tensors only"),
    "plan optimizer": (lambda: memfit.plan(_mlp(), _loss, X, budget=0.5,
                                           optimizer=torch.optim.AdamW), "Optimizer"),
    "max_batch_size hardware": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs, "1MiB", hardware="h999"), "h200"),
    "max_batch_size strategy": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs, "1MiB", strategy="autoo"), "checkpoint"),
    "max_batch_size make_inputs": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs(4), "1MiB"), "callable"),
    "max_batch_size max_batch": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs, "1MiB", max_batch=0), "1 or more"),
    "max_batch_size optimizer": (lambda: memfit.max_batch_size(
        _mlp(), _loss, _inputs, "1MiB", optimizer="adam"), "Optimizer"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_argument_is_refused_at_the_call_naming_the_choices(name):
    call, choice = CASES[name]
    call_cases_once()
    start_s = time.perf_counter()
    with pytest.raises(ValueError, match=choice):
        call()
    assert time.perf_counter() - start_s < 1.0


def call_cases_once() -> None:
    """Import what the calls import, once, so that the timing is the check's own."""
    if not getattr(call_cases_once, "done", False):
        for call, _ in CASES.values():
            with pytest.raises(ValueError):
                call()
        call_cases_once.done = True


def test_an_optimizer_that_also_steps_parameters_outside_the_model_is_the_loops():
    """An optimizer over the fitted model and a head trained beside it is accepted (it steps
    the model), and the head's parameters and the state the optimizer makes for them are
    planned as resident beside the model's, from the first plan."""
    model, head = _mlp(), nn.Linear(1, 256)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()])
    fitted = memfit.fit(model, budget=1 << 20, optimizer=optimizer)
    before = [p.detach().clone() for p in [*model.parameters(), *head.parameters()]]
    head(fitted(X)).mean().backward()
    optimizer.step()
    after = [*model.parameters(), *head.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    (region,) = fitted._memfit_backend.regions
    parameter_bytes = sum(p.untyped_storage().nbytes() for p in after)
    assert region.resident_bytes >= 3 * parameter_bytes  # each, and AdamW's two states


def test_the_built_in_strategy_names_are_the_registered_ones():
    assert sorted(BUILTIN_MODULES) == sorted(strategy_names())


def test_the_command_line_refuses_an_unknown_strategy_without_loading_the_strategies():
    code = ("import sys\nfrom memfit.cli import main\nassert main(['plan', '--model', 'mlp', "
            "'--strategy', 'autoo']) == 2\nassert 'memfit.planning.solvers' not in sys.modules\n"
            "assert 'torch' not in sys.modules")
    start_s = time.perf_counter()
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert "unknown strategy 'autoo'" in finished.stderr
    assert time.perf_counter() - start_s < 3.0


@pytest.mark.slow
def test_an_empty_batch_runs_as_eager_or_names_the_empty_batch():
    empty = torch.randn(0, 8)
    assert _loss(_mlp(), empty).isnan()
    fitted = memfit.fit(_mlp(), budget=1 << 20)
    loss = _loss(fitted, empty)
    loss.backward()
    assert loss.isnan()
    with pytest.raises(memfit.BudgetError, match="The batch is empty") as raised:
        _loss(memfit.fit(_mlp(), budget=0.5), empty)
    assert "separators" not in str(raised.value)
    with pytest.raises(memfit.BudgetError, match="The batch is empty"):
        memfit.compile(_mlp(), _loss, 0.5)(empty)


@pytest.mark.slow
def test_a_float64_batch_into_a_float32_model_gets_the_dtype_error_before_a_budget_error():
    doubles = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="dtype") as eager:
        _loss(_mlp(), doubles)
    for budget in (0.5, 1000):
        with pytest.raises(RuntimeError, match="dtype") as raised:
            _loss(memfit.fit(_mlp(), budget=budget), doubles)
        assert str(raised.value) == str(eager.value)
        with pytest.raises(RuntimeError, match="dtype"):
            memfit.compile(_mlp(), _loss, budget)(doubles)


@pytest.mark.slow
def test_auto_s_budget_error_names_no_strategy_a_user_cannot_pass():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
    with pytest.raises(memfit.BudgetError) as raised:
        memfit.plan(model, lambda m, x: m(x).square().mean(), torch.randn(256, 64),
                    budget=0.3, hardware="cpu")
    message = str(raised.value)
    named = [word.strip(".,'") for word in message.split("Strategy ")[1:]]
    assert all(name.split()[0] in strategy_names() for name in named), message
    assert "jit-swap" not in message


@pytest.mark.parametrize("loss_fn", [lambda model, x: model(x), lambda model, x: (model(x).mean(), x)],
                         ids=["per-sample", "tuple"])
def test_a_loss_that_is_not_a_scalar_is_refused_by_plan_as_by_compile(loss_fn):
    """memfit.plan traced such a step and planned the backward of a gradient nobody passes."""
    with pytest.raises(memfit.CaptureError, match="loss_fn must return a scalar tensor"):
        memfit.plan(_mlp(), loss_fn, X, hardware="cpu")
    with pytest.raises(memfit.CaptureError, match="loss_fn must return a scalar tensor"):
        memfit.compile(_mlp(), loss_fn, strategy="keep")(X)


class _SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(1000, 16, sparse=True)
        self.body = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                  nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(self.embedding(ids).mean(1))


def test_a_sparse_gradient_is_refused_before_anything_runs_and_its_body_can_be_fitted():
    """A sparse tensor has no storage of its own: memfit refuses it at the first call, naming
    the embedding, with the model as it was; fitting the modules after it trains bit for bit."""
    ids, labels = torch.randint(0, 1000, (512, 8)), torch.randint(0, 4, (512,))
    model = _SparseBag()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(memfit.CaptureError, match="Embedding 'embedding'.*sparse=False"):
        nn.functional.cross_entropy(memfit.fit(model, budget=0.6)(ids), labels).backward()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())
    with pytest.raises(memfit.CaptureError, match="sparse=False"):
        memfit.compile(_SparseBag(), lambda m, x: m(x).square().mean(), 0.6)(ids)

    reference, fitted_model = _SparseBag(), _SparseBag()
    memfit.fit(fitted_model.body, budget=0.9)
    for model in (reference, fitted_model):
        optimizers = [torch.optim.SparseAdam(list(model.embedding.parameters())),
                      torch.optim.AdamW(list(model.body.parameters()))]
        for _ in range(2):
            nn.functional.cross_entropy(model(ids), labels).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    for mine, theirs in zip(fitted_model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_backend_names_itself_in_torchs_errors():
    """Dynamo's ``BackendCompilerFailed`` names the backend by its repr: memfit's, with the
    options a user gave, not an object's address."""
    assert repr(memfit.backend(budget=0.5)) == (
        "memfit (compiler 'aot_eager', strategy 'auto', budget 0.5 of the unplanned peak)")
