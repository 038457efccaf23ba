"""memfit.fit(compiler="inductor"): inductor's own results and fused kernels, within the budget.

The reference is ``torch.compile(model)`` (inductor, its min-cut partitioner, no budget); memfit
replaces only the partitioner, so the step is that reference's bit for bit where nothing is
recomputed. Inductor compiles C++ on the CPU: the models are tiny and each test compiles twice.
The optimizer is handed to ``memfit.fit``, so its state is in the budget from the first step on.

Note:
    The reference's min-cut partitioner itself re-runs cheap ops (normalisations, activations)
    in its backward, where memfit's partition saves or swaps them; inductor then fuses the two
    backward modules differently, so the comparison is within the float32 tolerance torch's own
    inductor tests use (``torch.testing.assert_close`` defaults: rtol 1.3e-6, atol 1e-5), not
    bitwise.

    memfit predicts the program it planned, every op's output a buffer; inductor's fused
    kernels keep fewer, so with the plan's order pinned (``memfit.lowering.inductor``) the
    prediction bounds the measured peak, 9% to 18% above it here (the CNN with re-runs:
    4,673,796 B measured, 5,524,260 B predicted; GPT-2: 5,518,456 B and 6,030,456 B).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest
import torch
from torch import nn

import memfit
from memfit.runtime.measure import measure_allocator_peak

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                       reason="inductor needs a C++ compiler on the CPU (install g++)"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cnn(blocks: int, width: int = 16) -> nn.Module:
    """``blocks`` of convolution, batch norm and ReLU, then a linear classifier.

    The convolutions have no bias, as in a ResNet: a bias right before batch norm has a gradient
    that is zero but for rounding, and AdamW turns two runs' different rounding noise into
    updates that differ by up to its learning rate (measured: 2.6e-3 on the first conv's bias
    after two steps with re-runs, every other parameter within 1.6e-7).
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for block in range(blocks):
        layers += [nn.Conv2d(width if block else 3, width, 3, padding=1, bias=False),
                   nn.BatchNorm2d(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def cnn_case(blocks: int = 3, width: int = 16):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 32, 32, generator=generator),
             torch.randint(0, 10, (16,), generator=generator)) for _ in range(2)]
    return (lambda: cnn(blocks, width)), lambda model, x, y: nn.functional.cross_entropy(model(x), y), data


def gpt2_case():
    from memfit.examples import gpt2

    example = gpt2(layers=2, dropout=0.0)  # no random draws: both runs compute the same thing

    def build():
        return gpt2(layers=2, dropout=0.0).model

    data = [example.make_inputs(example.batch_size) for _ in range(2)]
    return build, example.loss_fn, data


def bert_case():
    from memfit.examples import bert

    def build():
        return bert(layers=2, width=64, heads=2, vocab=128, sequence=128).model

    example = bert(layers=2, width=64, heads=2, vocab=128, sequence=128)
    data = [example.make_inputs(8), example.make_inputs(8)]
    return build, example.loss_fn, data


def train(model, loss_fn, data, optimizer=None):
    """Two AdamW steps as a user writes them: losses, allocator peaks, seconds per step (the first
    compiles), and the code inductor generated."""
    from torch._inductor.utils import run_and_get_code

    optimizer = optimizer or torch.optim.AdamW(model.parameters())
    losses, peaks, times_s = [], [], []
    code: list[str] = []
    for inputs in data:
        def step(inputs=inputs):
            loss = loss_fn(model, *inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        def measured_step(step=step, inputs=inputs):
            resident = (list(model.parameters()), list(model.buffers()), optimizer.state, inputs)
            return measure_allocator_peak(step, track=resident)

        started = time.perf_counter()
        if not code:  # it resets Dynamo first: only the step that compiles anyway
            measured, code = run_and_get_code(measured_step)
        else:
            measured = measured_step()
        times_s.append(time.perf_counter() - started)
        losses.append(measured.result)
        peaks.append(measured.peak_bytes)
    return losses, peaks, times_s, "\n".join(code)


def assert_trained_as(model, losses, reference, reference_losses) -> None:
    """The losses, parameters and buffers of ``model``'s run are ``reference``'s within
    ``torch.testing.assert_close``'s float32 defaults."""
    for loss, expected in zip(losses, reference_losses, strict=True):
        torch.testing.assert_close(loss, expected)
    for (name, value), expected in zip([*model.named_parameters(), *model.named_buffers()],
                                       [*reference.parameters(), *reference.buffers()],
                                       strict=True):
        torch.testing.assert_close(value, expected, msg=name)


def kernels(code: str) -> int:
    """Inductor's fused C++ kernels in generated code (``cpp_fused_*`` definitions)."""
    return len(re.findall(r"^cpp_fused_\w+ = ", code, flags=re.MULTILINE))


def run_case(case, budget_fraction: float, strategy: str, optimizer_type=torch.optim.AdamW):
    build, loss_fn, data = case()
    eager = build()
    _, eager_peaks, _, _ = train(eager, loss_fn, data, optimizer_type(eager.parameters()))
    reference = build()
    reference_run = train(torch.compile(reference), loss_fn, data,
                          optimizer_type(reference.parameters()))
    model = build()
    budget = int(budget_fraction * max(eager_peaks))
    optimizer = optimizer_type(model.parameters())
    fitted = memfit.fit(model, budget=budget, strategy=strategy, compiler="inductor",
                        optimizer=optimizer)
    run = train(fitted, loss_fn, data, optimizer)
    predicted = max(region.predicted_peak_bytes for region in fitted._memfit_backend.regions)
    print(f"peaks: eager {max(eager_peaks)}, torch.compile {max(reference_run[1])}, "
          f"memfit {max(run[1])} (predicted {predicted}), budget {budget}; first step s (compiles): "
          f"torch.compile {reference_run[2][0]:.1f}, memfit {run[2][0]:.1f}; second step s: "
          f"torch.compile {reference_run[2][1]:.4f}, memfit {run[2][1]:.4f}; kernels: "
          f"torch.compile {kernels(reference_run[3])}, memfit {kernels(run[3])}")
    print(memfit.report(fitted))
    return model, reference, fitted, budget, run, reference_run


FUSED_SMALL_OUTPUTS_BYTES = 4096


def check(case, budget_fraction: float, strategy: str, optimizer_type=torch.optim.AdamW) -> None:
    model, reference, fitted, budget, run, reference_run = run_case(case, budget_fraction,
                                                                   strategy, optimizer_type)
    losses, peaks, _, code = run
    # close, not equal: the min-cut reference re-runs other ops, see Note
    assert_trained_as(model, losses, reference, reference_run[0])
    assert max(peaks) <= budget, (peaks, budget)
    regions = fitted._memfit_backend.regions
    # the plan's prediction bounds what inductor's kernels hold (see the Note), but for the
    # small outputs of a fused kernel, which inductor allocates together at the kernel's start,
    # ahead of the op order memfit prices (the 3-block CNN: 776 B of per-channel sums at 5.72 MB)
    predicted = max(region.predicted_peak_bytes for region in regions)
    assert max(peaks) <= predicted + FUSED_SMALL_OUTPUTS_BYTES, (peaks, predicted)
    assert any(region.plan.swapped or region.plan.reruns or region.plan.recomputed
               for region in regions)
    assert kernels(code) > 0  # inductor's fused kernels are still there
    swapped = any(region.plan.swapped for region in regions)
    assert ("torch.ops.memfit.swap_out" in code) == swapped


def sgd(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01)


def test_auto_at_half_the_eager_peak_holds_the_budget_on_a_cnn():
    # six blocks: with three, the convolutions' backward scratch buffers alone put every plan's
    # smallest peak at 0.63 of eager's. SGD, not AdamW: on one thread plain torch.compile's
    # first gradients already differ from eager's by up to 0.7% of a tensor's largest (six batch
    # norms' backward cancel), and auto's plan here (fused chains: the batch norms re-run in
    # the backward's kernels) rounds them differently again (1.7e-8 apart); AdamW moves every
    # weight by about its learning rate whatever its gradient's size, which took that to 3.6e-5
    # in the weights after two steps, past float32's tolerance, where SGD keeps it at lr x 1e-8
    check(lambda: cnn_case(blocks=6), 0.5, "auto", sgd)


def test_reruns_of_a_cnn_keep_their_planned_order_under_inductor():
    # without memfit.lowering.inductor.pin_planned_order inductor fused the re-runs of the first
    # block with each other and hoisted every re-run chain to the start of the backward:
    # measured 9,937,692 B against a 6,061,829 B budget. With a chain pinned on the last op
    # before it only, inductor fused the batch norm's input gradient before it into the chain,
    # after its convolution: 6,770,348 B at 6,074,149 (predicted 5,722,532); 5,723,308 B now
    # that a chain waits for the ops before it that free large tensors
    check(cnn_case, 0.7, "optimal-recompute")


def test_auto_on_gpt2_holds_the_budget_with_adamw_state_counted():
    # 0.6, not 0.5: with AdamW's state in the budget, memfit refuses 0.5 with a BudgetError,
    # auto's smallest peak being 5.75 MiB, 0.57 of eager's measured 10,582,952 B
    check(gpt2_case, 0.6, "auto")



def test_vdnn_prefetches_and_host_copies_hold_the_budget_on_gpt2():
    """vDNN's plan for a 4-layer GPT-2 brings tensors back in a row and swaps attention values
    that inductor lays out unlike the graph. Before ``memfit.lowering.inductor`` anchored swap-ins
    on readers of any earlier one, inductor ran them all at the backward's start, and before
    host copies took the saved layout, it saved a device copy of each such host copy: measured
    193.57 MiB at a 71.11 MiB budget (69.82 predicted); 70.95 MiB with both."""
    from memfit.examples import gpt2

    torch.manual_seed(0)
    example = gpt2(layers=4, width=128, heads=4, vocab=256, sequence=256, batch_size=8)
    data = [example.inputs()]
    _, eager_peaks, _, _ = train(example.model, example.loss_fn, data)
    model = gpt2(layers=4, width=128, heads=4, vocab=256, sequence=256, batch_size=8).model
    budget = int(0.31 * max(eager_peaks))  # vdnn_dyn cannot go below 0.303
    optimizer = torch.optim.AdamW(model.parameters())
    fitted = memfit.fit(model, budget=budget, strategy="vdnn_dyn", compiler="inductor",
                        optimizer=optimizer)
    _, peaks, _, code = train(fitted, example.loss_fn, data * 2, optimizer)
    assert max(peaks) <= budget, (peaks, budget)
    assert "torch.ops.memfit.swap_in" in code


def test_swapped_in_channels_last_activations_are_not_copied_again_on_the_device():
    # at width 32 inductor lays a convolution's output out channels last, and the traced
    # swap-in's strides were the graph's: inductor copied every swapped-in value into them, on
    # the device, where the pin wraps the swap-in, a second copy alive beside the first
    # (11,456,256 B measured at an 11,017,566 B budget, 9,360,632 B predicted)
    # (weights are not compared: AdamW's first steps turn the rounding of near-zero gradients
    # that differ between the two programs' fused reductions into updates of its learning rate)
    _, _, fitted, budget, run, reference_run = run_case(lambda: cnn_case(blocks=4, width=32), 0.51,
                                                        "auto")
    losses, peaks, _, code = run
    torch.testing.assert_close(losses[0], reference_run[0][0])
    predicted = max(region.predicted_peak_bytes for region in fitted._memfit_backend.regions)
    assert "torch.ops.memfit.swap_in" in code
    assert max(peaks) <= min(budget, predicted + FUSED_SMALL_OUTPUTS_BYTES), (peaks, predicted)


def test_vdnn_swaps_of_attention_values_hold_their_prediction_on_bert():
    """vDNN's plan for BERT at length 128 swaps every attention value and layer input. Inductor
    held each swapped-in copy until its ``memfit::wait``, which it placed after a fused kernel
    that pulled the copy's readers ahead of it, and kept freed buffers alive until it reused
    them: 6,966,860 B measured against 5,772,944 B predicted, before memfit priced inductor's
    inlining (the same plan at a symbolic length measured 1 MiB more before its host copies took
    the traced layout); the plan priced with inlining measures within 400 B of its prediction."""
    check(bert_case, 0.58, "vdnn_dyn")


class _Spectral(nn.Module):
    """A Fourier neural operator's layer: the lowest modes of the field's 2D FFT mixed by
    complex weights, the rest zeroed, back by the inverse FFT, beside a 1x1 convolution."""

    def __init__(self, channels: int = 16, modes: int = 8) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(
            torch.randn(channels, channels, modes, modes, dtype=torch.cfloat) / channels)
        self.pointwise = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft2(x)
        mixed = torch.zeros_like(spectrum)
        mixed[:, :, :self.modes, :self.modes] = torch.einsum(
            "bixy,ioxy->boxy", spectrum[:, :, :self.modes, :self.modes], self.weight)
        return nn.functional.gelu(torch.fft.irfft2(mixed, s=x.shape[-2:]) + self.pointwise(x))


def fourier_case():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 16, 1), *(_Spectral() for _ in range(3)),
                             nn.Conv2d(16, 1, 1))

    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 1, 48, 48, generator=generator),
             torch.randn(16, 1, 48, 48, generator=generator)) for _ in range(2)]
    return build, lambda model, x, y: nn.functional.mse_loss(model(x), y), data


def test_complex_valued_ops_run_as_eager_kernels_are_priced_so_under_inductor():
    """Inductor generates no code for an op on complex tensors: the spectral layers' zeroed
    spectrum, its slice written and its copy are eager's kernels, each its own buffer. Priced
    as library calls, the plan's prediction bounds the measured peak and holds the budget;
    before, priced as fused kernels writing in place, region 0 measured 25.93 MiB against a
    19.95 MiB prediction and a 22.76 MiB budget, said at every iteration."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.BudgetWarning)
        warnings.filterwarnings("ignore", "Torchinductor does not support code generation")
        model, reference, fitted, budget, run, reference_run = run_case(fourier_case, 0.85,
                                                                       "auto")
    losses, peaks, _, _ = run
    assert_trained_as(model, losses, reference, reference_run[0])
    assert max(peaks) <= budget, (peaks, budget)
    predicted = max(region.predicted_peak_bytes for region in fitted._memfit_backend.regions)
    assert max(peaks) <= predicted + FUSED_SMALL_OUTPUTS_BYTES, (peaks, predicted)
