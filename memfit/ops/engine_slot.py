"""The copy engine of the run in progress: where the swap ops find their streams and host pool.

The ops of a rewritten graph (``memfit.ops.swap``) call ``current_engine()``; the runtime makes
one current with ``with active_engine(engine):`` for the length of a run. The engine itself is
``memfit.runtime.streams.CopyEngine``; this slot holds it as the ``Engine`` protocol (what the
ops use of it) without importing it, so the ops stay below the runtime that runs them. The current engine is a ``contextvars.ContextVar``: each thread
(and each asyncio task) sees only the engine of its own run, so two steps running at once in two
threads never use each other's streams, events or saved random states.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class HostBuffers(Protocol):
    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor: ...


class Engine(Protocol):
    """What the swap ops use of ``memfit.runtime.streams.CopyEngine``."""

    is_accelerator: bool
    host_pool: HostBuffers
    d2h_stream: Any
    h2d_stream: Any

    def compute_stream(self) -> Any: ...

    def stream(self, stream: Any) -> contextlib.AbstractContextManager: ...

    def record(self, key: int, stream: Any) -> None: ...

    def wait(self, key: int, stream: Any) -> None: ...


# The engine of the run in progress in this thread (a context variable: never shared by threads).
_CURRENT_ENGINE: contextvars.ContextVar[Engine | None] = contextvars.ContextVar(
    "memfit_copy_engine", default=None
)


@contextlib.contextmanager
def active_engine(engine: Engine) -> Iterator[Engine]:
    """Make ``engine`` the one the memfit swap ops use inside the ``with`` block (nests).

    Only the calling thread (or asyncio task) sees it: another thread's run keeps its own.
    """
    token = _CURRENT_ENGINE.set(engine)
    try:
        yield engine
    finally:
        _CURRENT_ENGINE.reset(token)


def current_engine(op_name: str = "a memfit op") -> Engine:
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
