"""A fitted call that traced leaves nothing holding its output: the loop alone decides what lives.

Dynamo's trace of GPT-2 meets Python exceptions it simulates (``hasattr`` on the config); the
exception's traceback and the closure of Dynamo's handler form reference cycles through the
frames above the trace, and those frames hold the call's output among their locals. Until a
collection runs, the logits and key/value cache a loop dropped stay alive through the backward,
above a plan that freed them. Dynamo collects only the two younger generations after a compile
(``run_gc_after_compile``); in a long process the cycles, promoted to the oldest generation by the
collections the compile itself started, survive that, and full collections are rare. Here the
collector is off for the call and Dynamo's own collection with it, which leaves the cycles as
that process does; memfit collects fully after a call that traced.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

import memfit
from memfit import examples

pytestmark = pytest.mark.usefixtures("compiled_fresh")


def test_the_output_a_loop_drops_is_freed_after_the_call_that_traced():
    example = examples.gpt2(layers=1, width=32, heads=2, vocab=64, sequence=16, batch_size=2)
    fitted = memfit.fit(example.model)  # no budget on a CPU: keep, the plan that frees least
    input_ids, labels = example.inputs()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch._dynamo.config.patch(run_gc_after_compile=False):
            output = fitted(input_ids=input_ids, labels=labels)
            logits = weakref.ref(output.logits)
        loss = output.loss
        del output
        alive = logits() is not None
    finally:
        if was_enabled:
            gc.enable()
    loss.backward()
    assert not alive, "the call's logits outlived the loop's last reference to them"


def _minimum_bytes(example: examples.Example, input_ids, labels) -> int:
    """The smallest peak memfit.backend names for the example's ``labels=`` step."""
    compiled = torch.compile(example.model, backend=memfit.backend(budget=1000, model=example.model))
    with pytest.raises(Exception) as refused:
        compiled(input_ids=input_ids, labels=labels)
    error = getattr(refused.value, "inner_exception", refused.value)
    assert isinstance(error, memfit.BudgetError), refused.value
    torch._dynamo.reset()
    return error.minimum_bytes


def test_a_backend_region_planned_for_the_loop_runs_as_planned_after_a_trace():
    """``torch.compile(model, backend=memfit.backend(...))`` has no fitted call to collect after
    it: at its smallest peak, GPT-2's region is planned with its logits and key/value cache freed
    after its forward; with the trace's cycles left alive, its backward still runs that plan
    (no ``BudgetWarning``: no refuted lifetimes, no measured peak above the prediction), and the
    outputs nothing used reach its backward as ``None``, not as zeros autograd made."""
    example = examples.gpt2(layers=1, width=32, heads=2, vocab=512, sequence=64, batch_size=4)
    input_ids, labels = example.inputs()
    minimum = _minimum_bytes(example, input_ids, labels)
    backend = memfit.backend(budget=minimum, model=example.model)
    compiled = torch.compile(example.model, backend=backend)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", memfit.BudgetWarning)
            with torch._dynamo.config.patch(run_gc_after_compile=False):
                output = compiled(input_ids=input_ids, labels=labels)
            loss = output.loss
            del output
            loss.backward()
    finally:
        if was_enabled:
            gc.enable()
    (region,) = backend.regions
    assert region.released_outputs, "the plan did not free the outputs: nothing was tested"
    assert not region.loop_refuted
