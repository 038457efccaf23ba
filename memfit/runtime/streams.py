"""The copy engine: the two copy streams, the events that order them, and the host pool.

The swap ops of ``memfit.graph.ops`` look the engine up with ``current_engine()``; the executor
makes one current with ``with active_engine(engine):`` for the length of a run. The current engine
is a ``contextvars.ContextVar``: each thread (and each asyncio task) sees only the engine of its
own run, so two steps running at once in two threads never use each other's streams, events or
saved random states.

Note:
    The engine is written against ``torch.get_device_module(device)`` so one code path serves CUDA
    (and other accelerators) and the CPU. On a CPU build ``torch.cpu.Stream``/``Event`` are
    harmless no-ops, but pinned memory, ``record_stream`` and ``non_blocking`` copies are not
    available, so those are guarded on ``is_accelerator``: on the CPU copies are synchronous.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from memfit.runtime.host import HostPool

# The engine of the run in progress in this thread (a context variable: never shared by threads).
_CURRENT_ENGINE: contextvars.ContextVar[CopyEngine | None] = contextvars.ContextVar(
    "memfit_copy_engine", default=None
)


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


@contextlib.contextmanager
def active_engine(engine: CopyEngine) -> Iterator[CopyEngine]:
    """Make ``engine`` the one the memfit swap ops use inside the ``with`` block (nests).

    Only the calling thread (or asyncio task) sees it: another thread's run keeps its own.
    """
    token = _CURRENT_ENGINE.set(engine)
    try:
        yield engine
    finally:
        _CURRENT_ENGINE.reset(token)


def current_engine(op_name: str = "a memfit op") -> CopyEngine:
    """The engine made current by ``active_engine`` in this thread.

    Raises:
        RuntimeError: outside ``active_engine``, saying how to run the op.
    """
    engine = _CURRENT_ENGINE.get()
    if engine is None:
        raise RuntimeError(
            f"{op_name} ran outside a copy engine: run the rewritten graph with "
            "memfit.runtime.executor.Executor, or wrap the call in "
            "`with memfit.runtime.streams.active_engine(CopyEngine(device)):`"
        )
    return engine
