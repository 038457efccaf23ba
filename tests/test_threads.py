"""Two compiled steps of two models, run at once in two threads, give each model's own gradients."""

import copy
import threading

import pytest
import torch

import memfit
from memfit import examples

ITERATIONS = 3


def run_steps(example, iterations, barrier=None):
    """Compile a swap plan for a copy of the model, run it ``iterations`` times, return its
    gradients; with a barrier, every step starts together with the other thread's."""
    model = copy.deepcopy(example.model)
    # unmeasured: a measured step runs alone (the profiler's allocator events are process-wide),
    # an unmeasured one that traces nothing runs beside the other thread's
    step = memfit.compile(model, example.loss_fn, budget="0.8", strategy="swap", measure=False)
    inputs = example.inputs()
    try:
        for _ in range(iterations):
            model.zero_grad(set_to_none=True)  # kept gradients would make each step re-plan
            if barrier is not None:
                barrier.wait()
            step(*inputs)
    except BaseException:
        if barrier is not None:
            barrier.abort()  # the other thread must not wait for this one forever
        raise
    assert step.plan.swapped, "the plan must swap, so the copy engine is in use"
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_two_models_stepping_in_two_threads_get_their_own_exact_gradients():
    """The copy engine is per run (a context variable) and captures take turns: before, a run
    ending in one thread took the engine away from the other ("ran outside a copy engine")."""
    models = {"wide": examples.mlp(depth=6, width=64, batch_size=512, seed=1),
              "narrow": examples.mlp(depth=6, width=48, batch_size=512, seed=2)}
    alone = {name: run_steps(example, ITERATIONS) for name, example in models.items()}
    barrier = threading.Barrier(len(models), timeout=120)
    together, errors = {}, {}

    def worker(name):
        try:
            together[name] = run_steps(models[name], ITERATIONS, barrier)
        except BaseException as error:  # reported below, with the thread's name
            errors[name] = error

    threads = [threading.Thread(target=worker, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for name, gradients in alone.items():
        assert gradients.keys() == together[name].keys()
        for parameter, gradient in gradients.items():
            assert torch.equal(together[name][parameter], gradient), (name, parameter)
