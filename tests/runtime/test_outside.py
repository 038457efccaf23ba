"""EagerWatch: the storages eager code makes or reads outside the compiled regions, on a CPU,
without making Dynamo fall back to eager; and CUDA's figure of the same bytes."""

from __future__ import annotations

import pytest
import torch

from memfit.runtime.outside import EagerWatch, cuda_outside_bytes

pytestmark = pytest.mark.usefixtures("compiled_fresh")
FLOATS = 1000  # 4,000 B float32 tensors


def test_the_watch_counts_storages_made_or_read_outside_a_pause_while_they_live():
    before = torch.randn(FLOATS)  # made before the watch: counted while an op reads it whole
    watch = EagerWatch(torch.device("cpu"))
    watch.start()
    try:
        made = before * 2
        view = made[:10]  # no storage of its own
        with watch.paused():  # a compiled region's run
            unseen = torch.randn(FLOATS) * 3
            output = torch.randn(FLOATS)
        watch.note_made([output])  # the region's output: counted once an eager op reads it
        view.add_(output[:10])
    finally:
        watch.stop()
    assert not watch.on_stack()
    after = torch.randn(FLOATS) * 4  # the watch is off: not noted
    assert watch.held_bytes([]) == 3 * 4 * FLOATS  # before, made and output
    assert watch.held_bytes([before, output]) == 4 * FLOATS  # counted elsewhere
    watch.new_iteration()  # read in the last iteration: still counted
    assert watch.held_bytes([]) == 3 * 4 * FLOATS
    watch.new_iteration()  # read two iterations ago and not since: not the step's
    assert watch.held_bytes([]) == 2 * 4 * FLOATS
    del made, output
    assert watch.held_bytes([before]) == 4 * FLOATS  # the view keeps made's storage alive
    del view
    assert watch.held_bytes([before]) == 0
    assert unseen.numel() == after.numel() == FLOATS


def test_a_dataset_an_op_copies_samples_or_reads_rows_of_is_not_the_steps_but_its_batches_are():
    """A ``TensorDataset`` made before the loop: the batch ``stack`` makes of its rows, and
    the targets indexed from it, are the step's, and so are another model's weights and the
    average of them the loop updates in place; the dataset is not, as a CPU's profiler sees
    only what is allocated while it runs."""
    dataset = torch.randn(64, FLOATS)
    labels = torch.arange(64)
    weight = torch.nn.Parameter(torch.randn(FLOATS, 4))  # another model's, made before too
    average = torch.zeros(FLOATS, 4)  # an average of its weights the loop updates in place
    watch = EagerWatch(torch.device("cpu"))
    watch.start()
    try:
        batch = torch.stack([dataset[index] for index in range(4)])
        chosen = torch.tensor([0, 1, 2, 3])  # its data is made here too (``lift_fresh``)
        targets = labels[chosen]
        features = batch[:, :FLOATS] @ weight
        copied = labels[:4].clone()
        average.lerp_(weight.detach(), 0.1)
    finally:
        watch.stop()
    made = batch.nbytes + chosen.nbytes + targets.nbytes + features.nbytes + copied.nbytes
    assert watch.held_bytes([]) == made + weight.nbytes + average.nbytes < dataset.nbytes


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
