"""What the CPU profile measures is what prices a step's ops: a convolution at the convolution
rate ``measure_cpu`` timed over a forward and its backward, batch norm and layer norm (forward
and backward), softmax, ``_safe_softmax`` and dropout's backward at their element families'
measured rates. Structural: the probes' clock is replaced by a fixed one, so no assertion
depends on this machine's speed."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.api import analyzed
from memfit.data.hardware import PROFILES
from memfit.data.op_classes import element_family, op_class
from memfit.runtime import cpu_probe
from memfit.tracing.capture import capture

PROBE_S = 1e-3  # every probe's median, by the fixed clock


@pytest.fixture
def fixed_clock(monkeypatch):
    """Every probe's median time is ``PROBE_S``; records the operations timed."""
    timed: list = []

    def median_time_s(operation, repeats=cpu_probe.REPEATS, inner=1, before=None):
        timed.append(operation)
        return PROBE_S

    monkeypatch.setattr(cpu_probe, "median_time_s", median_time_s)
    return timed


def test_the_convolution_rate_is_timed_over_a_forward_and_its_backward(fixed_clock):
    rates = []
    for shape in cpu_probe.CONVOLUTION_SHAPES:
        batch, channels_in, channels_out, side, kernel = shape
        forward_flops = 2 * batch * channels_out * side**2 * channels_in * kernel**2
        rates.append(3 * forward_flops / (2 * PROBE_S))  # two timed calls, PROBE_S each
    assert cpu_probe.convolution_flops_per_s() == pytest.approx(sorted(rates)[1])
    assert len(fixed_clock) == 2 * len(cpu_probe.CONVOLUTION_SHAPES)  # forward, both gradients
    batch, channels_in, channels_out, side, kernel = cpu_probe.CONVOLUTION_SHAPES[-1]
    gradients = fixed_clock[-1]()
    assert gradients[0].shape == (batch, channels_in, side, side)
    assert gradients[1].shape == (channels_out, channels_in, kernel, kernel)


def test_normalization_rates_are_elements_over_a_forward_and_its_backward(fixed_clock):
    rates = cpu_probe.normalization_rates()
    batch, _, channels, side, _ = cpu_probe.CONVOLUTION_SHAPES[1]
    rows, width = cpu_probe.LAYER_NORM_SHAPE
    assert rates == pytest.approx({"batch_norm": batch * channels * side**2 / PROBE_S,
                                   "layer_norm": rows * width / PROBE_S})
    assert len(fixed_clock) == 4
    for operation in fixed_clock:  # each probe runs (the backward probes on saved statistics)
        operation()


def test_the_measured_profile_carries_the_convolution_and_normalization_rates(fixed_clock):
    measured = cpu_probe.measure_cpu()
    convolution = measured.flops_per_s["float32"] * measured.compute_efficiency["convolution"]
    assert convolution == pytest.approx(cpu_probe.convolution_flops_per_s())
    assert {"transcendental", "random", "batch_norm", "layer_norm", "softmax", "safe_softmax",
            "dropout", "dropout_backward"} <= set(measured.element_rates)


def _captured_ops(model, loss_fn, inputs, hardware):
    graph = analyzed(capture(model, loss_fn, *inputs, hardware=hardware), hardware, "", False)[1]
    return graph.ops


def test_a_cnn_step_prices_its_convolutions_and_batch_norms_at_the_measured_rates():
    hardware = PROFILES["cpu"].with_(
        compute_efficiency={"convolution": 0.25, "matmul": 1.0},
        element_rates={"batch_norm": 1e6})  # far slower than the bytes: the rate decides
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 64, 4))

    def loss_fn(model, images):
        return model(images).square().mean()

    ops = _captured_ops(model, loss_fn, (torch.randn(2, 3, 8, 8),), hardware)
    convolutions = [op for op in ops if op_class(op.kind) == "convolution"]
    assert {op.kind for op in convolutions} == {"aten.convolution", "aten.convolution_backward"}
    peak = hardware.flops_rate("float32")
    for op in convolutions:
        compute_s = op.flops / (peak * 0.25) + hardware.compute_ramp_s
        assert op.time_s >= compute_s + hardware.op_overhead_s - 1e-12
    norms = [op for op in ops if element_family(op.kind) == "batch_norm"]
    assert len(norms) == 2  # the forward (training: statistics) and its backward
    for op in norms:
        assert op.elements == 2 * 8 * 8 * 8
        assert op.time_s == pytest.approx(op.elements / 1e6 + hardware.op_overhead_s)


def test_layer_norm_safe_softmax_and_pow_are_priced_by_their_families():
    assert element_family("aten.native_layer_norm") == "layer_norm"
    assert element_family("aten.native_layer_norm_backward") == "layer_norm"
    assert element_family("aten._safe_softmax") == "safe_softmax"
    assert element_family("aten.pow") == "arithmetic"  # GELU's cube: multiplications
    hardware = PROFILES["cpu"].with_(element_rates={"layer_norm": 1e6})
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    ops = _captured_ops(model, lambda model, x: model(x).sum(), (torch.randn(4, 16),), hardware)
    norms = [op for op in ops if element_family(op.kind) == "layer_norm"]
    assert {op.kind for op in norms} == {"aten.native_layer_norm",
                                         "aten.native_layer_norm_backward"}
    for op in norms:
        assert op.time_s == pytest.approx(64 / 1e6 + hardware.op_overhead_s)


def test_gelus_backward_evaluates_two_transcendental_functions_per_element():
    measured = PROFILES["cpu"].with_(element_rates={"transcendental": 4e6})
    assert measured.elements_time_s("aten.gelu", 100) == pytest.approx(100 / 4e6)
    assert measured.elements_time_s("aten.gelu_backward", 100) == pytest.approx(200 / 4e6)
    assert measured.elements_time_s("aten.tanh_backward", 100) == 0.0  # 1 - y^2: arithmetic


def test_an_eager_kernels_family_falls_back_without_a_rate_and_inside_a_fused_kernel():
    """``_safe_softmax`` runs several passes as its own eager kernel, one in a fused one."""
    measured = PROFILES["cpu"].with_(element_rates={"safe_softmax": 1e6, "softmax": 2e6,
                                                    "transcendental": 4e6})
    assert measured.elements_time_s("aten._safe_softmax", 100) == pytest.approx(100 / 1e6)
    assert measured.elements_time_s("aten._safe_softmax", 100, fused=True) == pytest.approx(
        100 / 4e6)
    assert measured.elements_time_s("aten._softmax_backward_data", 100) == pytest.approx(
        100 / 2e6)
    transcendental_only = PROFILES["cpu"].with_(element_rates={"transcendental": 4e6})
    assert transcendental_only.elements_time_s("aten._safe_softmax", 100) == pytest.approx(
        100 / 4e6)
    dropout = PROFILES["cpu"].with_(element_rates={"dropout_backward": 1e6})
    assert dropout.elements_time_s("aten.native_dropout_backward", 100) == pytest.approx(1e-4)
    assert dropout.elements_time_s("aten.native_dropout_backward", 100, fused=True) == 0.0
    drawn = PROFILES["cpu"].with_(element_rates={"dropout": 1e6, "random": 4e6})
    assert drawn.elements_time_s("aten.native_dropout", 100) == pytest.approx(1e-4)
    random_only = PROFILES["cpu"].with_(element_rates={"random": 4e6})
    assert random_only.elements_time_s("aten.native_dropout", 100) == pytest.approx(100 / 4e6)


def test_softmax_rates_are_elements_over_the_times_of_their_passes(fixed_clock):
    elements = 1
    for size in cpu_probe.ATTENTION_SCORES_SHAPE:
        elements *= size
    assert cpu_probe.softmax_rates() == pytest.approx(
        {"softmax": 2 * elements / (2 * PROBE_S), "safe_softmax": elements / PROBE_S})
    assert len(fixed_clock) == 3  # softmax, its backward, _safe_softmax
    for operation in fixed_clock:
        assert operation().shape == cpu_probe.ATTENTION_SCORES_SHAPE


def test_matmuls_are_timed_on_operands_the_last_call_did_not_read(fixed_clock):
    cpu_probe.matmul_time_s((2, 8, 4, 8), torch.float32)
    (operation,) = fixed_clock
    first, second = operation(), operation()
    assert first.shape == second.shape == (2, 8, 8)
    assert not torch.equal(first, second)  # another pair of operands
    assert cpu_probe.matmul_time_s((1, 8, 4, 8), torch.float32) == PROBE_S
    assert fixed_clock[-1]().shape == (8, 8)


def test_the_op_overhead_is_timed_per_kernel_as_compiled_code_calls_a_layers_ops(fixed_clock):
    """``aot_eager``'s generated code calls ``torch.ops.aten.<op>.<overload>``, a Python call
    before the dispatcher that ``torch.add`` skips, and views between kernels, whose calls
    (``view_s`` each) are not the kernels' share."""
    view_s = 1e-5
    assert cpu_probe.op_overhead_s(view_s) == pytest.approx(
        (PROBE_S - cpu_probe.TINY_LAYER_VIEWS * view_s) / cpu_probe.TINY_LAYER_KERNELS)
    (operation,) = fixed_clock

    with _Recorded() as recorded:
        operation()
    assert sum(recorded.calls) == cpu_probe.TINY_LAYER_KERNELS
    assert len(recorded.calls) == cpu_probe.TINY_LAYER_KERNELS + cpu_probe.TINY_LAYER_VIEWS


def test_the_view_overhead_is_timed_on_calls_that_allocate_nothing(fixed_clock):
    assert cpu_probe.view_overhead_s() == PROBE_S
    assert len(fixed_clock) > 1
    with _Recorded() as recorded:
        for operation in fixed_clock:
            operation()
    assert recorded.calls == [False] * len(fixed_clock)


def test_the_cold_overhead_times_a_layer_right_after_an_op_that_streamed_the_cache(monkeypatch):
    """Each cold run follows an untimed add over more than a core's cache; the extra time per
    call is the cold runs' median less the warm one's."""
    befores: list = []

    def median_time_s(operation, repeats=cpu_probe.REPEATS, inner=1, before=None):
        befores.append(before)
        operation()
        return 5e-5 if before is None else 2e-4

    monkeypatch.setattr(cpu_probe, "median_time_s", median_time_s)
    calls = cpu_probe.TINY_LAYER_KERNELS + cpu_probe.TINY_LAYER_VIEWS
    assert cpu_probe.cold_overhead_s() == pytest.approx(1.5e-4 / calls)
    warm, cold = befores
    assert warm is None and cold().numel() * 4 == cpu_probe.ELEMENTWISE_BYTES


def test_the_time_before_each_timed_run_is_not_counted():
    clock = iter(range(100))
    ran: list = []
    original = cpu_probe.time.perf_counter
    cpu_probe.time.perf_counter = lambda: float(next(clock))
    try:
        assert cpu_probe.median_time_s(lambda: ran.append("op"), repeats=3,
                                       before=lambda: ran.append("before")) == 1.0
    finally:
        cpu_probe.time.perf_counter = original
    assert ran == ["op"] + ["before", "op"] * 3


def test_element_probes_read_other_operands_on_each_call(fixed_clock):
    """A step's memory-bound op reads what another op wrote a while before, not what the
    previous call of the probe left in a cache."""
    cpu_probe.element_rates()
    transcendental = fixed_clock[0]
    assert not torch.equal(transcendental(), transcendental())
    fixed_clock.clear()
    cpu_probe.softmax_rates()
    forward = fixed_clock[0]
    assert not torch.equal(forward(), forward())


class _Recorded(TorchDispatchMode):
    """Each op call: whether its first output is a storage it did not read (it allocates)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        read = {tensor.untyped_storage().data_ptr() for tensor in args
                if isinstance(tensor, torch.Tensor)}
        output = result[0] if isinstance(result, tuple) else result
        self.calls.append(output.untyped_storage().data_ptr() not in read)  # allocates
        return result


def test_a_swap_is_priced_as_memfits_swap_ops_run_a_steps_copies(monkeypatch):
    """The fixed time per copy is half a tiny round trip; each way's rate is its bytes over the
    time per copy beyond that, the copies of several activations timed together (each into new
    memory, alive together, as a step's swaps)."""
    size_bytes = 2**20
    count = cpu_probe.OPERAND_POOL_BYTES // size_bytes
    # tiny out, tiny back, every copy out, every copy back
    times = iter([1e-5, 2e-5, count * 5e-4, count * 6e-4])
    results = []

    def median_time_s(operation, repeats=cpu_probe.REPEATS, inner=1, before=None):
        results.append(operation())  # runs inside the probe's copy engine
        return next(times)

    monkeypatch.setattr(cpu_probe, "median_time_s", median_time_s)
    latency_s, out_rate, in_rate = cpu_probe.swap_costs(size_bytes)
    assert latency_s == pytest.approx(1.5e-5)
    assert out_rate == pytest.approx(size_bytes / (5e-4 - 1.5e-5))
    assert in_rate == pytest.approx(size_bytes / (6e-4 - 1.5e-5))
    tiny_out, tiny_back, outs, backs = results
    assert tiny_out.numel() == tiny_back.numel() == 1
    assert [copy.numel() for copy in outs] == [size_bytes // 4] * count  # alive together
    assert len({copy.data_ptr() for copy in outs}) == count
    assert [copy.numel() for copy in backs] == [size_bytes // 4] * count


def test_a_cpu_addmm_copies_its_bias_into_its_whole_output_before_the_multiply():
    """What ``Hardware.op_time_s`` prices for ``BIAS_FIRST`` on a CPU: PyTorch's CPU ``addmm``
    runs a ``copy_`` of the output's size under it."""
    rows, inner, columns = 64, 32, 48
    bias, left, right = torch.randn(columns), torch.randn(rows, inner), torch.randn(inner, columns)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as profile:
        torch.ops.aten.addmm.default(bias, left, right)
    copies = [event for event in profile.events() if event.name == "aten::copy_"
              and event.cpu_parent is not None and event.cpu_parent.name == "aten::addmm"]
    assert [event.input_shapes[0] for event in copies] == [[rows, columns]]


def test_the_compiled_softmax_rate_times_attentions_masked_softmax(fixed_clock, monkeypatch):
    elements = torch.Size(cpu_probe.ATTENTION_SCORES_SHAPE).numel()
    monkeypatch.setattr(cpu_probe, "_compiled_masked_softmax", lambda: cpu_probe._masked_softmax)
    assert cpu_probe.compiled_softmax_rates() == {"compiled_softmax": elements / PROBE_S}
    (operation,) = fixed_clock
    probabilities = operation()
    assert probabilities.shape == cpu_probe.ATTENTION_SCORES_SHAPE
    keys = cpu_probe.ATTENTION_SCORES_SHAPE[-1]
    assert torch.all(probabilities[..., keys * 3 // 4:] == 0)  # the padding
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))


def test_no_compiled_softmax_rate_where_inductor_cannot_compile(monkeypatch):
    def failing(*arguments):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_probe, "_compiled_masked_softmax", lambda: failing)
    assert cpu_probe.compiled_softmax_rates() == {}
