"""Eager code beside the compiled regions: what the loop and the code at graph breaks hold while
the regions run, watched and planned for. On a CPU the backend watches it at the regions'
measured runs (``memfit.runtime.outside.EagerWatch``, a dispatch mode), from the model's first
call until runs are no longer measured; after an iteration, the regions whose plans left no room
for what was seen are planned again with it (``make_room_for_eager``).

A mixin of ``memfit.compiler.backend.Backend``, its own file so the backend reads as planning;
it uses the backend's ``device``, ``regions``, ``measure_runs``, ``eager_gave_up``,
``eager_replans``, ``eager_held``, ``eager_gap``, ``gap_saves_limit`` and ``_eager_watch``.

Example:
    >>> watch = backend.eager_watch()  # this thread's watch, or None
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.compiler.backend_options import BackendOptions
from memfit.compiler.graph_breaks import latest_regions
from memfit.compiler.region import Region
from memfit.compiler.replanning import (
    count_eager_in_prediction,
    eager_at_backward_bytes,
    eager_gap_needed,
    eager_overrun_bytes,
    eager_room_needed,
    no_room_for,
    shown_to_fit,
    warn_eager_gap_over,
    warn_eager_held_over,
)
from memfit.data.errors import BudgetWarning
from memfit.data.units import format_bytes
from memfit.runtime.outside import EagerWatch
from memfit.runtime.resident import local_tensor

MAX_EAGER_REPLANS = 3  # re-plans for what eager code holds beside the regions (it may keep growing)


BETWEEN_ITERATIONS = "between iterations"  # the eager watch's window from a backward's end


class EagerWatching:
    """The eager watch's life (started before the first call, paused inside memfit's own
    tracing, dropped when no run is measured any more), and the regions planned again for what
    eager code was seen to hold."""

    device: torch.device | None
    regions: list[Region]
    model: torch.nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    options: BackendOptions
    eager_gave_up: bool
    eager_replans: int
    eager_held: dict[Any, int]
    eager_gap: dict[Any, int]
    gap_saves_limit: dict[Any, int]
    eager_between_bytes: int
    _eager_watch: EagerWatch | None

    def watching_eager(self) -> bool:
        """Whether what eager code holds is still watched: over the iterations whose region
        runs are measured (from the first call on, ``watch_first_call``), until planning for it
        gave up. Without a budget too: nothing is planned again, but a region's predicted peak
        is the whole device's, and the loop's loss and target are on the device beside it
        (``count_eager_in_prediction``)."""
        return (not self.eager_gave_up and self.options.measure_runs > 0
                and (not self.regions or any(
                    region.measuring(self.options.measure_runs)
                    for region in latest_regions(self.regions))))

    def eager_watch(self) -> EagerWatch | None:
        """This thread's ``EagerWatch`` (a CPU's), if one is on."""
        watch = self._eager_watch
        return watch if watch is not None and watch.thread == threading.get_ident() else None

    def watch_eager(self) -> None:
        """After the compiled model returns on a CPU, while runs are measured: watch the eager
        code that follows (the loop's loss and its backward, the optimizer, code at the graph
        breaks of the next call) until runs are no longer measured. ``memfit.fit``'s module
        calls it around the model's call: a mode pushed or popped inside Dynamo's compiled call
        is undone by its dispatch-key guard when the call returns."""
        device = self.device
        if device is None or device.type != "cpu" or not self.watching_eager():
            return
        if self._eager_watch is None:
            self._eager_watch = EagerWatch(device)
        watch = self.eager_watch()
        if watch is not None:
            watch.recording = True
            watch.start()

    def note_call_arguments(self, values: Any) -> None:
        """Note the tensors the loop passes to the compiled model as eager code's, on a CPU:
        the loop holds its batch over the whole iteration, beside every region, but no eager op
        reads it when the model's first op is a compiled region's (a CUDA allocator counts it
        anyway). The region given it counts it as its argument, the others as eager bytes, so
        that a later stage's plan (FSDP2's, say) counts the batch too."""
        watch = self.eager_watch()
        if watch is not None and watch.recording:
            watch.note_call_arguments(values)

    def watch_first_call(self, model: torch.nn.Module) -> None:
        """Before the compiled model's first call, on a CPU: watch it already, so that what eager
        code makes in the first forward (code at graph breaks: an embedding before FSDP2's first
        block, the blocks' inputs that their backward reads) is read at the regions' runs of the
        first iteration, and the plans made after it count it: otherwise they count only what
        eager code holds after the first iteration, and the next iterations run over the
        budget."""
        if self.regions or self.device is not None:
            return
        device = next((local_tensor(p).device for p in model.parameters()), None)
        if device is not None and device.type == "cpu":
            self.device = device
            self.watch_eager()

    def end_eager_watch(self) -> None:
        """Before the compiled model's call: the watch off the mode stack and dropped once no
        run is measured any more."""
        watch = self.eager_watch()
        if watch is None or self.watching_eager():
            return
        watch.stop()
        if not watch.on_stack():
            self._eager_watch = None

    def eager_bytes_now(self, example_inputs: list) -> int:
        """Bytes eager code holds now, beside a region compiled at its first call (its forward
        runs next with them alive): what ``EagerWatch`` noted, less the model, its optimizers'
        state, FSDP2's gathered parameters, the region's own inputs and the open regions'
        saves; 0 where no watch is on (not a CPU, or runs no longer measured)."""
        from memfit.compiler.region_peak import (
            open_saved_storages,
            outside_plans_bytes,
            resident_alive,
        )

        device = self.device
        if (device is None or device.type != "cpu" or self.eager_watch() is None
                or any(isinstance(value, FakeTensor) for value in example_inputs)):
            return 0
        alive = [*resident_alive(self), *example_inputs]  # type: ignore[arg-type]
        pending = sum(region.saved_bytes * region.open_forwards for region in self.regions)
        saved = open_saved_storages(self)  # type: ignore[arg-type]
        return outside_plans_bytes(self, device, alive, pending, saved)  # type: ignore[arg-type]

    def beside_more_eager(self, regions: list[Region], args: Sequence) -> bool:
        """Whether the compiled region planned as ``regions`` is planned again before it runs
        with ``args``, beside more of eager code's bytes than its checked peak has room for
        (``no_room_for``: the bytes now over its forward; over its backward, those at its last
        backward's start less its outputs freed by then, and the bytes added since): tensors
        the loop made since its plan and keeps (an EMA copy of the model, another model's
        state), which a measured run would only show over the budget.
        Left alone: a region whose measured runs, read from the allocator, fit with the bytes
        added since (``shown_to_fit``; a loop keeping its batches in a list holds one more
        each iteration, and a plan made for each would keep its runs measured and planned
        again), and one at its smallest peak (the same plan would come back). On a CPU while
        runs are measured (``eager_bytes_now``), within ``MAX_EAGER_REPLANS``, on one rank
        only (each reads its own bytes; a plan made on one alone would leave the others in its
        collectives). Its next plan counts them (``eager_held``)."""
        from memfit.runtime.ranks import agreement_group

        newest = regions[-1]
        if (newest.budget_bytes is None or newest.minimum_bytes is not None  # the same again
                or self.options.fixed_plan is not None or self.eager_gave_up
                or self.eager_replans >= MAX_EAGER_REPLANS or agreement_group() is not None):
            return False
        now = self.eager_bytes_now(list(args))
        seen = max(newest.eager_forward_bytes, newest.eager_backward_bytes)
        # what the loop made since its last forward it holds through this backward too
        backward = eager_at_backward_bytes(newest) + max(0, now - newest.eager_forward_bytes)
        if not no_room_for(newest, now, backward) or (
                shown_to_fit(newest)  # its runs beside them, and the rest, fit
                and newest.measured_most_bytes + max(0, now - seen) <= newest.budget_bytes):
            return False
        self.eager_held[newest.site] = max(now, self.eager_held.get(newest.site, 0))
        self.eager_replans += 1
        for region in regions:
            region.replaced = True
        return True

    def watch_between_iterations(self) -> None:
        """An iteration's backward ended: watch eager code's peak until a region's forward
        runs again (the data loading, another model's forward: a teacher's beside a student),
        with every byte the device holds then (``device_bytes_alive``)."""
        from memfit.compiler.region_peak import device_bytes_alive

        watch, device = self.eager_watch(), self.device
        if watch is not None and device is not None:
            watch.open_window(BETWEEN_ITERATIONS, (),
                              functools.partial(device_bytes_alive, self, device),
                              alive_each_op=True)

    def check_between_iterations(self, region: Region) -> None:
        """Before ``region``'s forward opens an iteration: where the device held more than its
        budget while eager code ran since the last iteration (no plan open: nothing of memfit's
        can lower it), say so at this call, and note it for the report."""
        watch = self.eager_watch()
        if watch is None:
            return
        _, alive = watch.close_window(BETWEEN_ITERATIONS)
        if region.budget_bytes is None or alive <= region.budget_bytes:
            return
        warnings.warn(
            f"memfit: eager code between iterations (the optimizer's step, another model's "
            f"forward, the batch's loading) held the device at {format_bytes(alive)}, over the "
            f"{format_bytes(region.budget_bytes)} budget, with no compiled region open: no plan "
            "can lower that. Raise the budget, or fit the other model too (memfit.fit) or run "
            "it in smaller pieces, or step with fewer temporaries (fused=True).", BudgetWarning,
            stacklevel=3)
        self.eager_between_bytes = max(self.eager_between_bytes, alive)

    def eager_watch_off(self) -> contextlib.AbstractContextManager:
        """No watch on the mode stack inside the block (memfit's own tracing of a region, which
        Dynamo does not do for it), balanced, so Dynamo's guard sees the stack it saved."""
        from torch.utils._python_dispatch import _pop_mode_temporarily

        watch = self.eager_watch()
        if watch is None or not watch.on_stack():
            return contextlib.nullcontext()
        return _pop_mode_temporarily()

    def make_room_for_eager(self, current: list[Region]) -> dict[int, int]:
        """Have the regions whose plans left no room for the bytes eager code was seen to hold
        at their start planned again with them (``memfit.compiler.replanning.eager_room_needed``);
        after ``MAX_EAGER_REPLANS`` rounds, say once that eager code keeps holding more. A region
        already at its smallest peak beside earlier regions' saves is not planned again for
        them (the same plan would come back): its next plan, joint or not, counts them.

        Returns:
            region index -> the bytes its next plan counts beyond this one's (joint planning
            leaves the regions before a graph break that much less room).
        """
        if not self.watching_eager():
            watch = self.eager_watch()
            if watch is not None:
                watch.recording = False  # off the stack after the next step or model call
        count_eager_in_prediction(current)
        needed, gaps = eager_room_needed(current), eager_gap_needed(current)
        if not (needed or gaps) or self.eager_gave_up:
            return {}
        if self.eager_replans >= MAX_EAGER_REPLANS:
            self.eager_gave_up = True
            warnings.warn(
                f"memfit: eager code outside the compiled regions held more after each of "
                f"{MAX_EAGER_REPLANS} re-plans (a list of losses that keeps their buffers?); it "
                "is no longer planned for, so the budget may not hold. Keep `loss.item()` rather "
                "than the loss, or compute the loss inside the model.", BudgetWarning,
                stacklevel=2)
            return {}
        said: set[int] = set()
        for region, gap in gaps:  # its site's next plan saves less
            self.eager_gap[region.site] = max(gap, self.eager_gap.get(region.site, 0))
            over = region.gap_alive_bytes - (region.budget_bytes or 0)
            if over > 0:  # measured over: said, and the saves less by at least as much
                warn_eager_gap_over(region)
                said.add(region.index)
                self.gap_saves_limit[region.site] = min(
                    region.saved_bytes - over,
                    self.gap_saves_limit.get(region.site, region.saved_bytes))
        for region, held in needed:
            self.eager_held[region.site] = held  # its site's next plan counts them
            if (region.minimum_bytes is None and region.index not in said
                    and eager_overrun_bytes(region)):  # measured over: said at this call
                warn_eager_held_over(region, held)
        fitting = [region for region, _ in [*needed, *gaps] if region.minimum_bytes is None]
        if fitting:  # a short region runs at its smallest peak: only joint planning helps it
            self.eager_replans += 1
            for region in fitting:
                region.replaced = True
        return {region.index: held - region.planned_eager_bytes for region, held in needed}
