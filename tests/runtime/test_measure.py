"""measure_allocator_peak counts what the measured call holds, whatever an earlier call left."""

import torch

from memfit.runtime.measure import measure_allocator_peak


class _Cycle:
    """Reachable only from itself: freed when the garbage collector runs, not before."""


def test_an_earlier_calls_garbage_does_not_lower_the_peak():
    """A block allocated while an earlier measurement ran and collected as garbage during this
    one reached the running sum as a negative delta (a compile starts the collector): the call
    measured 0 B while it held 4,000 B."""
    held: dict[str, _Cycle] = {}

    def leave_garbage() -> None:
        cycle = _Cycle()
        cycle.itself, cycle.tensor = cycle, torch.zeros(80_000)
        held["cycle"] = cycle

    measure_allocator_peak(leave_garbage)
    del held["cycle"]

    def hold_and_collect() -> torch.Tensor:
        import gc

        gc.collect()
        return torch.zeros(1_000)

    measured = measure_allocator_peak(hold_and_collect)
    assert measured.peak_bytes >= measured.result.nbytes, measured.peak_bytes
