"""The measured Timeline: a memory curve sampled after every node, equal to the predicted one."""

import memfit
from memfit import examples
from memfit.runtime.profile import op_times


def test_measured_memory_curve_equals_the_predicted_curve_op_by_op():
    example = examples.gpt2(layers=2, width=64, sequence=64, batch_size=2)
    step = memfit.compile(example.model, example.loss_fn, budget="0.6", strategy="swap")
    step(*example.inputs())
    predicted, measured = step.predicted, step.measured
    by_label = dict(zip(predicted.memory_labels, predicted.memory_bytes, strict=True))
    compared = 0
    for label, live_bytes in zip(measured.memory_labels, measured.memory_bytes, strict=True):
        if label in by_label:  # an original op; inserted swap nodes are named differently
            assert live_bytes == by_label[label], label
            compared += 1
    assert compared == len(step.graph.ops)
    assert max(measured.memory_bytes) == measured.peak_bytes == predicted.peak_bytes


def test_op_times_are_measured_per_op_and_feed_the_cost_graph():
    example = examples.mlp(depth=2, width=32, batch_size=64)
    step = memfit.compile(example.model, example.loss_fn, strategy="keep")
    step(*example.inputs())
    times = op_times(step.measured)
    assert set(times) == {op.name for op in step.graph.ops}
    assert all(t >= 0 for t in times.values())
    timed = step.graph.with_times(times)
    assert timed.step_time_s == sum(times.values())
