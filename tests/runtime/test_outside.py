"""EagerWatch: the storages eager code makes or reads outside the compiled regions, on a CPU,
without making Dynamo fall back to eager; and CUDA's figure of the same bytes."""

from __future__ import annotations

import pytest
import torch

from memfit.runtime.outside import EagerWatch, cuda_outside_bytes

pytestmark = pytest.mark.usefixtures("compiled_fresh")
FLOATS = 1000  # 4,000 B float32 tensors


def test_the_watch_counts_storages_made_or_read_outside_a_pause_while_they_live():
    before = torch.randn(FLOATS)  # made before the watch: counted once an op reads it
    watch = EagerWatch(torch.device("cpu"))
    watch.start()
    try:
        made = before * 2
        view = made[:10]  # no storage of its own
        with watch.paused():  # a compiled region's run
            unseen = torch.randn(FLOATS) * 3
    finally:
        watch.stop()
    assert not watch.on_stack()
    after = torch.randn(FLOATS) * 4  # the watch is off: not noted
    assert watch.held_bytes([]) == 2 * 4 * FLOATS  # before and made
    assert watch.held_bytes([before]) == 4 * FLOATS  # counted elsewhere (a region's argument)
    del made
    assert watch.held_bytes([before]) == 4 * FLOATS  # the view keeps made's storage alive
    del view
    assert watch.held_bytes([before]) == 0
    assert unseen.numel() == after.numel() == FLOATS


def test_compiled_code_runs_compiled_under_the_watch():
    """Dynamo compiles and runs its graphs with the watch on (an ordinary dispatch mode makes it
    run the function eagerly instead); the watch sees the compiled run's ops, which the backend
    pauses it for."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(lambda x: (x * 2).sin(), backend=backend)
    watch = EagerWatch(torch.device("cpu"))
    watch.start()
    try:
        first = compiled(torch.ones(FLOATS))
        second = compiled(torch.ones(FLOATS))
    finally:
        watch.stop()
    assert len(graphs) == 1  # compiled once, under the watch, and not again
    assert torch.equal(first, second)
    assert watch.held_bytes([]) >= 2 * 4 * FLOATS  # first and second (not paused here)


def test_a_watch_is_not_pushed_over_a_mode_of_the_users():
    """Pushed over the user's mode, the user's ``with`` would pop it: the watch stays off."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Users(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    watch = EagerWatch(torch.device("cpu"))
    with Users():
        watch.start()
        assert not watch.on_stack()
        torch.ones(FLOATS) * 2
    assert watch.held_bytes([]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_what_the_allocator_holds_beyond_the_counted_tensors():
    device = torch.device("cuda", torch.cuda.current_device())
    known = torch.empty(1 << 20, device=device)  # 4 MiB: a multiple of the allocator's block
    base = cuda_outside_bytes(device, [known], saves_bytes=0)
    held = torch.empty(1 << 20, device=device)
    assert cuda_outside_bytes(device, [known], saves_bytes=0) - base == held.nbytes
    assert cuda_outside_bytes(device, [known, held], saves_bytes=0) == base
    assert cuda_outside_bytes(device, [known], saves_bytes=held.nbytes) == base
