"""Run by .ci/run in a throwaway venv holding `pip install .` and nothing else.

An undeclared import fails here: the default strategy (auto, with its MILP and separator
searches) plans and runs one step of a small MLP at half of its unplanned peak, and the
gradients match plain PyTorch's.
"""

import torch
from torch import nn

import memfit

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.ReLU())],
                      nn.Linear(64, 1))
reference = [parameter.detach().clone() for parameter in model.parameters()]
x, y = torch.randn(2048, 64), torch.randn(2048, 1)


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


step = memfit.compile(model, loss_fn, budget=0.5)
loss = step(x, y)
measured = step.measured
assert measured is not None and step.compiled.budget_bytes is not None
assert measured.peak_bytes <= step.compiled.budget_bytes, (measured.peak_bytes,
                                                           step.compiled.budget_bytes)
memfit_grads = [parameter.grad.clone() for parameter in model.parameters()]
for parameter, original in zip(model.parameters(), reference, strict=True):
    assert torch.equal(parameter, original)
    parameter.grad = None
loss_fn(model, x, y).backward()
for parameter, grad in zip(model.parameters(), memfit_grads, strict=True):
    torch.testing.assert_close(grad, parameter.grad)
print(f"fresh install ok: strategy {step.plan.strategy} ({step.plan.params.get('solver')}), "
      f"peak {measured.peak_bytes} B within {step.compiled.budget_bytes} B")
