"""What a ``Backend`` plans and runs with: one frozen object, fixed when the backend is built.

``memfit.backend`` checks each argument and builds one; ``memfit.fit``, ``memfit.compile`` and
the planning-only traces (``memfit.fitting.traced``) build theirs with ``dataclasses.replace``.
What changes as the backend runs (its regions, counters, the automatic CUDA budget chosen at
the first call, a closed loop's lowered budget) is the backend's own state, changed through its
methods.

Example:
    >>> options = BackendOptions(Budget(bytes=1 << 30), "auto")
    >>> Backend(replace(options, linearize=True), model=model)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.data.hardware import Hardware
from memfit.data.plan import Plan
from memfit.data.units import Budget
from memfit.model.sharding import Sharding


@dataclass(frozen=True)
class BackendOptions:
    """How a backend plans each region and runs it.

    Args:
        budget: the whole device's bytes at the step's peak (``None``: no limit, nothing
            planned but measured).
        strategy: the registered strategy that plans each region.
        hardware: the profile to plan with, or its name; ``None`` takes the ``cpu`` profile on
            a CPU and measures the device otherwise (``resolve_hardware``).
        compiler: ``"aot_eager"`` (fx's Python code, bitwise) or ``"inductor"``.
        params: the strategy's parameters, checked by its config.
    """

    budget: Budget | None = None
    strategy: str = "keep"
    hardware: Hardware | str | None = None
    compiler: str = "aot_eager"
    params: Mapping[str, Any] = field(default_factory=dict)
    # forward+backward runs measured per region after each plan: 2 covers the first iteration
    # (optimizer state only reserved) and one with it real; a measured run costs time
    measure_runs: int = 2
    # warn when a measured run exceeds the budget and the prediction; off where a closed loop
    # re-plans instead (memfit.compile)
    warn_over_prediction: bool = True
    linearize: bool = False  # reorder each region as late as possible before planning it
    fixed_plan: Plan | None = None  # compile(plan=...): used as is, checked against the region
    # explain each plan with the plans at the budget x0.9 and x1.1: two more plans per region,
    # asked for by memfit.plan, never by a step on its way to running
    what_ifs: bool = False
    scope_prefix: str = ""  # where the model sits in the compiled module (LossModule's "model.")
    # count the buffers this machine's kernels allocate inside one op (memfit.tracing.temporaries);
    # off for a plan of another device's profile, which this CPU's scratch does not describe
    kernel_temporaries: bool = True
    # trace as the profile's device runs it (memfit.tracing.target): planning-only traces only,
    # never a step that runs here
    retarget: bool = False
    autocast: torch.dtype | None = None  # the target's autocast dtype, with retarget
    sharding: Sharding | None = None  # plan one rank of it (the sharded planning-only trace)
    checks_calls: bool = False  # memfit.fit: say at each call that runs outside a plan
    # memfit.fit: (function, arguments) that make a copy's own backend (Backend.__reduce__);
    # None: the backend is not copied
    copy_as: tuple | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(self.params))  # the caller's dict stays theirs
