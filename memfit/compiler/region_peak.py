"""The measured device peak of one run of a planned region's forward or backward module.

The budget is the whole device's peak, so a region's measured peak is the bytes alive when its
module starts plus the most its run adds above that. What adds is read from the allocator: the
profiler's CPU-allocator events on a CPU (kernel scratch included), the allocator's peak on CUDA
where it rose. Where that cannot be read (the user's own profiler is on, and profilers do not
nest; on CUDA, a peak below an earlier one, since the user's statistics are not reset) the
dispatch tracker counts it inside the module's generated code, which sees only what ops return
(a dispatch mode there leaves compiled code running; around the *compiled model* it would make
Dynamo fall back to eager). What is alive at the start is read from the allocator on CUDA
(``torch.cuda.memory_allocated``: every byte, whoever holds it); on a CPU, which has no such
counter, it is what memfit knows to be alive (parameters, gradients, buffers, optimizer state,
the module's arguments, the saves of regions still open and, in a backward, its forward's
inputs and outputs still alive) plus what eager code was seen to hold
(``memfit.runtime.outside``: the loss computed in the loop, its buffers and labels), each
storage once: a save of an open region that is also among those tensors (the tensor at a graph
break, a parameter's transpose) is counted once (``saves_counted_twice``).

Example:
    >>> result, peak_bytes = run_measured(module, args, device, resident, outside_bytes=0)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.ops.host import is_host_storage
from memfit.runtime.measure import allocator_rise, profiler_running, storage_blocks
from memfit.runtime.resident import local_tensor
from memfit.runtime.tracker import DeviceMemoryTracker

if TYPE_CHECKING:
    from memfit.compiler.region import Planner, Region

# One CPU profiler at a time in the process: two threads' profilers starting and stopping
# together crash torch (tests/test_threads.py); a run that finds it taken is counted by ops.
_PROFILER_LOCK = threading.Lock()


def run_measured(call: Callable[[list], Any], args: list, device: torch.device,
                 resident: list[torch.Tensor], outside_bytes: int) -> tuple[Any, int, str]:
    """``call(args)`` (a boxed module: it empties ``args``), the device's peak bytes during it,
    and how the rise was counted: ``"allocator"`` (CUDA's allocator, or on a CPU the profiler's
    allocator events, kernel scratch included) or ``"ops"`` (the dispatch tracker, used on a CPU
    while the user's own profiler runs, since profilers do not nest: what ops return only).

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
    counted_blocks = storage_blocks((resident, args))
    resident.clear()
    if not _PROFILER_LOCK.acquire(blocking=False):  # another thread's measurement profiles
        return _counted_by_ops(tracker, call, args, outside_bytes)
    try:
        if profiler_running():  # the user's profiler is on: none nests
            return _counted_by_ops(tracker, call, args, outside_bytes)
        start_bytes = tracker.current_bytes  # the tracker only counts here: no mode is entered
        result, above_bytes = _allocator_rise(call, args, counted_blocks)
    finally:
        _PROFILER_LOCK.release()
    return result, outside_bytes + start_bytes + above_bytes, "allocator"


def _counted_by_ops(tracker: DeviceMemoryTracker, call: Callable[[list], Any], args: list,
                    outside_bytes: int) -> tuple[Any, int, str]:
    """``call(args)`` under the dispatch tracker (resident and args included): what ops return."""
    with tracker:
        result = call(args)
    return result, outside_bytes + tracker.peak_bytes, "ops"


def _allocator_rise(call: Callable[[list], Any], args: list,
                    counted_blocks: dict[int, int]) -> tuple[Any, int]:
    """``call(args)`` and the most bytes torch's CPU allocator held above its start level during
    it (``allocator_rise``: only frees of blocks allocated in the call or counted at its start,
    ``counted_blocks``, lower it): scratch memory a kernel allocates inside itself (a oneDNN
    convolution's) counts, which the dispatch tracker cannot see. Python's cyclic garbage
    collector is paused meanwhile, so that collecting garbage made before the call cannot run
    finalizers inside it."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    collecting = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            result = call(args)
    finally:
        if collecting:
            gc.enable()
    return result, allocator_rise(profiler, counted_blocks)


def _run_measured_cuda(call: Callable[[list], Any], args: list, device: torch.device,
                       resident: list[torch.Tensor]) -> tuple[Any, int, str]:
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
        return result, peak_after, "allocator"
    return result, start_bytes + (tracker.peak_bytes - tracked_start), "ops"


def measure_region_run(planner: Planner, region: Region, call: Callable[[list], Any], args: list,
                       is_backward: bool) -> Any:
    """Run a region's module (boxed), recording the device's peak during it on the region.

    Alive beside it: the model, its optimizers' state, the saves of the other open regions (and,
    for a forward, of this region's own earlier forwards whose backward has not run) and, for a
    backward, the inputs and outputs of its forward still alive (the loop holds the batch and
    the loss), and what eager code holds beyond those (``outside_plans_bytes``: a CPU
    ``mse_loss`` returns a 0-dim view of an input-sized buffer) or the loop holds of the other
    regions' outputs (``held_outputs``), noted on the region as ``eager_forward_bytes`` /
    ``eager_backward_bytes`` for its next plan.
    """
    import weakref

    device = next((value.device for value in args if isinstance(value, torch.Tensor)),
                  torch.device("cpu"))
    others = sum(other.saved_bytes * other.open_forwards for other in planner.regions
                 if other is not region)
    own = region.saved_bytes * (region.open_forwards - (1 if is_backward else 0))
    alive = resident_alive(planner)
    inputs = [weakref.ref(value) for value in args if isinstance(value, torch.Tensor)]
    if is_backward:
        alive += [value for value in (ref() for ref in region.forward_values) if value is not None]
    # a save of another region that is among these tensors (the tensor at a graph break: an
    # earlier region's saved output, this one's input) or another's save too counts once
    others -= saves_counted_twice(planner, region, [*alive, *args], device)
    saved = open_saved_storages(planner)  # counted as others' (and own) saves
    held = held_outputs(planner, region)
    eager = outside_plans_bytes(planner, device, [*alive, *args, *held], others + max(own, 0),
                                saved, region.saved_storages)
    eager += storages_bytes(held, device, exclude=[*alive, *args], saved=saved)
    del held  # not kept alive by the measurement: this run may free them
    watch = planner.eager_watch()
    if is_backward:
        gap, alive_then = watch.close_window(region.index) if watch is not None else (0, 0)
        region.eager_gap_bytes = max(region.eager_gap_bytes, gap)
        region.gap_alive_bytes = max(region.gap_alive_bytes, alive_then)
        region.eager_backward_bytes = max(region.eager_backward_bytes, eager)
        region.eager_read = region.eager_read or eager_is_read(planner, device)
        freed = freed_output_bytes(region)
        region.freed_output_bytes = (freed if region.freed_output_bytes is None
                                     else min(region.freed_output_bytes, freed))
    else:
        region.eager_forward_bytes = max(region.eager_forward_bytes, eager)
    on_cpu = eager if device.type != "cuda" else 0  # CUDA's allocator counts them already
    result, peak_bytes, region.measured_by = run_measured(call, args, device, alive,
                                                          others + max(own, 0) + on_cpu)
    region.measured_most_bytes = max(region.measured_most_bytes,
                                     peak_bytes + planner.state_to_come_bytes())
    region.measured_only_allocator &= region.measured_by == "allocator"
    if is_backward:
        region.measured_backward_bytes = peak_bytes
    else:
        outputs = [weakref.ref(value) for value in result if isinstance(value, torch.Tensor)]
        region.forward_values = (*inputs, *outputs)
        region.output_values = tuple(outputs[:len(region.output_names)])
        if watch is not None:  # eager code's peak until its backward (eager_gap_bytes)
            watch.open_window(region.index, result,
                              functools.partial(device_bytes_alive, planner, device))
        region.measured_forward_bytes = peak_bytes
    region.measured_runs += 1
    region.measure_pending = max(0, region.measure_pending - 1)
    return result


def held_outputs(planner: Planner, region: Region) -> list[torch.Tensor]:
    """The user-visible outputs of the other regions' latest measured forwards still alive: the
    loop holds a later region's outputs (a language model's logits, made after a graph break)
    through an earlier region's backward, where no plan of that region counts them and no eager
    op need read them."""
    return [value for other in planner.regions if other is not region
            for value in (reference() for reference in other.output_values)
            if value is not None]


def storages_bytes(tensors: list, device: torch.device, exclude: list, saved: list) -> int:
    """Bytes of the storages of ``tensors`` on ``device``, each once, less those of ``exclude``
    and the open saves ``saved`` (weak references)."""
    counted: dict[StorageWeakRef, int] = {}
    for tensor in exclude:
        _add_storage(counted, tensor, device)
    skip = set(counted) | set(saved)
    sizes: dict[StorageWeakRef, int] = {}
    for tensor in tensors:
        _add_storage(sizes, tensor, device)
    return sum(size for reference, size in sizes.items() if reference not in skip)


def saves_counted_twice(planner: Planner, region: Region, counted: list,
                        device: torch.device) -> int:
    """Bytes of the other open regions' saves (as their ``saved_bytes`` count them) that are
    counted already: storages of ``counted`` (what the measured run sees alive: the model, its
    optimizers' state, its arguments; after a graph break, the earlier region's saved output
    it takes) or saved by another of those regions too. Only the saves of each region's latest
    forward, where it is known to be open (``Region.open_latest_saves``), and never more than
    the region counts: what is taken off was counted twice, so the sum never falls below the
    storages alive."""
    seen = {StorageWeakRef(local_tensor(value).untyped_storage()) for value in counted
            if isinstance(value, torch.Tensor) and value.device == device and not value.is_meta}
    twice = 0
    for other in planner.regions:
        if other is region or not other.open_forwards:
            continue
        found = 0
        for reference, size in other.open_latest_saves().items():
            if reference in seen:
                found += size
            seen.add(reference)
        twice += min(found, other.saved_bytes)
    return twice


def resident_alive(planner: Planner) -> list:
    """What every plan counts as resident: the model, its optimizers' state and FSDP2's
    gathered parameters and their buffers."""
    from memfit.runtime.resident import (
        fsdp_gather_buffers,
        fsdp_unsharded_tensors,
        resident_tensors,
    )

    partners = [tensor for model, optimizers in planner.partners()
                for tensor in resident_tensors(model, optimizers)]
    return [*resident_tensors(planner.model, planner.optimizers), *partners,
            *fsdp_unsharded_tensors(planner.model), *fsdp_gather_buffers(planner.model)]


def device_bytes_alive(planner: Planner, device: torch.device,
                       made: dict[StorageWeakRef, int]) -> int:
    """Bytes alive on ``device`` now among what memfit sees, each storage once: the model, its
    optimizers' state, the saves of open regions and their forwards' inputs and outputs, the
    loop's tensors and what else eager code noted (``EagerWatch.noted_storages``: another
    model's weights) and ``made`` (storages eager code made)."""
    sizes = dict(made)
    for tensor in resident_alive(planner):
        _add_storage(sizes, tensor, device)
    for region in planner.regions:
        if not region.open_forwards:
            continue
        sizes.update((ref, size) for ref, size in region.saved_sizes.items() if not ref.expired())
        for reference in region.forward_values:
            _add_storage(sizes, reference(), device)
    watch = planner.eager_watch()
    if watch is not None:
        sizes.update(watch.loop_storages())
        sizes.update(watch.noted_storages())
    return sum(sizes.values())


def _add_storage(sizes: dict[StorageWeakRef, int], value: Any, device: torch.device) -> None:
    if isinstance(value, torch.Tensor) and value.device == device and not value.is_meta:
        storage = value.untyped_storage()
        if not is_host_storage(storage):  # memfit's host tier: not the device's memory
            sizes.setdefault(StorageWeakRef(storage), storage.nbytes())


def open_saved_storages(planner: Planner) -> list:
    """Weak references to the saved storages of every region whose forward is open."""
    return [reference for region in planner.regions if region.open_forwards
            for reference in region.saved_storages]


def outside_plans_bytes(planner: Planner, device: torch.device, counted: list,
                        saves_bytes: int, saved: list | None = None, own_saved: tuple = ()) -> int:
    """Bytes alive on ``device`` that no plan counts (eager code's: the loop's loss and its
    buffers, tensors made at a graph break), beside ``counted`` tensors and ``saves_bytes`` of
    open regions' saves: from CUDA's allocator, or on a CPU from the backend's ``EagerWatch``
    (0 where this thread has none), less the storages of those saves (``saved``, weakly) that
    eager code touched (``own_saved``: the measured region's own, see
    ``EagerWatch.held_bytes``): FSDP2's hooks between per-block regions pass each block's
    input, saved by that block, through eager ops, and those saves are the plan's, not eager
    code's."""
    from memfit.runtime.outside import cuda_outside_bytes

    if device.type == "cuda":
        return cuda_outside_bytes(device, counted, saves_bytes)
    watch = planner.eager_watch()
    return watch.held_bytes(counted, saved or (), own_saved) if watch is not None else 0


def eager_is_read(planner: Planner, device: torch.device) -> bool:
    """Whether ``outside_plans_bytes`` reads eager code's bytes on ``device`` (CUDA's allocator,
    a CPU's ``EagerWatch``) rather than giving 0 for want of a watch."""
    return device.type == "cuda" or planner.eager_watch() is not None


def freed_output_bytes(region: Region) -> int:
    """Bytes of ``region``'s forward outputs already freed when its backward starts (the loop
    dropped them; an eager loss's backward released them): its checked plan holds every output
    to the step's end, so these are room the plan counts that eager code's bytes may take."""
    names = {name for name, reference in zip(region.output_names, region.output_storages,
                                             strict=False)
             if name is not None and reference is not None and reference.expired()
             and name not in region.released_outputs}  # those its plan did not hold
    return sum(region.graph.tensors[name].size_bytes for name in names
               if name in region.graph.tensors and region.graph.tensors[name].is_output)
