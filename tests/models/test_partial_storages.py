"""Models whose captured graphs hold storages that no node covers plan and run bit for bit.

transformers T5 shifts its labels right with ``aten.copy`` into a slice (gapped strides); the
mask of MONAI's shifted-window attention is built by ``slice_scatter`` into slices (an offset,
and in eager a larger storage than the fake tensor's). Under ``checkpoint`` and
``optimal-recompute`` at half the unplanned peak, each step either runs within the budget with
the gradients of the unplanned captured step, or raises a ``BudgetError`` whose minimum then
compiles and runs within it. A plan that swaps every activation runs bit for bit too.
"""

import copy

import pytest
import torch

import memfit
from memfit import examples
from memfit.data.errors import BudgetError
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.lowering.rewrite import storage_names
from memfit.model.recompute import planned_reruns
from memfit.tracing.analyze import storage_key
from tests.measured_peaks import assert_within_budget, tolerance_bytes

MODELS = {"t5": examples.t5, "swin": examples.swin_blocks}
SEED = 7
# the plans that raised PlanError before (the T5 pair, and checkpoint on the Swin mask)
REBUILT_UNCOVERED = {("t5", "checkpoint"), ("t5", "optimal-recompute"), ("swin", "checkpoint")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request):
    """The example and its unplanned captured step (strategy keep), run once."""
    example = MODELS[request.param]()
    inputs = example.inputs()
    keep = memfit.compile(copy.deepcopy(example.model), example.loss_fn, strategy="keep")
    torch.manual_seed(SEED)
    loss = keep(*inputs)
    return {"name": request.param, "example": example, "inputs": inputs, "keep": keep,
            "loss": loss}


def run(reference, **compile_args):
    example = reference["example"]
    step = memfit.compile(copy.deepcopy(example.model), example.loss_fn, **compile_args)
    torch.manual_seed(SEED)
    loss = step(*reference["inputs"])
    assert torch.equal(loss, reference["loss"])
    for (name, got), expected in zip(step.model.named_parameters(),
                                     reference["keep"].model.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad), f"gradient of {name} differs"
    return step


def uncovered(step) -> set[str]:
    """Tensors whose producer's value leaves gaps or an offset in its storage (the fake
    layout, as planned): the ones the rewriter used to refuse to swap or recompute."""
    found = set()
    for graph_module in (step.compiled.forward, step.compiled.backward):  # the planned region
        owner = storage_names(graph_module)
        for node in graph_module.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and owner.get(storage_key(value)) == node.name:
                covers = (value.storage_offset() == 0
                          and value.nbytes == value.untyped_storage().nbytes())
                if not covers and node.op == "call_function":
                    found.add(node.name)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["checkpoint", "optimal-recompute"])
@pytest.mark.filterwarnings("ignore::memfit.BudgetWarning")  # the closed loop warns of a measured peak a little over
def test_half_the_peak_or_a_true_minimum(reference, strategy):
    try:
        step = run(reference, budget=0.5, strategy=strategy)
    except BudgetError as error:
        step = run(reference, budget=error.minimum_bytes, strategy=strategy)
    assert_within_budget(step, step.budget_bytes)
    if (reference["name"], strategy) in REBUILT_UNCOVERED:
        rebuilt = {rerun.op for reruns in planned_reruns(step.graph, step.plan).values()
                   for rerun in reruns}
        assert rebuilt & uncovered(step), "no storage that no node covers was rebuilt"


@pytest.mark.slow
def test_swapping_every_activation_runs_bitwise(reference):
    """Every activation goes to the host right after its producer and comes back for all its
    readers but the ``getitem``s that take it from its producer's tuple: the uncovered storages
    among them."""
    keep = reference["keep"]
    graph = keep.graph
    decisions = {}
    for tensor in graph.tensors.values():
        if tensor.role != "activation" or tensor.is_output or not tensor.consumers:
            continue
        readers = tuple(c for c in tensor.consumers if graph.op(c).kind != "getitem")
        if readers:
            control = graph.ops[graph.index[readers[0]] - 1].name
            decisions[tensor.name] = Swap((SwapIn(control, readers),))
    assert set(decisions) & uncovered(keep), "no uncovered storage is swapped"
    plan = Plan("test", decisions, graph_hash=graph.structure_hash)
    step = run(reference, plan=plan)
    # two measurements, each within the measured-peak tolerance of its prediction (CI measured
    # T5 960 B, 0.03%, above keep's once; alone, below it)
    assert step.measured.peak_bytes <= keep.measured.peak_bytes + tolerance_bytes(
        keep.measured.peak_bytes)
