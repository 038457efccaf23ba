"""A compiled region memfit planned, as the backend keeps it: its graph, plan, prediction, the
forward and backward modules it runs, and what its measured runs found.

Its own module so that the modules around the backend (``graph_breaks``, ``replanning``,
``memfit.compiler.region_peak``, ``memfit.compiler.region_lifetimes``, ``memfit.compiler.report``) read it
without importing the backend that imports them; they see the backend through ``Planner``, what
they call of it.

Example:
    >>> region = backend.regions[0]; region.predicted_peak_bytes, region.measured_peak_bytes
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx

from memfit.compiler.backend_options import BackendOptions
from memfit.data.costgraph import CostGraph
from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline

PROGRESS_DELAY_S = 3.0  # planning shorter than this shows no progress line
REGION_KEY = "memfit_region"  # GraphModule.meta: which region a forward / backward module is


@dataclass(frozen=True)
class RegionPlanning:
    """What planning a region cost: seconds choosing its plans (the strategy, its explanation
    and simulation, or reading them from the cache) and seconds around them (analysis,
    rewriting, lowering), and how many plans were made and how many came from the cache."""

    choosing_s: float
    around_s: float
    plans_made: int
    plans_cached: int


@dataclass
class Region:
    """One compiled region memfit planned: its graph, plan, prediction and the two modules.

    Args:
        budget_bytes: the whole-device budget the region was planned for (``None``: no budget).
        outside_bytes: device bytes alive outside the region while it runs (parameters of other
            regions, gradients kept across micro-batches, optimizer state, reserved or real).
    """

    index: int
    graph: CostGraph
    plan: Plan
    baseline: Timeline
    predicted: Timeline
    budget_bytes: int | None
    outside_bytes: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    resident_bytes: int = 0  # model and optimizer bytes (reserved state included) it planned for
    saved_bytes: int = 0  # device bytes its forward saves for its backward
    open_nodes: list = field(default_factory=list, repr=False)  # per forward whose backward
    # has not run: a weak reference to its autograd node (``None`` where none was found), which
    # dies with the graph where the loop drops it without a backward (an exception caught)
    most_open_forwards: int = 0  # the most of its forwards open at once: how many copies of its
    # saves an iteration holds together (blocks that run one compiled code: FSDP2's per-block
    # regions where Dynamo does not guard on which block, GPT-2 with ``use_cache=False``)
    program: int = 0  # the Dynamo graph its plans are made from (its id): one per program of a
    # site (a second call with other arguments is another), the same for every plan of it
    site: Any = None  # where Dynamo compiled it from (``compiling_site``: its code object, and
    # the module it runs for): one per region an iteration runs, which a newer plan replaces
    pending_bytes: int = 0  # saves of earlier regions (before a graph break) it planned around
    others_pending_bytes: int = 0  # ... of those, the other sites' (``pending_bytes`` less its
    # own code's open forwards)
    minimum_bytes: int | None = None  # its smallest peak, where it could not fit the budget
    saves_cap_bytes: int | None = None  # the most its forward may save, planned jointly
    own_pending_bytes: int = 0  # saves of its own code's earlier open forwards it planned beside
    copies_planned: int = 0  # more copies of its saves its plan was fitted beside (``fit_copies``)
    replaced: bool = False  # a newer plan of its code replaces it (joint or resident re-plan)
    provisional: bool = False  # planned under a fraction before the step's peak was known
    # (``Backend._provisional``): no budget of its own until it is planned again
    measured_forward_bytes: int | None = None  # device peak of its forward's latest measured run
    measured_backward_bytes: int | None = None  # ... and of its backward's
    measured_runs: int = 0  # runs of its modules measured so far
    measured_sizes: dict = field(default_factory=dict, repr=False)  # a dynamic region: each
    # symbolic size's largest value in a run measured so far
    measure_pending: int = 0  # module runs still to measure beyond the first ones: a run at
    # sizes past every measured run's (its forward and its backward)
    measured_by: str = ""  # "allocator" or "ops" (see memfit.compiler.region_peak.run_measured)
    measured_most_bytes: int = 0  # the most any measured run of its plan showed, eager code's
    # bytes at its start included, with the optimizer state its plan reserves counted as made
    measured_only_allocator: bool = True  # every measured run was read from the allocator
    forward_values: tuple = field(default=(), repr=False)  # its forward's inputs and outputs,
    # weakly: those still alive when its backward runs are measured with it (the loop holds them)
    output_values: tuple = field(default=(), repr=False)  # its forward's user-visible outputs,
    # weakly: those alive while another region runs are eager code's there (``held_outputs``)
    hardware: Hardware | None = None  # the profile it was planned with
    bound: Timeline | None = None  # the timeline its plan was checked with: outputs held to the
    # step's end, tangents resident from its start (``predicted`` once a backward has shown more)
    trainable_bytes: int = 0  # bytes of its parameters that get gradients
    later_gradient_bytes: int = 0  # gradients of other regions' parameters during its backward
    output_names: tuple[str | None, ...] = ()  # its graph's tensor of each user-visible output
    output_tangents: tuple[str | None, ...] = ()  # each output's tangent, if not a loss's seed
    output_storages: tuple = field(default=(), repr=False)  # weakly, of its latest forward
    saved_storages: tuple = field(default=(), repr=False)  # weakly, what its forwards saved
    saved_sizes: dict = field(default_factory=dict, repr=False)  # those storages' bytes
    counted_saves: tuple[int, ...] = ()  # which of its forward's saved values ``saved_bytes``
    # counts, by place among them (``counted_save_places``)
    latest_saves: dict = field(default_factory=dict, repr=False)  # of its latest forward,
    # weakly, the storages of those values with their bytes (``remember_outputs``)
    latest_node: Any = field(default=None, repr=False)  # that forward's entry in ``open_nodes``
    live_saves: tuple = field(default=(), repr=False)  # per forward whose saves may live:
    # weakly, the storages it saved beyond its inputs (``memfit.compiler.repeated_calls``)
    backward_input_names: tuple[str, ...] = ()  # its backward module's placeholders, in order
    observed: tuple | None = None  # what the loop held and passed at its latest backward
    eager_forward_bytes: int = 0  # most bytes eager code held at its measured forwards' start
    eager_backward_bytes: int = 0  # ... and at its measured backwards' start (the loop's loss)
    eager_gap_bytes: int = 0  # ... and at once between them, less its outputs freed by then
    gap_alive_bytes: int = 0  # the device's bytes alive at that peak, as memfit sees them
    planned_eager_bytes: int = 0  # eager code's bytes its plan counts, alive over all of it
    planned_gap_bytes: int = 0  # eager code's peak between forward and backward it left room for
    beside_saves_bytes: int = 0  # its outputs and the loop's inputs: alive beside its saves then
    freed_output_bytes: int | None = None  # its outputs freed by its backward's start (fewest)
    eager_read: bool = False  # eager code's bytes were read at a measured backward's start
    warned_over: bool = False  # said that a measured run of its plan exceeded budget and prediction
    retained_peak_bytes: int | None = None  # its plan's peak with the saves a retaining
    # backward holds (``plan_for_retained_saves``), once simulated
    shape_bound: Any = None  # a dynamic region: each symbolic size at the value it was priced at
    planning: RegionPlanning | None = None  # what planning it cost (``timed_planning``)
    released_outputs: frozenset[str] = frozenset()  # outputs its plan frees at its forward's end,
    # their gradients never passed (``memfit.compiler.loop_lifetimes``)
    loop_refuted: bool = False  # a backward showed the loop holding them or passing a gradient
    planned_graph: CostGraph | None = None  # the graph its plan was made on, where not ``graph``
    # (``graph`` with the loop's lifetimes: ``released_outputs``)

    @property
    def plan_graph(self) -> CostGraph:
        """The graph ``plan`` was made for and is simulated on."""
        return self.planned_graph if self.planned_graph is not None else self.graph

    @property
    def open_forwards(self) -> int:
        """Forwards run whose backward has not run yet and whose autograd graph is alive: their
        saves are alive. A forward whose graph the loop dropped (an exception between the
        forward and the backward, an evaluation with gradients on) is closed by its graph's
        end, so no later plan or measurement counts its saves."""
        self.open_nodes[:] = [node for node in self.open_nodes if node is None or node() is not None]
        return len(self.open_nodes)

    def forward_opened(self, node: Any) -> None:
        """Note a forward run by autograd node ``node`` (``None``: not found)."""
        self.open_nodes.append(weakref.ref(node) if node is not None else None)
        self.latest_node = self.open_nodes[-1]

    def open_latest_saves(self) -> dict:
        """``latest_saves`` where its forward is known to be open (its backward has not run and
        its graph lives), else none: the saves ``saved_bytes`` counts for that forward."""
        latest = self.latest_node
        if latest is None or latest() is None or not any(
                reference is latest for reference in self.open_nodes):
            return {}
        return {reference: size for reference, size in self.latest_saves.items()
                if not reference.expired()}

    def backward_closed(self, node: Any) -> None:
        """Close the forward whose backward ran by ``node``: its own where found, else the
        latest whose node is unknown; a second backward of a retained graph closes nothing."""
        self.open_nodes[:] = [reference for reference in self.open_nodes
                              if (reference is None or reference() is not None)
                              and (node is None or reference is None or reference() is not node)]
        if node is None and None in self.open_nodes:
            del self.open_nodes[len(self.open_nodes) - 1 - self.open_nodes[::-1].index(None)]

    def measuring(self, measure_runs: int) -> bool:
        """Whether its next module run is measured: one of its first ``measure_runs`` forwards
        and backwards, or one at sizes past those measured so far (``measure_larger_sizes``)."""
        return self.measured_runs < 2 * measure_runs or self.measure_pending > 0

    def measure_larger_sizes(self, sizes: dict, measure_runs: int) -> None:
        """Measure this run (its forward and its backward) where a symbolic size is past its
        largest value in the runs measured so far. Its plan is priced at the bound, but only a
        measured run is checked against it: under inductor a shape's kernels, not the
        simulation, make its peak, and the loop's own bytes (a loss computed in the loop) grow
        with the shape. A run past the measured sizes is thus checked at that call, and a
        ``BudgetWarning`` says so where it is over."""
        if measure_runs <= 0 or all(value <= self.measured_sizes.get(symbol, 0)
                                    for symbol, value in sizes.items()):
            return
        if not self.measuring(measure_runs):
            self.measure_pending = 2
        self.measured_sizes = {symbol: max(value, self.measured_sizes.get(symbol, 0))
                               for symbol, value in {**self.measured_sizes, **sizes}.items()}

    @property
    def predicted_peak_bytes(self) -> int:
        """The whole device's predicted peak while this region runs."""
        return self.predicted.peak_bytes + self.outside_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.baseline.peak_bytes + self.outside_bytes

    @property
    def measured_peak_bytes(self) -> int | None:
        """The whole device's measured peak over the latest measured forward and backward."""
        measured = [b for b in (self.measured_forward_bytes, self.measured_backward_bytes)
                    if b is not None]
        return max(measured) if measured else None


class Planner(Protocol):
    """What the region's neighbours use of ``memfit.compiler.backend.Backend``."""

    regions: list[Region]
    model: torch.nn.Module | None
    optimizers: list
    options: BackendOptions
    bound_replans: int
    planning_s: float
    budget_note: str  # where the budget came from, when memfit chose it
    cache_ignored: list[str]  # plan-cache files ignored, and why (``memfit.planning.plan_cache``)
    retained_backward: bool  # a backward kept its graph: plans keep the saves it reads
    retained_replans: int  # plans made again for that
    step_over_said: bool  # said that the optimizer's step alone is over the budget
    gradients_seen: dict  # program -> what the loop did with the gradients in between

    def eager_watch(self) -> Any: ...

    def state_to_come_bytes(self) -> int: ...

    def partners(self) -> list[tuple[Any, list]]: ...

    def eager_watch_off(self) -> contextlib.AbstractContextManager: ...

    def must_plan_again(self, regions: list[Region], device: torch.device,
                        args: Sequence = ()) -> bool: ...

    def compile_region(self, graph_module: fx.GraphModule, example_inputs: list,
                       device: torch.device, site: Any, bound: Any = None,
                       eager_bytes: int | None = None) -> Any: ...

    def eager_bytes_now(self, example_inputs: list) -> int: ...

    def iteration_closed(self) -> None: ...

    def recompile_limit_hit(self, where: str, code: Any = None, limit: int | None = None
                            ) -> None: ...

    def forward_ran(self, region: Region) -> None: ...

    def check_between_iterations(self, region: Region) -> None: ...


@contextlib.contextmanager
def timed_planning(planner: Planner) -> Iterator[None]:
    """Record on the region planned inside the block what planning it cost (``RegionPlanning``),
    and on ``planner`` the cache files ignored meanwhile; also where the block raises after the
    region was added (a planning-only trace's stop). Planning that takes longer than
    ``PROGRESS_DELAY_S`` shows its stage on a progress line, on a terminal only (as
    ``max_batch_size``'s bar: tqdm's ``disable=None``)."""
    from tqdm import tqdm

    from memfit.planning.plan_cache import planning_tally

    first, started = len(planner.regions), time.perf_counter()
    with planning_tally() as tally, tqdm(
            desc=f"memfit: planning region {first}", bar_format="{desc}{postfix} [{elapsed}]",
            disable=None, leave=False, delay=PROGRESS_DELAY_S) as tally.progress:
        try:
            yield
        finally:
            if len(planner.regions) > first:
                around = time.perf_counter() - started - tally.seconds
                planner.regions[-1].planning = RegionPlanning(tally.seconds, around, tally.made,
                                                              tally.cached)
            planner.cache_ignored.extend(tally.ignored)


def user_input_names(joint: fx.GraphModule, inputs: Sequence) -> frozenset[str]:
    """The placeholders of ``joint`` bound to the user's inputs (``Binding.kind == "input"``):
    after a graph break (a region open when this one is compiled), the earlier region's
    outputs, held by this region's saves alone once eager code drops them
    (``saved_device_bytes``)."""
    return frozenset(node.name for node, binding in
                     zip(joint.graph.find_nodes(op="placeholder"), inputs, strict=True)
                     if binding.kind == "input")


def saved_device_bytes(forward: fx.GraphModule, num_fwd_outputs: int,
                       held_inputs: frozenset[str] = frozenset(), bound: Any = None) -> int:
    """Device bytes of the values ``forward`` returns for its backward: not memfit's host copies
    and random states, and not its inputs except ``held_inputs`` (placeholder names); symbolic
    sizes at ``bound`` (``memfit.tracing.shapes``).

    An input the loop passed in is alive anyway; but a region that runs after a graph break
    gets its inputs from the region before it, whose output eager code drops once the call
    returns, so one it saves is alive because of it alone, and counted here (a pipeline of
    stages under FSDP2 saves the stage outputs before them).
    """
    from memfit.tracing.analyze import storage_key, tensors_in
    from memfit.tracing.shapes import evaluate

    saved = forward.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    sizes: dict = {}
    for place in counted_save_places(forward, num_fwd_outputs, held_inputs):
        for tensor in tensors_in(saved[place].meta.get("val")):
            sizes.setdefault(storage_key(tensor),
                             evaluate(tensor.untyped_storage().nbytes(), bound or {}))
    return sum(sizes.values())


def counted_save_places(forward: fx.GraphModule, num_fwd_outputs: int,
                        held_inputs: frozenset[str] = frozenset()) -> tuple[int, ...]:
    """The places, among the values ``forward`` returns for its backward, of those whose bytes
    ``saved_device_bytes`` counts: not memfit's host copies and random states, and not its
    inputs except ``held_inputs``."""
    from memfit.tracing.analyze import inserted_kind

    saved = forward.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    return tuple(place for place, node in enumerate(saved)
                 if isinstance(node, fx.Node)
                 and (node.op != "placeholder" or node.name in held_inputs)
                 and inserted_kind(node) not in ("swap_out", "rng_save"))
