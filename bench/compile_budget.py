"""memfit with inductor at the memory torch.compile's own budget reaches (issue 30's table).

``torch.compile(backend="inductor")`` with ``torch._functorch.config.activation_memory_budget``
at 0.5 and 0.3 is what a GPU user tries first when activations do not fit: its partitioner
recomputes the cheapest activations until the saved bytes are that fraction of all. Each row of
it is measured (the iteration's peak: forward, ``loss.backward()``, AdamW ``step``,
``zero_grad``, by the allocator's own statistics, ``measure_allocator_peak``), then memfit with
``compiler="inductor"`` runs at that measured peak as its budget, in bytes, planned with this
CPU's measured profile (``memfit.measure_hardware()``, what ``memfit.fit`` measures on its own
on a GPU; on a CPU its default is the nominal ``cpu`` profile). Both are timed in
the same interleaved rounds as eager and plain ``torch.compile(backend="inductor")`` (medians of
``TIMED_ROUNDS``, after warm-ups that compile, plan and finish memfit's measured runs), and
their weights after the same three iterations (two measured, one more: ``_measure``) are
compared with plain ``torch.compile``'s, before the timed rounds. Where they differ, the first
iteration's gradients of fresh builds are compared too (``gradients_verdict``): AdamW moves a
weight by about its learning rate whatever the size of its gradient, so a gradient near zero
that two fused programs round differently moves weights far past float32's tolerance.

The models have no dropout: memfit's inductor draws eager's random numbers
(``fallback_random``: a re-run replays the forward's draws) and ``torch.compile`` its own, so
with dropout their weights could not be compared.
"""

from __future__ import annotations

import functools

import torch

import memfit
from bench.common import mib, ms
from bench.fit import (
    EAGER,
    RECOMPILE_LIMIT,
    FitModel,
    Measured,
    Method,
    _builder,
    _measure,
    _timed,
    compiled_name,
    first_step_gradients,
    gradients_verdict,
    isolated_rows,
    own_backend,
    weights_verdict,
)
from bench.recompute_methods import SINGLE_THREAD_NOTE
from memfit import examples
from memfit.data.units import parse_bytes

HEADERS = ("model", "torch.compile's budget", "method", "iteration peak", "step time",
           "vs torch.compile", "weights after 3 steps")
FRACTIONS = (0.5, 0.3)  # torch.compile's activation_memory_budget
# interleaved timed rounds: steps of tens of milliseconds, whose ratios the goal compares within a
# few percent; five rounds put the same plan 10% apart between its 0.5 and 0.3 rows
TIMED_ROUNDS = 21
INDUCTOR = compiled_name("inductor")
MODELS = (
    FitModel(functools.partial(examples.gpt2, layers=4, width=128, heads=4, vocab=256,
                               sequence=128, batch_size=4, dropout=0.0), name="gpt2"),
    FitModel(functools.partial(examples.bert, layers=4, width=128, heads=4, vocab=256,
                               sequence=128, batch_size=8), name="bert (padded)"),
    FitModel(functools.partial(examples.cnn, channels=32, blocks=4, image=32, batch_size=16),
             name="cnn (BatchNorm)"),
)


def _compiled(example: examples.Example, inputs: tuple, fraction: float | None) -> Method:
    name = INDUCTOR if fraction is None else f"{INDUCTOR}, activation_memory_budget {fraction:g}"
    compiled = _builder(example, inputs,
                        lambda model, _: torch.compile(model, backend=own_backend("inductor")),
                        patch=fraction)
    return Method(name, compiled, reference=INDUCTOR)


def _memfit_at(example: examples.Example, inputs: tuple, fraction: float, budget_bytes: int,
               hardware: memfit.Hardware) -> Method:
    return Method(f'memfit.fit(compiler="inductor") at the peak of budget {fraction:g}',
                  _builder(example, inputs, lambda model, optimizer: memfit.fit(
                      model, budget=budget_bytes, compiler="inductor", optimizer=optimizer,
                      hardware=hardware)),
                  reference=INDUCTOR)


def budget_rows(bench: FitModel) -> list[tuple]:
    """The model's rows, in one process on one intra-op thread."""
    from bench.run import log

    torch.set_num_threads(1)
    example = bench.build()
    inputs = example.inputs()
    hardware = memfit.measure_hardware("cpu")  # what a GPU user's fit measures by default
    torch._dynamo.reset()
    results: dict[str, Measured] = {}
    pairs: list[tuple[float, str, str]] = []  # fraction, torch.compile's row, memfit's row
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        for method in (Method(EAGER, _builder(example, inputs)), _compiled(example, inputs, None)):
            log(f"compile budget bench: {bench.name}: {method.name}")
            results[method.name] = _measure(method, inputs)
        for fraction in FRACTIONS:
            compiled = _compiled(example, inputs, fraction)
            log(f"compile budget bench: {bench.name}: {compiled.name}")
            results[compiled.name] = _measure(compiled, inputs)
            peak = results[compiled.name].peak_bytes
            assert peak is not None  # torch.compile has no budget to refuse
            planned = _memfit_at(example, inputs, fraction, peak, hardware)
            log(f"compile budget bench: {bench.name}: {planned.name}")
            results[planned.name] = _measure(planned, inputs)
            pairs.append((fraction, compiled.name, planned.name))
        reference = results[INDUCTOR].model
        verdicts = {name: weights_verdict(result.model, reference, INDUCTOR)
                    for name, result in results.items() if result.model is not None}
        differing = [name for name, text in verdicts.items()
                     if text.startswith("differ") and name.startswith("memfit")]
        if differing:  # plain torch.compile's gradients, built and compiled once more
            log(f"compile budget bench: {bench.name}: first-step gradients")
            expected = first_step_gradients(results[INDUCTOR].method)
            for name in differing:
                gradients = gradients_verdict(results[name].method, expected, INDUCTOR)
                verdicts[name] += f"; first-step gradients {gradients}"
        times = _timed(results, log, TIMED_ROUNDS)
    rows = []
    for fraction, compiled_row, planned_row in pairs:
        for name in (compiled_row, planned_row):
            result = results[name]
            if result.model is None or result.peak_bytes is None:
                rows.append((bench.name, f"{fraction:g}", name, "-", "-", "-", result.refused))
                continue
            rows.append((bench.name, f"{fraction:g}", name, mib(result.peak_bytes),
                         ms(times[name]), f"{times[name] / times[compiled_row]:.2f}x",
                         verdicts[name]))
    plain = results[INDUCTOR]
    rows.append((bench.name, "-", INDUCTOR, mib(plain.peak_bytes) if plain.peak_bytes else "-",
                 ms(times[INDUCTOR]), "-", "reference"))
    return rows


def verdict(rows: list[tuple]) -> str:
    """Issue 30's goal on the rows: at each budget-0.5 peak, memfit's step at most
    torch.compile's, and within that peak."""
    lines = []
    for model in dict.fromkeys(row[0] for row in rows):
        pair = [row for row in rows if row[0] == model and row[1] == "0.5"]
        if len(pair) != 2 or "-" in (pair[0][4], pair[1][4]):
            lines.append(f"{model}: not measured")
            continue
        ratio = pair[1][5]
        faster = float(ratio.rstrip("x")) <= 1.0
        within = parse_bytes(pair[1][3]) <= parse_bytes(pair[0][3])
        lines.append(f"{model}: memfit {pair[1][4]} at {pair[1][3]} against torch.compile's "
                     f"{pair[0][4]} at {pair[0][3]} ({ratio}"
                     f"{'' if within else ', over its peak'}): "
                     f"{'met' if faster and within else '**not met**'}")
    return "Goal (issue 30: at budget 0.5's measured peak, memfit inductor's step at most " \
           "torch.compile's): " + "; ".join(lines) + "."


def compile_budget_section(log) -> str:
    rows = []
    for bench in MODELS:
        log(f"compile budget bench: {bench.name} in a child process")
        rows.extend(isolated_rows(bench, budget_rows, len(HEADERS)))
    return "\n".join([
        "## memfit inductor at torch.compile's activation memory budget (CPU)\n",
        __doc__.split("\n\n", 1)[1].strip() + "\n",
        SINGLE_THREAD_NOTE + "\n",
        "Command: `python -m bench.run --only compile_budget`. " + verdict(rows) + "\n",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ])
