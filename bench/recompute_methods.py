"""The recomputation benchmark's methods: the models, every way to run a step, and what a row holds.

Part of the recomputation section (``bench/recompute.py``): eager; ``torch.utils.checkpoint``
around every block and around every other block; ``torch.compile(backend="aot_eager")`` under
``activation_memory_budget``; memfit's ``checkpoint`` modes and budgets; memfit ``keep`` and
``swap``; and the optimal schedule (``optimal-recompute``) at fractions of the unplanned peak, at
other methods' peaks and at its own minimum. ``bench/recompute_measure.py`` runs and measures
them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from bench.common import compiled_step, eager_step, memfit_step
from memfit import examples
from memfit.data.errors import BudgetError

SEED = 0
BUDGET_FRACTIONS = (0.9, 0.7, 0.5, 0.3)  # of the unplanned peak, for memfit and optimal
COMPILE_BUDGETS = (0.9, 0.7, 0.5, 0.3)  # torch._functorch activation_memory_budget values
REPEATS = 3  # timed steps per method after the warm-up; the median is reported
OPTIMAL = "optimal-recompute"
EAGER_BY_PROFILER = "eager, peak by the profiler (compiled rows' 100%)"
SINGLE_THREAD_NOTE = (
    "Every method runs on one intra-op thread: on a 2-core machine shared with other jobs, two "
    "OpenMP threads competing with another process made single steps up to 10x slower at random "
    "(a 85 ms ResNet step took 6.7 s), which no median of 3 survives.")


@dataclass(frozen=True)
class RecomputeModel:
    """A model at its bench size and what a "block" is for it.

    Args:
        block_types: class names of the modules wrapped by ``torch.utils.checkpoint`` and named
            as memfit checkpoints; a match nested inside another match is not a block.
        block_description: the same in words, for the table's caption.
    """

    name: str
    build: Callable[[], examples.Example]
    batch_size: int
    block_types: tuple[str, ...]
    block_description: str


@dataclass
class Method:
    """One way to run the step: ``build()`` returns ``(model, run, memfit step or None)``."""

    family: str  # the plot's series
    name: str
    peak_method: str  # "tracker" or "profiler"
    build: Callable[[], tuple[nn.Module, Callable[[], torch.Tensor], memfit.Step | None]]
    compile_budget: float | None = None  # activation_memory_budget for compiled methods
    blocks: tuple[str, ...] = ()  # the blocks torch.utils.checkpoint wraps, to price its re-runs
    copies: str = ""  # for an optimal row at another method's peak: that method's name
    budget_bytes: int | None = None  # memfit's budget in bytes, where one was given in bytes


@dataclass
class Row:
    """What was measured for one method; ``note`` explains a failure instead of numbers."""

    family: str
    name: str
    peak_method: str
    peak_bytes: int | None = None  # parameters and inputs included
    step_time_s: float | None = None
    eager_step_time_s: float | None = None  # eager timed in the same interleaved group
    predicted_bytes: int | None = None
    predicted_recompute_s: float | None = None  # by memfit's cost model: the planner's objective
    solver: str = ""  # optimal-recompute's plan.params["solver"]
    copies: str = ""  # for an optimal row at another method's peak: that method's name
    budget_bytes: int | None = None
    gradients: str = "-"
    note: str = ""


@dataclass
class ModelResult:
    """The rows of one model, and the eager peaks each measuring method compares with."""

    name: str
    rows: list[Row] = field(default_factory=list)
    eager_peak_bytes: dict[str, int] = field(default_factory=dict)  # by peak method; "start":
    # the bytes of parameters and inputs, which the profiler does not see
    reference_gradients: dict[str, torch.Tensor] | None = None  # eager's
    graph_step: memfit.Step | None = None  # a memfit step that ran: its captured graph


def block_paths(model: nn.Module, block_types: Sequence[str]) -> list[str]:
    """Module paths of the blocks, in definition order, outermost matches only."""
    paths: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(outer + ".") for outer in paths)
        if type(module).__name__ in block_types and not inside:
            paths.append(path)
    return paths


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block: what a user wraps by hand.

    Note:
        Non-reentrant, as the PyTorch docs recommend; it restores the RNG state for the
        recomputation, so dropout draws the same mask twice.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.checkpointed = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.checkpointed, *args, use_reentrant=False, **kwargs)


def wrap_blocks(model: nn.Module, paths: Sequence[str]) -> nn.Module:
    """Replace each module at ``paths`` with a ``Checkpointed`` wrapper, in place."""
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, Checkpointed(getattr(parent, child)))
    return model


def _eager_builder(example: examples.Example, inputs: tuple, paths: Sequence[str] = ()):
    """Eager PyTorch on a fresh copy, with ``torch.utils.checkpoint`` around ``paths``."""

    def build():
        model = wrap_blocks(copy.deepcopy(example.model), paths)
        config = getattr(model, "config", None)
        if paths and getattr(config, "use_cache", False):
            config.use_cache = False  # as transformers does under gradient checkpointing: a
            # key/value cache handed into a checkpointed block would be filled twice
        model.train()
        return model, eager_step(model, example.loss_fn, inputs), None

    return build


def _compiled_builder(example: examples.Example, inputs: tuple, budget: float):
    return lambda: (*compiled_step(example, inputs, budget), None)


def _memfit_builder(example: examples.Example, inputs: tuple, **options):
    return lambda: memfit_step(example, inputs, **options)


def methods(example: examples.Example, inputs: tuple, paths: Sequence[str],
            fractions: Sequence[float] = BUDGET_FRACTIONS,
            compile_budgets: Sequence[float] = COMPILE_BUDGETS) -> list[Method]:
    """Every method of the section, eager first (the reference the others compare with)."""
    found = [
        Method("eager", "eager", "tracker", _eager_builder(example, inputs)),
        Method("torch.utils.checkpoint", "torch.utils.checkpoint, every block", "tracker",
               _eager_builder(example, inputs, paths), blocks=tuple(paths)),
        Method("torch.utils.checkpoint", "torch.utils.checkpoint, every other block", "tracker",
               _eager_builder(example, inputs, paths[::2]), blocks=tuple(paths[::2])),
    ]
    found += [Method("torch.compile budget", f"torch.compile aot_eager, "
                     f"activation_memory_budget {budget}", "profiler",
                     _compiled_builder(example, inputs, budget), budget)
              for budget in compile_budgets]

    def planned(family: str, name: str, **options) -> Method:
        return Method(family, name, "tracker", _memfit_builder(example, inputs, **options))

    found += [
        planned("memfit checkpoint modes", 'memfit checkpoint "memory" (no budget: sqrt(n))',
                strategy="checkpoint", checkpoints="memory"),
        planned("memfit checkpoint modes", 'memfit checkpoint "speed"', strategy="checkpoint",
                checkpoints="speed"),
        planned("memfit checkpoint modes", "memfit checkpoint, the blocks' outputs",
                strategy="checkpoint", checkpoints=list(paths)),
    ]
    found += [planned("memfit checkpoint memory, budget", f'memfit checkpoint "memory", '
                      f"budget {fraction:.0%}", strategy="checkpoint", checkpoints="memory",
                      budget=fraction) for fraction in fractions]
    found += [planned("memfit keep / swap", 'memfit "keep"', strategy="keep"),
              planned("memfit keep / swap", 'memfit "swap", budget 50%', strategy="swap",
                      budget=0.5)]
    if OPTIMAL in memfit.strategy_names():
        found += [planned("optimal", f"memfit {OPTIMAL}, budget {fraction:.0%}",
                          strategy=OPTIMAL, budget=fraction) for fraction in fractions]
    return found


COPIED_FAMILIES = ("torch.utils.checkpoint", "memfit checkpoint modes", "torch.compile budget")


def optimal_at(example: examples.Example, inputs: tuple, budget_bytes: int, copies: str = "",
               peak_method: str = "tracker", **options) -> Method:
    """``optimal-recompute`` under a budget in bytes: at another method's peak, or at its minimum.

    Note:
        memfit's budget covers the whole device, parameters and inputs included (its graph's
        placeholders), as the rows' measured peaks do; bytes outside the graph (existing
        ``.grad``) come off it, and the bench's steps clear gradients first. So a tracker-measured
        peak is the budget that means the same thing.
    """
    name = (f"memfit {OPTIMAL} at the peak of {copies}" if copies
            else f"memfit {OPTIMAL} at its minimum")
    return Method("optimal", name, peak_method,
                  _memfit_builder(example, inputs, strategy=OPTIMAL, budget=int(budget_bytes),
                                  **options),
                  copies=copies, budget_bytes=int(budget_bytes))


def copied_budget(row: Row) -> int:
    """The budget that means ``row``'s measured peak in memfit's frame: its predicted peak when it
    is a memfit plan (the tracker can read a few KiB below memfit's count, e.g. ResNet's 7.14 MiB
    for a plan predicted at 7.17 MiB: a budget below a plan's own prediction would refuse the
    plan itself), else its tracker-measured peak (at or below memfit's frame, so not generous)."""
    assert row.peak_bytes is not None
    return row.predicted_bytes if row.predicted_bytes is not None else row.peak_bytes


def optimal_minimum_bytes(step: memfit.Step, inputs: tuple) -> int | None:
    """The least whole-step budget ``optimal-recompute`` fits on ``step``'s captured graph: the
    strategy's ``BudgetError.minimum_bytes`` for a 1-byte budget, plus the bytes outside the graph."""
    from memfit.api import resolve_hardware
    from memfit.planning.strategies import get_strategy

    compiled = step.compiled
    hardware = resolve_hardware(step.hardware_spec, inputs[0].device)
    try:
        get_strategy(OPTIMAL)(compiled.graph, hardware, 1)
    except BudgetError as error:
        return error.minimum_bytes + compiled.outside_bytes
    return None  # it fits one byte: nothing to report


def block_recompute_s(graph, blocks: Sequence[str]) -> float:
    """What ``torch.utils.checkpoint`` around ``blocks`` re-runs, priced by memfit's cost model:
    every forward op inside a block, once (non-reentrant checkpointing replays the whole block)."""
    inside = tuple(blocks)
    return sum(op.time_s for op in graph.ops if op.phase == "forward"
               and any(op.scope == b or op.scope.startswith(b + ".") for b in inside))
