"""The regions of a graph-broken model planned jointly before its first iteration runs.

Dynamo compiles a model with a graph break as several regions, each when the iteration reaches
it, so the first is planned before the later ones exist and may keep saves that a later region
cannot fit beside. So at a fitted model's first training call, the first region's compile checks
whether a graph break follows it (``graph_break_follows``); where one does, before that region
first runs (``Backend._capped_jointly``), the fitted model's call is traced on fake copies of
its arguments with a planning-only backend (``plan_regions_on_fakes``, as ``memfit.plan`` traces
a step), which plans every region beside the saves of the regions before it and gives each
earlier region its share of the room the short ones leave (``saves_caps``, by the code it runs
from). The first region is planned again within its cap if it saves more, and each later region
is planned within its own when Dynamo compiles it.

Where the trace on fakes fails (eager code between the regions that reads a value, ``.item()``),
nothing is capped: the regions are planned one by one, a region that misses the budget says so
(``BudgetWarning``), and joint planning after the iteration (``memfit.compiler.joint_planning``)
takes over.

Example:
    >>> planner.saves_caps.update(plan_regions_on_fakes(planner, call, args, kwargs, None, 0))
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from memfit.compiler.backend import Backend
from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import latest_regions, saves_caps
from memfit.compiler.region import Region
from memfit.data.costgraph import CostGraph
from memfit.data.errors import BudgetError
from memfit.data.hardware import Hardware
from memfit.data.units import Budget
from memfit.fitting.callers_compile import own_trace
from memfit.fitting.traced import _PlanOnly, buffers_kept, fake_like
from memfit.model.schedule import PlanError
from memfit.planning.step import Planned

LOG = logging.getLogger(__name__)


class _OnFakes(_PlanOnly):
    """The planning-only backend of the trace on fakes: a region short beside the saves of the
    regions before it is planned at its smallest peak (its minimum kept for ``saves_caps``), as
    the fitted model's backend plans it, without a word; eager code's bytes are those the
    fitted model's backend saw at its first region's compile."""

    def __init__(self, fitted_backend: Backend, eager_seen_bytes: int,
                 arguments: tuple[torch.Tensor, ...], budget: Budget | None) -> None:
        fitted, device = fitted_backend.options, fitted_backend.device
        hardware = fitted.hardware if device is None else fitted_backend.hardware_for(device)
        super().__init__(BackendOptions(budget, fitted.strategy, hardware,
                                        params=fitted.params), model=fitted_backend.model)
        self.fitted_backend = fitted_backend  # the fitted model's backend this trace plans for
        self.eager_seen_bytes = eager_seen_bytes
        self.arguments = arguments  # the call's tensor arguments, as fakes
        self.first_inputs: frozenset[int] = frozenset()  # ids of the first region's inputs
        for optimizer in fitted_backend.optimizers:  # the same model's: each is adopted
            self.adopt(optimizer)
        self.override_budget(fitted_backend.budget_override)

    def eager_bytes_now(self, example_inputs: list) -> int:
        """What eager code held at the first region's compile (the call's tensor arguments
        that are not its inputs among it), and the arguments that were its inputs but are not
        this region's (the loop holds its batch throughout the call)."""
        inputs = frozenset(id(value) for value in example_inputs)
        if not self.regions:
            self.first_inputs = inputs
        return self.eager_seen_bytes + sum(
            argument.untyped_storage().nbytes() for argument in self.arguments
            if id(argument) in self.first_inputs and id(argument) not in inputs)

    def partners(self) -> list[tuple[Any, list]]:
        """The fitted model's partners (other fitted models), as its backend counts them."""
        return self.fitted_backend.partners()

    def _over_budget(self, graph: CostGraph, hardware: Hardware, error: BudgetError,
                     pending: int, outside: int, own_open: int = 0) -> Planned:
        """The region at its smallest peak, as the fitted model's backend would run it."""
        return self._at_minimum(graph, hardware, error, outside)


def plan_regions_on_fakes(planner: Backend, call: Callable, args: tuple, kwargs: dict,
                          dynamic: bool | None, eager_bytes: int) -> dict[Any, int]:
    """Trace ``call(*args, **kwargs)`` (the fitted model's compiled call, so that its regions
    are the same code objects as the real compile's) on fake copies of the arguments, plan each
    region as ``planner`` would, and return the most each earlier region may save so that the
    short ones fit (``saves_caps``: site -> bytes); empty where every region fits or the trace
    fails. Nothing runs on the device; the seconds count in ``planner.planning_s``.

    Under a fraction budget the regions a graph break follows are traced unplanned
    (``_PlanOnly._provisional``), so the trace finds the step's unplanned peak as ``memfit.plan``
    does (``planner.step_peak_found``) and the last region is planned under that fraction of
    it; with more than one such region, the call is traced again under those bytes, so that
    each region is planned beside the saves of the regions before it.

    Raises:
        BackendCompilerFailed: Dynamo's, with memfit's ``BudgetError`` inside, where a region
            cannot fit the budget even without the saves of the regions before it.
    """
    if planner.model is None:
        return {}
    started = time.perf_counter()
    try:
        budget = planner.budget
        regions = _planned_on_fakes(planner, call, args, kwargs, dynamic, eager_bytes, budget)
        if regions and budget is not None and budget.fraction is not None:
            peak_bytes = max(region.baseline_peak_bytes for region in regions)
            planner.step_peak_found(peak_bytes)
            if sum(region.provisional for region in regions) > 1:
                regions = _planned_on_fakes(planner, call, args, kwargs, dynamic, eager_bytes,
                                            Budget(bytes=budget.to_bytes(peak_bytes)))
    finally:
        planner.add_planning_time(time.perf_counter() - started)
    if regions is None:
        return {}
    planner.first_call_traced(len(regions))
    return saves_caps(regions)


def _planned_on_fakes(planner: Backend, call: Callable, args: tuple, kwargs: dict,
                      dynamic: bool | None, eager_bytes: int, budget: Budget | None
                      ) -> list[Region] | None:
    """The regions of one trace of the call on fakes planned under ``budget``
    (``plan_regions_on_fakes``); ``None`` where the trace fails, said in ``planner``'s
    report."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves, tree_map

    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = tree_map(_fake, (args, kwargs))
    trial = _OnFakes(planner, eager_bytes, tuple(
        leaf for leaf in tree_leaves(fakes) if isinstance(leaf, torch.Tensor)), budget)
    compiled = torch.compile(call, backend=trial, dynamic=dynamic, isolate_recompiles=True)
    try:
        with own_trace(), buffers_kept(planner.model), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*fakes[0], **fakes[1])
    except Exception as error:
        if isinstance(getattr(error, "inner_exception", None), (BudgetError, PlanError)):
            raise  # no plan fits a region: refused before anything ran, as the real trace would
        # eager code between the regions that needs real values (``.item()``), or a trace
        # fakes cannot take: the regions are planned one by one, then jointly after a run
        first = (str(error).strip().splitlines() or [""])[0][:200]
        LOG.info("memfit: the regions were not planned jointly before the first run: %s", error)
        planner.first_call_traced(note=(
            "not planned jointly before the first run: the trace on fake inputs failed "
            f"({type(error).__name__}: {first})"))
        return None
    finally:
        for runner in trial.runners:
            runner.close()
    return latest_regions(trial.regions)


def _fake(value: Any) -> Any:
    """A fake copy of a tensor argument (``fake_like``); anything else as it is."""
    return fake_like(value) if isinstance(value, torch.Tensor) else value

