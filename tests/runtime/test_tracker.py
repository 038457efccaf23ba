"""DeviceMemoryTracker: agrees with torch's MemTracker, skips host-tier buffers, dedupes views."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from memfit.ops.host import HostPool
from memfit.runtime.measure import measure_peak
from memfit.runtime.tracker import DeviceMemoryTracker

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    input_ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, input_ids, torch.ones_like(input_ids)


def _step(model, input_ids, attention_mask):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss.backward()
    return loss.detach()


def test_tracker_matches_memtracker_to_the_byte_on_gpt2(gpt2):
    """Both count each output storage once and subtract it when the storage dies.

    Note:
        MemTracker reports the peak per device as ``get_tracker_snapshot("peak")[device]["Total"]``,
        which includes what ``track_external`` registered (parameters, buffers, inputs) and the
        gradients it sees being made; so does ``peak_bytes`` here after ``register``. Both see
        only dispatcher-level allocations; the same step is run twice, gradients reset before each.
    """
    model, input_ids, attention_mask = gpt2
    _step(model, input_ids, attention_mask)  # warm up lazy state outside both trackers
    model.zero_grad(set_to_none=True)
    reference = MemTracker()
    reference.track_external(model, input_ids, attention_mask)
    with reference:
        _step(model, input_ids, attention_mask)
    reference_peak_bytes = reference.get_tracker_snapshot("peak")[CPU]["Total"]
    reference_current_bytes = reference.get_tracker_snapshot("current")[CPU]["Total"]
    model.zero_grad(set_to_none=True)
    tracker = DeviceMemoryTracker(CPU)
    tracker.register([list(model.parameters()), list(model.buffers()), input_ids, attention_mask])
    with tracker:
        _step(model, input_ids, attention_mask)
    assert tracker.peak_bytes == reference_peak_bytes
    assert tracker.current_bytes == reference_current_bytes  # parameters, inputs and gradients
    model.zero_grad(set_to_none=True)


def test_host_pool_buffers_are_not_device_bytes():
    tracker = DeviceMemoryTracker(CPU)
    pool = HostPool(CPU)
    source = torch.ones(1000)
    with tracker:
        host = pool.empty_like(source)
        host.copy_(source)
        device_copy = source.clone()
    assert tracker.current_bytes == device_copy.untyped_storage().nbytes() == 4000
    del host, device_copy
    assert tracker.current_bytes == 0


def test_views_and_in_place_ops_add_nothing():
    tracker = DeviceMemoryTracker(CPU)
    with tracker:
        base = torch.zeros(10, 100)
        views = [base.t(), base[3:], base.view(-1), base.detach(), base.add_(1)]
        assert tracker.current_bytes == 4000
        del base, views
    assert tracker.current_bytes == 0 and tracker.peak_bytes == 4000


def test_registered_tensors_count_once_and_free_when_they_die():
    parameter = torch.nn.Parameter(torch.ones(250))
    buffer = torch.ones(500, dtype=torch.float64)
    tracker = DeviceMemoryTracker(CPU)
    tracker.register({"parameters": [parameter, parameter], "buffers": (buffer, buffer[1:]),
                      "not a tensor": 3})
    assert tracker.current_bytes == 1000 + 4000
    with tracker:
        temporary = parameter * 2
        del temporary
    assert tracker.peak_bytes == 6000
    tracker.reset_peak()
    assert tracker.peak_bytes == 5000
    del buffer
    assert tracker.current_bytes == 1000


def test_other_devices_are_not_counted():
    tracker = DeviceMemoryTracker(CPU)
    with tracker:
        torch.empty(100, device="meta")
    assert tracker.peak_bytes == 0


def test_measure_peak_counts_arguments_and_track():
    weight = torch.ones(100, 100)  # 40_000 bytes, passed through `track`
    x = torch.ones(100)

    def step(x):
        return (weight @ x).sum()

    result, peak_bytes = measure_peak(step, x, track=[weight])
    measured = measure_peak(step, x, track=[weight])
    assert result == 10_000
    assert measured.start_bytes == 40_400
    assert peak_bytes == measured.peak_bytes == 40_400 + 400 + 4  # matvec result, then its sum
    assert measured.above_start_bytes == 404
