"""memfit.fit beside what a user would pick instead, in a user's own loop (issue 12's table).

Every method trains a fresh copy of the same weights on the same batch with the same seed, one
whole iteration each (forward, ``loss.backward()``, AdamW ``step``, ``zero_grad``): the peak is
the iteration's, optimizer state included, measured by the allocator's own statistics
(``measure_allocator_peak``: the profiler's CPU-allocator events above the resident parameters,
optimizer state and batch), since a dispatch mode would disable compiled code. Budgets are
fractions of eager's measured peak. Times are medians of interleaved runs after warm-ups that
compile and plan.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

import memfit
from bench.common import interleaved_medians_s, mib, ms
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

FIT_HEADERS = ("model", "method", "iteration peak", "vs eager", "step time", "vs eager",
               "weights after 2 steps")
COMPILERS = ("aot_eager",)


@dataclass
class Method:
    name: str
    build: Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer]]


def _loop(model: torch.nn.Module, trained: torch.nn.Module, loss_fn: Callable, inputs: tuple,
          optimizer: torch.optim.Optimizer, budget_patch: float | None = None):
    def iteration() -> torch.Tensor:
        torch.manual_seed(0)
        if budget_patch is None:
            loss = loss_fn(model, *inputs)
            loss.backward()
        else:
            with torch._functorch.config.patch(activation_memory_budget=budget_patch):
                loss = loss_fn(model, *inputs)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return iteration


def _methods(example: examples.Example, inputs: tuple, eager_peak: int | None,
             checkpoint_peak: int | None) -> list[Method]:
    def fresh(wrap=None, patch=None, checkpoint=False):
        def build():
            torch._dynamo.reset()
            model = copy.deepcopy(example.model)
            if checkpoint:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            optimizer = torch.optim.AdamW(model.parameters())
            runner = wrap(model, optimizer) if wrap else model
            return model, _loop(runner, model, example.loss_fn, inputs, optimizer, patch), optimizer
        return build

    methods = [Method("eager", fresh())]
    if _checkpointable(example.model):
        methods.append(Method("torch.utils.checkpoint, every block", fresh(checkpoint=True)))
    methods += [
        Method('torch.compile(backend="aot_eager")',
               fresh(lambda m, o: torch.compile(m, backend="aot_eager"))),
        Method('torch.compile(backend="inductor")',
               fresh(lambda m, o: torch.compile(m, backend="inductor"))),
        Method("torch.compile aot_eager, activation_memory_budget 0.5",
               fresh(lambda m, o: torch.compile(m, backend="aot_eager"), patch=0.5)),
    ]
    for compiler in COMPILERS:
        methods.append(Method(f'memfit.fit keep ({compiler})', fresh(
            lambda m, o, c=compiler: memfit.fit(m, strategy="keep", compiler=c, optimizer=o))))
        if eager_peak is None:
            continue
        for fraction in (0.5, 0.3):
            budget = int(fraction * eager_peak)
            methods.append(Method(f"memfit.fit auto, {fraction:g} of eager ({compiler})", fresh(
                lambda m, o, c=compiler, b=budget: memfit.fit(m, budget=b, compiler=c,
                                                              optimizer=o))))
        if checkpoint_peak is not None:
            methods.append(Method(f"memfit.fit auto at checkpointing's peak ({compiler})", fresh(
                lambda m, o, c=compiler, b=checkpoint_peak: memfit.fit(m, budget=b, compiler=c,
                                                                       optimizer=o))))
    return methods


def _checkpointable(model: torch.nn.Module) -> bool:
    """Whether the model has transformers' per-block checkpointing switch."""
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def _measure(method: Method, inputs: tuple):
    """(model, peak bytes, run) after two measured iterations, or the error that stopped it."""
    model, run, optimizer = method.build()
    peaks = []
    for _ in range(2):  # the first iteration compiles and plans; both must fit
        measured = measure_allocator_peak(
            run, track=(list(model.parameters()), optimizer.state, inputs))
        peaks.append(measured.peak_bytes)
    return model, max(peaks), run


def fit_rows(example: examples.Example, log) -> list[tuple]:
    """One row per method for ``example``, in one process."""
    inputs = example.inputs()
    eager_model, eager_peak, eager_run = _measure(_methods(example, inputs, None, None)[0], inputs)
    checkpoint_peak = None
    if _checkpointable(example.model):
        checkpoint_method = _methods(example, inputs, None, None)[1]
        _, checkpoint_peak, _ = _measure(checkpoint_method, inputs)
    results = []
    for method in _methods(example, inputs, eager_peak, checkpoint_peak):
        log(f"fit bench: {example.name}: {method.name}")
        try:
            model, peak, run = _measure(method, inputs)
        except memfit.BudgetError as error:
            results.append((method.name, None, None, f"does not fit: smallest "
                            f"{mib(error.minimum_bytes)}"))
            continue
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                     eager_model.parameters(), strict=True))
        results.append((method.name, peak, run, "bitwise eager's" if same else "differ"))
    runnable = [r for r in results if r[2] is not None]
    times = dict(zip((r[0] for r in runnable),
                     interleaved_medians_s([r[2] for r in runnable], repeats=3), strict=True))
    eager_time = times["eager"]
    rows = []
    for name, peak, _, weights in results:
        if peak is None:
            rows.append((example.name, name, "-", "-", "-", "-", weights))
            continue
        rows.append((example.name, name, mib(peak), f"{peak / eager_peak:.2f}x", ms(times[name]),
                     f"{times[name] / eager_time:.2f}x", weights))
    return rows


def fit_section(log) -> str:
    """The Markdown section: GPT-2, ResNet-50-shaped and the 3D U-Net."""
    cases = [examples.gpt2(layers=4, width=128, heads=4, vocab=256, sequence=256, batch_size=8),
             examples.resnet50_shaped(batch_size=16), examples.unet3d()]
    rows = [row for example in cases for row in fit_rows(example, log)]
    return "\n".join([
        "## memfit.fit in a training loop beside the alternatives (CPU)\n",
        __doc__.split("\n\n", 1)[1].strip() + "\n",
        "Command: `python -m bench.run --only fit`. Goals (issue 12): `keep` within 1.05x of "
        "`torch.compile` with the same compiler; at checkpointing's peak, memfit faster than "
        "checkpointing.\n",
        "| " + " | ".join(FIT_HEADERS) + " |",
        "|" + "|".join("---" for _ in FIT_HEADERS) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ])
