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
