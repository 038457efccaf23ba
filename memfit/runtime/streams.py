"""The copy engine: the two copy streams, the events that order them, and the host pool.

The swap ops of ``memfit.ops.swap`` look the engine up with ``current_engine()``; the executor
makes one current with ``with active_engine(engine):`` for the length of a run. Both live in
``memfit.ops.engine_slot`` (the ops import nothing from the runtime) and are exported here too.

Note:
    The engine is written against ``torch.get_device_module(device)`` so one code path serves CUDA
    (and other accelerators) and the CPU. On a CPU build ``torch.cpu.Stream``/``Event`` are
    harmless no-ops, but pinned memory, ``record_stream`` and ``non_blocking`` copies are not
    available, so those are guarded on ``is_accelerator``: on the CPU copies are synchronous.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memfit.ops.engine_slot import active_engine, current_engine
from memfit.ops.host import HostPool

__all__ = ["CopyEngine", "active_engine", "current_engine"]


class CopyEngine:
    """Copy streams (device→host and host→device), events keyed by int, and a host pool.

    Args:
        device: the compute device; ``"cpu"`` gives synchronous copies and no-op streams, and
            so does ``"meta"`` (a model on the meta device is only planned, never run).

    Example:
        >>> engine = CopyEngine("cuda")
        >>> with active_engine(engine):
        ...     outputs = executor.run(*inputs)
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type not in ("cpu", "meta")
        if self.is_accelerator and self.device.index is None:
            self.device = torch.device(self.device.type, torch.get_device_module(self.device).current_device())
        self.module: Any = torch.get_device_module(self.device if self.is_accelerator else "cpu")
        self.host_pool = HostPool(self.device)
        self.events: dict[int, Any] = {}
        if self.is_accelerator:
            self.d2h_stream = self.module.Stream(device=self.device)
            self.h2d_stream = self.module.Stream(device=self.device)
        else:
            self.d2h_stream = self.h2d_stream = self.module.current_stream()

    def compute_stream(self) -> Any:
        """The stream compute ops are issued on (the current stream of the device)."""
        if self.is_accelerator:
            return self.module.current_stream(self.device)
        return self.module.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context that makes ``stream`` current (a no-op context on the CPU)."""
        if self.is_accelerator:
            return self.module.stream(stream)
        return contextlib.nullcontext()

    def record(self, key: int, stream: Any) -> None:
        """Record an event on ``stream`` under ``key`` (replacing an older one)."""
        if self.is_accelerator:
            event = self.module.Event()
            event.record(stream)
            self.events[key] = event

    def wait(self, key: int, stream: Any) -> None:
        """Make ``stream`` wait for the event recorded under ``key``.

        Raises:
            KeyError: if no event was recorded under ``key`` (on an accelerator): the swap-out or
                swap-in that records it did not run before this wait.
        """
        if not self.is_accelerator:
            return
        if key not in self.events:
            raise KeyError(
                f"memfit: no copy event {key} was recorded; the swap op that records it must run "
                "before the op that waits on it (check the rewritten graph's order)"
            )
        stream.wait_event(self.events[key])

    def synchronize(self) -> None:
        """Wait for every stream of the device (copies included) to finish."""
        if self.is_accelerator:
            self.module.synchronize(self.device)

    def clear(self) -> None:
        """Forget the recorded events (after a run, once synchronised)."""
        self.events.clear()
