"""measure_peak: the device peak of one call, the way the budget is defined.

On CUDA it is ``torch.cuda.max_memory_allocated`` around the call; on the CPU it is the dispatch
tracker (``DeviceMemoryTracker``), with the tensors among the arguments (and ``track``) counted as
pre-existing.

Example:
    >>> measured = measure_peak(step, input_ids, labels, track=list(model.parameters()))
    >>> measured.peak_bytes
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memfit.runtime.tracker import DeviceMemoryTracker


@dataclass(frozen=True)
class Measurement:
    """What ``measure_peak`` returns.

    Args:
        result: what the call returned.
        peak_bytes: device bytes at the peak, pre-existing tensors included.
        start_bytes: device bytes alive before the call (the pre-existing tensors).
        device: the device measured.
    """

    result: Any
    peak_bytes: int
    start_bytes: int
    device: torch.device

    @property
    def above_start_bytes(self) -> int:
        """The bytes the call itself added at its peak."""
        return self.peak_bytes - self.start_bytes

    def __iter__(self):
        """Unpack as ``result, peak_bytes = measure_peak(...)``."""
        return iter((self.result, self.peak_bytes))


def measure_peak(
    fn: Callable[..., Any],
    *args: Any,
    track: Any = (),
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Measurement:
    """Call ``fn(*args, **kwargs)`` and measure its device peak.

    Args:
        fn: the call to measure (a training step, an ``Executor.run``).
        *args, **kwargs: its arguments; the tensors among them (found through pytrees) count as
            pre-existing on the CPU.
        track: other tensors alive before the call that the peak must include (parameters,
            ``.grad``, optimizer state), any pytree of tensors. Not needed on CUDA, where the
            allocator already sees them.
        device: the device to measure; defaults to the first tensor's device among args, kwargs
            and ``track``, else the CPU.

    Note:
        On CUDA the peak includes every tensor allocated on the device, whoever holds it, which
        is what a budget means. On the CPU only registered tensors and what the call allocates
        are counted, so pass everything that is resident during the step via args or ``track``.
    """
    device = torch.device(device) if device is not None else _first_device(args, kwargs, track)
    if device.type == "cuda":
        return _measure_cuda(fn, args, kwargs, device)
    tracker = DeviceMemoryTracker(device)
    tracker.register((args, kwargs, track))
    start_bytes = tracker.current_bytes
    with tracker:
        result = fn(*args, **kwargs)
    return Measurement(result, tracker.peak_bytes, start_bytes, device)


def measure_allocator_peak(fn: Callable[..., Any], *args: Any, track: Any = (),
                           device: torch.device | str | None = None,
                           **kwargs: Any) -> Measurement:
    """Like ``measure_peak``, by the allocator's own statistics: for compiled code.

    On CUDA it is the same measurement; on the CPU it is the running sum of the CPU allocator's
    per-event byte deltas (the profiler's ``[memory]`` events) above the bytes of the tensors in
    ``args``, ``kwargs`` and ``track``, which must include everything resident (parameters,
    gradients, optimizer state, inputs).

    Raises:
        ProfilerRunning: on a CPU while the user's own profiler records (``profiler_running``);
            memfit leaves that session alone rather than nest a profiler inside it.

    Note:
        A dispatch mode (the tracker of ``measure_peak``) makes ``torch.compile`` fall back to
        eager, so compiled steps are measured here instead. memfit's host-tier buffers on a CPU
        come from numpy, not from torch's allocator, so they stay out, as pinned host memory
        stays out of ``torch.cuda.max_memory_allocated``. Anything else the allocator hands out
        during the call counts, whoever holds it.
    """
    device = torch.device(device) if device is not None else _first_device(args, kwargs, track)
    if device.type == "cuda":
        return _measure_cuda(fn, args, kwargs, device)
    if profiler_running():
        raise ProfilerRunning(
            "memfit measures a CPU step's peak through the profiler's allocator events, and a "
            "profiler of yours is recording: profilers do not nest, so memfit would end your "
            "session. Measure outside the profiler, or read the memory columns of your own "
            "profile (profile_memory=True)")
    counted_blocks = storage_blocks((args, kwargs, track))  # each storage once
    start_bytes = sum(counted_blocks.values())
    result, above_bytes = allocator_peak_above_start(lambda: fn(*args, **kwargs), counted_blocks)
    return Measurement(result, start_bytes + above_bytes, start_bytes, device)


def profiler_running() -> bool:
    """Whether a profiler is open in this process: one that records now (``torch.profiler.
    profile``, the legacy ``torch.autograd.profiler.profile``; ``record_function`` records into
    either), or a ``torch.profiler.profile`` made and not yet exited, which may be waiting or
    warming up on its schedule with nothing recording yet.

    memfit starts no profiler of its own then: profilers do not nest, and one started inside
    another ends the user's session (it records no events after) or, during its warm-up, made
    the process crash at the next profiler call. What memfit measures then is counted another
    way (``run_measured``'s ops). A ``torch.profiler.profile`` started with ``start()`` counts as
    open until it is exited (``with`` or ``__exit__``), as torch's own step tracking does.
    """
    from torch.autograd import profiler as autograd_profiler
    from torch.profiler.profiler import PROFILER_STEP_NAME

    return bool(torch._C._autograd._profiler_enabled() or autograd_profiler._is_profiler_enabled
                or PROFILER_STEP_NAME in autograd_profiler.KinetoStepTracker._step_dict)


class ProfilerRunning(RuntimeError):
    """A CPU measurement that reads the allocator through a profiler was asked for while the
    user's own profiler records (``profiler_running``)."""


def allocator_peak_above_start(run: Callable[[], Any],
                               counted_blocks: Mapping[int, int] | None = None) -> tuple[Any, int]:
    """``run()``'s result and the most bytes the CPU allocator held above its start level, as
    ``allocator_rise`` counts them (``counted_blocks``: ``storage_blocks`` of the tensors alive
    at the start, whose frees count; none where omitted).
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    # cyclic garbage from an earlier measured call, collected during this one (a compile
    # allocates enough to start the collector), is not in the caller's start level
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = run()
    return result, allocator_rise(profiler, counted_blocks or {})


def allocator_rise(profiler: Any, counted_blocks: Mapping[int, int]) -> int:
    """The most bytes torch's CPU allocator held above its level at the start of ``profiler``'s
    (finished) session, from its allocation events in order.

    A free lowers the level only where its block was allocated during the session, by the size
    it was allocated with, or is one of ``counted_blocks`` (data pointer to bytes: the storages
    the caller counts as alive at the start), by the size counted. The allocator's report of
    any other free is not trusted: it names the size its block had when some earlier profiler
    session saw it allocated, and a block freed while no profiler ran keeps that stale size for
    the next block at its address, so a free of bytes the caller never counted, or of another
    size, would put the figure below what ran. The figure is never under the bytes allocated
    during the session and alive.
    """
    from torch._C._profiler import _EventType

    events = []
    pending = list(reversed(profiler.profiler.kineto_results.experimental_event_tree()))
    while pending:  # depth first, in the order the events ran
        node = pending.pop()
        pending.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    events.sort(key=lambda event: event[0])  # stable: an op's events keep their order
    allocated: dict[int, int] = {}
    still_counted = dict(counted_blocks)
    live = peak = 0
    for _, pointer, size_bytes in events:
        if size_bytes >= 0:
            # a block at a counted address proves the counted one freed, its free unreported
            live += size_bytes - still_counted.pop(pointer, 0)
            allocated[pointer] = size_bytes
            peak = max(peak, live)
        elif pointer in allocated:
            live -= allocated.pop(pointer)
        elif pointer in still_counted:
            live -= still_counted.pop(pointer)
    return peak


def storage_blocks(tensors: Any) -> dict[int, int]:
    """Data pointer to bytes of the storages of the CPU tensors in the pytree ``tensors`` that
    torch's allocator holds (memfit's host buffers, from numpy, are not among them)."""
    from memfit.ops.host import is_host_storage
    from memfit.runtime.resident import local_tensor

    blocks = {}
    for leaf in tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.layout == torch.strided:
            storage = local_tensor(leaf).untyped_storage()
            if not is_host_storage(storage):
                blocks[storage.data_ptr()] = storage.nbytes()
    return blocks


def _measure_cuda(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> Measurement:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return Measurement(result, torch.cuda.max_memory_allocated(device), start_bytes, device)


def _first_device(*trees: Any) -> torch.device:
    for leaf in tree_leaves(trees):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")
