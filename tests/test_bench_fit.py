"""The memfit.fit benchmark's core on a tiny MLP (aot_eager only: inductor compiles C++).

Checks what makes its rows mean what they say: every method has a row, memfit's weights are
eager's bit for bit, and no method compiles again while it is timed (a Dynamo reset between
builds did that, and a second ``torch.compile(backend="aot_eager")`` reused the first's graph).
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench import fit
from memfit import examples

TINY = fit.FitModel(lambda: examples.mlp(depth=4, width=32, batch_size=64), ("Linear",))


@pytest.fixture(scope="module")
def rows_and_log():
    messages: list[str] = []
    compilers = fit.COMPILERS
    fit.COMPILERS = ("aot_eager",)
    try:
        rows = fit.fit_rows(TINY, messages.append)
    finally:
        fit.COMPILERS = compilers
        torch._dynamo.reset()
    return {row[1]: row for row in rows}, messages


@pytest.mark.slow
def test_every_method_has_a_row(rows_and_log):
    rows, _ = rows_and_log
    assert list(rows)[:2] == [fit.EAGER, fit.CHECKPOINT]
    assert 'torch.compile(backend="aot_eager")' in rows
    assert "torch.compile aot_eager, activation_memory_budget 0.5" in rows
    for name in ("keep", "auto, 0.5 of eager", "auto, 0.3 of eager",
                 "auto at checkpointing's peak"):
        assert f"memfit.fit {name} (aot_eager)" in rows


def test_memfit_rows_train_as_eager_and_fit_their_budgets(rows_and_log):
    rows, _ = rows_and_log
    memfit_rows = [row for name, row in rows.items() if name.startswith("memfit.fit")]
    fitted = [row for row in memfit_rows if row[2] != "-"]
    assert fitted, memfit_rows
    assert all(row[6] == "bitwise eager's" for row in fitted), fitted
    half = rows["memfit.fit auto, 0.5 of eager (aot_eager)"]
    if half[2] != "-":
        assert float(half[3].rstrip("x")) <= 0.5


def test_nothing_compiles_while_timed(rows_and_log):
    _, messages = rows_and_log
    assert not [m for m in messages if "compiled while timed" in m], messages


def test_each_compiled_row_gets_its_own_graph():
    from torch._dynamo.utils import counters

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        torch.compile(copy.deepcopy(model), backend=fit.own_backend("aot_eager"))(x)
    assert counters["stats"]["unique_graphs"] - before == 2
    torch._dynamo.reset()


def test_weights_verdict_says_bitwise_allclose_or_how_far():
    model = torch.nn.Linear(4, 4)
    same = copy.deepcopy(model)
    assert fit.weights_verdict(same, model, "eager") == "bitwise eager's"
    with torch.no_grad():
        same.weight[0, 0] += 1e-6
    assert fit.weights_verdict(same, model, "eager") == "allclose eager's"
    with torch.no_grad():
        same.weight[0, 0] += 1e-2
    assert fit.weights_verdict(same, model, "eager").startswith("differ from eager's (up to 1.0e-02")


def test_a_model_whose_process_dies_gets_a_row_and_the_section_goes_on():
    """``os.abort`` in the child stands for a compiled kernel that corrupts the heap."""
    import os

    (row,) = fit.isolated_rows(fit.FitModel(os.abort, name="aborts"))
    assert row[:2] == ("aborts", "(every method)")
    assert "died" in row[-1]
