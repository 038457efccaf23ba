"""Ranks of a ``torch.distributed`` job that plan alike: the same plan on every rank, the same
error on every rank.

Under DDP or FSDP2 each rank runs memfit's backend on its own copy of the same program. A plan
depends on numbers each rank finds for itself: the bytes resident beside a region (FSDP2's
shards are uneven where a dimension does not divide by the world size), what eager code was
seen to hold (read from each rank's allocator), a GPU's measured profile. Ranks that planned
differently would recompute different tensors, and a rank whose plan failed while the others
went on would leave them waiting in their next collective. So every number a plan depends on
is agreed first (the largest over ranks: a plan that fits the rank holding most fits all), the
profile is rank 0's, each plan's digest is compared (rank 0's plan is taken where they still
differ), and a ``BudgetError`` on any rank is raised on every rank.

The agreement runs on a gloo group of its own, made when first needed (all ranks plan at the
same points of the same program, so they reach it together), so that it neither queues behind
nor reorders the model's own collectives, whatever their backend.

Example:
    >>> resident, eager = agree_max([resident, eager])  # without a process group: as given
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from memfit.data.errors import BudgetError

_GROUPS: dict[int, Any] = {}  # the default group's id -> memfit's gloo group beside it


def agreement_group() -> Any:
    """memfit's gloo group over every rank, or ``None`` outside a job of two or more ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    default = dist.group.WORLD
    key = id(default)
    if key not in _GROUPS:
        with real_tensors():
            _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """No mode on the dispatch stack inside the block: planning runs under AOTAutograd's fake
    mode (and on a CPU beside memfit's watch of eager code), where the tensors a collective
    sends would be fake. And no Python dispatcher, which AOTAutograd turns on around the
    partitioner: through it a collective is called with the GIL held, and gloo's worker thread,
    which frees the previous collective's tensors (their Python objects: it needs the GIL) while
    holding the work queue's lock, deadlocked with it. Seen on GPT-2 under FSDP2, 2 ranks: one
    rank's main thread waiting for that lock in ``ProcessGroupGloo::enqueue`` (holding the GIL,
    in ``raise_if_any_failed``), its worker waiting for the GIL in ``~AsyncAllreduceWork``, the
    other rank waiting for the first in the same all-reduce."""
    from torch._dispatch.python import no_python_dispatcher
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), no_python_dispatcher():
        yield


def agree_max(values: list[int]) -> list[int]:
    """Each value's largest over the ranks (``values`` as given without a process group)."""
    group = agreement_group()
    if group is None:
        return list(values)
    import torch.distributed as dist

    with real_tensors():
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return [int(value) for value in tensor.tolist()]


def agree_on(value: Any) -> Any:
    """Rank 0's ``value`` (pickled) on every rank: what only one rank should decide."""
    group = agreement_group()
    if group is None:
        return value
    import torch.distributed as dist

    box = [value]
    with real_tensors():
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree_on_hardware(hardware: Any, measured: bool) -> Any:
    """Rank 0's profile on every rank where each rank ``measured`` its own (a GPU's differs
    from rank to rank); a named or built-in profile is the same everywhere already."""
    from memfit.data.hardware import Hardware

    if not measured or agreement_group() is None:
        return hardware
    return Hardware.from_json(agree_on(hardware.to_json()), "rank 0's hardware profile")


def raise_if_any_failed(error: BudgetError | None) -> None:
    """Raise a ``BudgetError`` on every rank where any rank's planning raised one, with the same
    numbers on every rank (the largest smallest peak and budget over the failing ranks): a loop
    that retries at the error's minimum then retries at one budget on every rank, and ranks
    given different budgets would plan, and re-plan, at different points. A failing rank keeps
    its own error's tensors and note."""
    failed, minimum_bytes, budget_bytes = agree_max(
        [0, 0, 0] if error is None else [1, error.minimum_bytes, error.budget_bytes])
    if error is not None:
        if (error.minimum_bytes, error.budget_bytes) == (minimum_bytes, budget_bytes):
            raise error
        raise BudgetError(budget_bytes, minimum_bytes, error.dominant, error.strategy,
                          error.note, host_bytes=error.host_bytes)
    if failed:
        raise BudgetError(budget_bytes, minimum_bytes, strategy="auto",
                          note="Another rank of this job could not fit its region; every rank "
                               "stops here, so that none waits for the others in a collective.")


def plan_digest(plan: Any) -> str:
    """A short digest of a plan's decisions and re-runs: equal on ranks that chose alike."""
    data = plan.to_json()
    data.pop("explanation", None)
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:15]


def agree_on_plan(plan: Any) -> tuple[Any, bool]:
    """Rank 0's plan where the ranks' digests differ (``plan`` itself where they agree), and
    whether it was taken from rank 0. The digests are compared by the largest and the smallest
    over the ranks (a fixed-size all-reduce; the plan itself travels only where they differ)."""
    from memfit.data.plan import Plan

    digest = int(plan_digest(plan), 16)
    largest, negated_smallest = agree_max([digest, -digest])
    if largest == -negated_smallest:
        return plan, False
    rank_0s = agree_on(plan.to_json())
    return Plan.from_json(rank_0s, source="rank 0's plan"), True


_NONE = -(2**62)  # a freed-output count not read yet, among the agreed numbers


def agree_on_eager_bytes(regions: list) -> None:
    """What eager code held beside each region, as the rank that saw most saw it: the bytes at
    its forwards' and backwards' start and between them (the largest), the outputs freed by its
    backward's start (the fewest), whether any rank read them, and the most a measured run
    showed (the largest; read from the allocator only where every rank's was). Each rank reads
    them from its own allocator, where they can differ by a few bytes, and they decide whether a
    region is planned again (``memfit.compiler.replanning.eager_room_needed``), so every rank
    takes the same ones and plans the same."""
    if agreement_group() is None or not regions:
        return
    numbers = []
    for region in regions:
        freed = region.freed_output_bytes
        numbers += [region.eager_forward_bytes, region.eager_backward_bytes,
                    region.eager_gap_bytes, region.gap_alive_bytes,
                    _NONE if freed is None else -freed,
                    int(region.eager_read), region.measured_most_bytes,
                    int(not region.measured_only_allocator)]
    agreed = agree_max(numbers)
    for position, region in enumerate(regions):
        (forward, backward, gap, alive, freed, read, most,
         not_allocator) = agreed[8 * position:8 * position + 8]
        region.measured_most_bytes, region.measured_only_allocator = most, not not_allocator
        region.eager_forward_bytes, region.eager_backward_bytes = forward, backward
        region.eager_gap_bytes, region.gap_alive_bytes = gap, alive
        region.freed_output_bytes = None if freed == _NONE else -freed
        region.eager_read = bool(read)
