"""Recomputation in the forward pass: re-runs that lower a peak sitting in the forward pass.

A synthetic graph first (the article's example: values read by an early and a late branch,
a large value made between the two reads), then a torch model end to end: gradients bit for
bit those of the unplanned step, the measured peak the predicted one and within the budget.
"""

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.data.costgraph import CostGraph, Op, Tensor
from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.model.schedule import lower, memory_profile
from memfit.model.simulate import simulate
from memfit.planning.strategies import get_strategy
from memfit.planning.strategies.recomputing._forward_recompute import recompute_in_forward
from tests.measured_peaks import assert_measured_as_predicted, assert_within_budget

MiB = 1 << 20
HARDWARE = get_hardware("cpu")


def side_branches(sides: int = 4, side_bytes: int = 4 * MiB, wide_bytes: int = 8 * MiB,
                  random_side: bool = False) -> CostGraph:
    """``side{i} = sin(x)`` read early by ``h{i+1} = h{i} + side{i}`` and late by
    ``g{i+1} = g{i} * side{i}``, a wide value made between: every side is live at the wide op.

    Only the late multiplications read the sides in the backward pass (an add's backward reads
    nothing), so checkpointing rebuilds one side at a time there: the peak is in the forward.
    """
    tensors = [Tensor("x", MiB, "input"), Tensor("w", 1024, "parameter")]
    ops: list[Op] = []

    def add(name, kind, phase, inputs, size_bytes, time_s=1e-3, output=False):
        made = {op.name for op in ops}
        role = "activation" if phase == "forward" else "gradient"
        tensors.append(Tensor(name, size_bytes, role, is_output=output))
        ops.append(Op(name, kind, phase, inputs=tuple(inputs), outputs=(name,),
                      depends_on=tuple(i for i in inputs if i in made), time_s=time_s))

    for i in range(sides):
        kind = "aten.native_dropout" if random_side and i == 0 else "aten.sin"
        add(f"side{i}", kind, "forward", ["x"], side_bytes, 1e-5)
    add("h0", "aten.mm", "forward", ["x", "w"], MiB)
    for i in range(sides):
        add(f"h{i + 1}", "aten.add", "forward", [f"h{i}", f"side{i}"], MiB, 1e-5)
    add("wide", "aten.mm", "forward", [f"h{sides}", "w"], wide_bytes)
    add("g0", "aten.relu", "forward", ["wide"], MiB, 1e-5)
    for i in range(sides):
        add(f"g{i + 1}", "aten.mul", "forward", [f"g{i}", f"side{i}"], MiB, 1e-5)
    add("loss", "aten.sum", "forward", [f"g{sides}"], 4, 1e-6, output=True)
    add(f"dg{sides}", "aten.expand", "backward", ["loss"], MiB, 1e-6)
    for i in reversed(range(sides)):
        add(f"dg{i}", "aten.mul", "backward", [f"dg{i + 1}", f"side{i}"], MiB, 1e-5)
    add("dwide", "aten.threshold_backward", "backward", ["dg0", "g0"], wide_bytes, 1e-5)
    add("dh", "aten.mm", "backward", ["dwide", "w"], MiB)
    add("dw", "aten.mm", "backward", ["dh", "x", f"h{sides}", "dwide"], 1024, output=True)
    return CostGraph.build(ops, tensors, name="side_branches")


def peak(graph: CostGraph, plan: Plan) -> tuple[int, str]:
    schedule = lower(graph, plan)
    profile = memory_profile(schedule)
    return profile.peak_bytes, graph.op(schedule.actions[profile.peak_index].op).phase


def test_forward_reruns_lower_a_forward_peak():
    graph = side_branches()
    backward_only = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=False)
    before_bytes, phase = peak(graph, backward_only)
    assert phase == "forward"
    assert before_bytes == 27 * MiB + 1024  # x, w, four sides, h4 and the wide value
    made = recompute_in_forward(graph, backward_only, HARDWARE, None)
    after_bytes, phase = peak(graph, made)
    # the peak moved to the backward pass: x, w, the wide gradient, h4, g0, dg0 and the loss
    assert (after_bytes, phase) == (12 * MiB + 1024 + 4, "backward")
    late = {(f"side{i}", f"g{i + 1}") for i in range(4)}
    assert late <= {(r.op, r.before) for r in made.reruns}
    assert made.decisions == backward_only.decisions
    timeline = simulate(graph, made, HARDWARE)
    assert timeline.peak_bytes == after_bytes
    rerun_s = sum(graph.op(r.op).time_s for r in made.reruns)
    assert timeline.recompute_s == pytest.approx(
        simulate(graph, backward_only, HARDWARE).recompute_s + rerun_s)


def test_stops_at_the_budget_and_never_raises_the_peak():
    graph = side_branches()
    backward_only = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=False)
    before_bytes, _ = peak(graph, backward_only)
    budget_bytes = before_bytes - 6 * MiB
    made = recompute_in_forward(graph, backward_only, HARDWARE, budget_bytes)
    assert len(made.reruns) == 2  # each frees one 4 MiB side: two are enough
    assert peak(graph, made)[0] <= budget_bytes
    keep = Plan("keep")
    assert peak(graph, recompute_in_forward(graph, keep, HARDWARE, None))[0] <= peak(graph, keep)[0]


def test_checkpoint_turns_forward_recompute_on_when_the_budget_needs_it():
    graph = side_branches()
    backward_only = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=False)
    budget_bytes = peak(graph, backward_only)[0] - MiB
    with pytest.raises(memfit.BudgetError):
        get_strategy("checkpoint")(graph, HARDWARE, budget_bytes, forward_recompute=False)
    made = get_strategy("checkpoint")(graph, HARDWARE, budget_bytes)
    assert made.reruns and peak(graph, made)[0] <= budget_bytes
    assert not get_strategy("checkpoint")(graph, HARDWARE).reruns  # no budget: off by default
    with pytest.raises(ValueError, match="forward_recompute"):
        get_strategy("checkpoint")(graph, HARDWARE, forward_recompute="yes")


def test_ops_that_return_step_outputs_are_never_rerun():
    """A buffer update (BatchNorm's running statistics) is a step output: its op stays put."""
    graph = side_branches()
    tensors = [t if t.name != "side1" else Tensor("side1", t.size_bytes, t.role, is_output=True)
               for t in graph.tensors.values()]
    graph = CostGraph.build(graph.ops, tensors, graph.name)
    made = recompute_in_forward(graph, Plan("keep"), HARDWARE, None)
    assert made.reruns and all(r.op != "side1" for r in made.reruns)


# ---- end to end on a torch model -------------------------------------------------------------


class SideBranches(nn.Module):
    """Features of the input (no parameters, with dropout) added early, multiplied late."""

    def __init__(self, width: int = 64, sides: int = 12, wide: int = 4):
        super().__init__()
        self.sides = sides
        self.drop = nn.Dropout(0.25)
        self.inner = nn.Linear(width, width)
        self.up = nn.Linear(width, width * wide)
        self.down = nn.Linear(width * wide, width)

    def forward(self, x):
        features = [self.drop(torch.sin(x * (i + 1))) for i in range(self.sides)]
        h = self.inner(x)
        for feature in features:
            h = h + feature
        g = self.down(torch.relu(self.up(h)))
        for feature in features:
            g = g * feature
        return g


def loss_fn(model, x):
    return model(x).square().mean()


def run(model, x, **compile_args):
    step = memfit.compile(model, loss_fn, **compile_args)
    torch.manual_seed(0)
    return step, step(x)


def test_checkpoint_with_forward_recompute_end_to_end():
    torch.manual_seed(0)
    initial = SideBranches()
    x = torch.randn(512, 64)
    keep_model = copy.deepcopy(initial)
    keep, keep_loss = run(keep_model, x, strategy="keep")
    probe = get_strategy("checkpoint")(keep.graph, HARDWARE, forward_recompute=False)
    backward_only_bytes, phase = peak(keep.graph, probe)
    assert phase == "forward"
    budget_bytes = backward_only_bytes - 4 * 512 * 64 * 4  # four sides less than checkpointing
    model = copy.deepcopy(initial)
    step, loss = run(model, x, budget=budget_bytes, strategy="checkpoint")
    reruns = {(r.op, r.before) for r in step.plan.reruns}
    assert reruns and all(step.graph.op(b).phase == "forward" for _, b in reruns)
    assert any("dropout" in step.graph.op(op).kind for op, _ in reruns)  # a random op re-run
    assert torch.equal(loss, keep_loss)
    for (name, got), expected in zip(model.named_parameters(), keep_model.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad), f"gradient of {name} differs"
    measured, predicted = step.measured.peak_bytes, step.compiled.predicted_peak_bytes
    assert_measured_as_predicted(step)
    assert_within_budget(step, budget_bytes)
    assert predicted <= budget_bytes < keep.measured.peak_bytes
    assert measured < keep.measured.peak_bytes


def test_unet_forward_peak_at_the_loss_is_left_alone():
    """MONAI's 3D UNet under checkpointing peaks at the loss, the end of the forward pass:
    every skip connection has been read for the last time by then, so no forward re-run
    frees anything there, and the plan comes back unchanged rather than with useless re-runs.
    """
    from memfit import examples
    from memfit.tracing.analyze import analyze
    from memfit.tracing.capture import capture

    example = examples.unet3d(channels=(4, 8, 16), size=16)
    graph = analyze(capture(example.model, example.loss_fn, *example.inputs()), HARDWARE)
    backward_only = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=False)
    schedule = lower(graph, backward_only)
    profile = memory_profile(schedule)
    assert schedule.actions[profile.peak_index].op == "pow_1"  # (output - target) ** 2
    made = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=True)
    assert made.reruns == ()
    assert peak(graph, made)[0] == profile.peak_bytes


def test_optimal_recompute_reruns_forward_values_when_backward_recompute_cannot_fit():
    graph = side_branches(sides=8)
    backward_only = get_strategy("checkpoint")(graph, HARDWARE, forward_recompute=False)
    budget_bytes = peak(graph, backward_only)[0] - 6 * MiB
    made = get_strategy("optimal-recompute")(graph, HARDWARE, budget_bytes, method="segments")
    assert made.params["solver"] == "segments + forward"
    assert peak(graph, made)[0] <= budget_bytes
    poor = get_strategy("memory-poor")(graph, HARDWARE)
    assert simulate(graph, made, HARDWARE).recompute_s <= simulate(graph, poor, HARDWARE).recompute_s
