"""The measured device peak of one run of a planned region's forward or backward module.

The budget is the whole device's peak, so a region's measured peak is the bytes alive when its
module starts plus the most its run adds above that. What adds is counted by the dispatch
tracker around the module's generated code: it only sees the aten ops inside, so compiled code
keeps running (a dispatch mode around the *compiled model* would make Dynamo fall back to
eager). What is alive at the start is read from the allocator on CUDA
(``torch.cuda.memory_allocated``: every byte, whoever holds it); on a CPU, which has no such
counter, it is what memfit knows to be resident (parameters, gradients, buffers, optimizer
state, the module's arguments, the saves of regions still open), so tensors the user's loop
holds outside memfit's view (labels, the loss) are not in the CPU figure.

Example:
    >>> result, peak_bytes = run_measured(module, args, device, resident, outside_bytes=0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.runtime.tracker import DeviceMemoryTracker


def run_measured(call: Callable[[list], Any], args: list, device: torch.device,
                 resident: list[torch.Tensor], outside_bytes: int) -> tuple[Any, int]:
    """``call(args)`` (a boxed module: it empties ``args``) and the device's peak bytes during it.

    Args:
        call: the module's boxed call.
        args: its arguments.
        device: the device measured.
        resident: tensors alive at the start besides ``args`` (counted once per storage);
            emptied once counted, so that holding them does not keep a tensor alive that the
            call frees (a saved activation the loop also saw).
        outside_bytes: bytes alive that no tensor here stands for (saves of other regions),
            added on a CPU only: on CUDA the allocator already holds them.
    """
    if device.type == "cuda":
        return _run_measured_cuda(call, args, device, resident)
    tracker = DeviceMemoryTracker(device)
    tracker.register((resident, args))
    resident.clear()
    with tracker:
        result = call(args)
    return result, outside_bytes + tracker.peak_bytes  # the resident and args included


def _run_measured_cuda(call: Callable[[list], Any], args: list, device: torch.device,
                       resident: list[torch.Tensor]) -> tuple[Any, int]:
    """The allocator's bytes at the start plus the tracker's rise; where the allocator's own
    peak rose during the call, that peak (it also sees kernel workspaces). The user's peak
    statistics are left as they are: nothing is reset."""
    resident.clear()  # the allocator counts them; holding them could only extend lifetimes
    torch.cuda.synchronize(device)
    start_bytes = torch.cuda.memory_allocated(device)
    peak_before = torch.cuda.max_memory_allocated(device)
    tracker = DeviceMemoryTracker(device)
    tracker.register(args)
    tracked_start = tracker.current_bytes
    with tracker:
        result = call(args)
    torch.cuda.synchronize(device)
    peak_after = torch.cuda.max_memory_allocated(device)
    if peak_after > peak_before:
        return result, peak_after
    return result, start_bytes + (tracker.peak_bytes - tracked_start)
