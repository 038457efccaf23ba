"""memfit.fit beside what a user would pick instead, in a user's own loop (issue 12's table).

Every method trains a fresh copy of the same weights on the same batch with the same seed, one
whole iteration each (forward, ``loss.backward()``, AdamW ``step``, ``zero_grad``): the peak is
the iteration's, optimizer state included, measured by the allocator's own statistics
(``measure_allocator_peak``: the profiler's CPU-allocator events above the resident parameters,
optimizer state and batch), since a dispatch mode would disable compiled code. Budgets are
fractions of eager's measured peak, or checkpointing's measured peak. Checkpointing every block
is what a user writes: GPT-2's ``gradient_checkpointing_enable`` (a transformer block),
``torch.utils.checkpoint`` around each ResNet bottleneck layer (16) and around each MONAI
``ResidualUnit`` (4 down, 3 up) and up-sampling ``Convolution`` (3) of the U-Net, non-reentrant. Weights are
compared with eager's, and for memfit with ``compiler="inductor"`` with
``torch.compile(backend="inductor")``'s, the step it reproduces: bitwise (``torch.equal``),
"allclose" (within ``torch.testing.assert_close``'s float32 defaults, rtol 1.3e-6, atol 1e-5,
as torch's inductor tests use), or the largest difference. Times are medians of interleaved
runs after warm-ups that compile, plan and finish memfit's measured runs.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass

import torch

import memfit
from bench.common import interleaved_medians_s, mib, ms
from bench.recompute_methods import SINGLE_THREAD_NOTE, block_paths, wrap_blocks
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

TIMED_REPEATS = 5  # interleaved timed iterations per method; the median is reported
# weights are compared after every iteration each method ran: two measured, one more, the timed
FIT_HEADERS = ("model", "method", "iteration peak", "vs eager", "step time", "vs eager",
               f"weights after {3 + TIMED_REPEATS} steps")
COMPILERS = ("aot_eager", "inductor")
FRACTIONS = (0.5, 0.3)  # memfit auto's budgets, of eager's measured peak
EAGER = "eager"
CHECKPOINT = "torch.utils.checkpoint, every block"
# Every compiled method of a model adds a Dynamo cache entry to the same code objects (one per
# torch.compile call: its backend differs). A torch._dynamo.reset() between builds would drop the
# earlier methods' entries, so each would compile (and memfit plan, and measure) again inside
# the timed iterations; past Dynamo's default limit of 8 entries, the rest would run eagerly.
RECOMPILE_LIMIT = 64
# torch.testing.assert_close's float32 defaults, the tolerance torch's inductor tests use
RTOL, ATOL = 1.3e-6, 1e-5


def compiled_name(compiler: str) -> str:
    return f'torch.compile(backend="{compiler}")'


def own_backend(compiler: str) -> Callable:
    """torch's backend ``compiler`` as a callable of its own. Dynamo reuses a compiled graph for
    another copy of the model when the backend is the same callable and no guard fails (it does
    not guard on ``activation_memory_budget``): a second ``torch.compile(backend="aot_eager")``
    would run the first one's graph."""
    return functools.partial(torch._dynamo.lookup_backend(compiler))


@dataclass
class Method:
    """One way to train: ``build()`` gives (model, one iteration, optimizer); its weights after
    the measured iterations are compared with those of the method named ``reference``."""

    name: str
    build: Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer]]
    reference: str = EAGER


@dataclass(frozen=True)
class FitModel:
    """A model at its bench size and what a user checkpoints as "a block" of it: transformers'
    own switch where the model has one, else ``torch.utils.checkpoint`` around each module whose
    class is in ``block_types`` (outermost matches, as bench/recompute_methods.py wraps them)."""

    build: Callable[[], examples.Example]  # picklable (a function or a partial): see isolated_rows
    block_types: tuple[str, ...] = ()
    name: str = ""  # the rows' model name where the model could not even be built


FIT_MODELS = (
    FitModel(functools.partial(examples.gpt2, layers=4, width=128, heads=4, vocab=256,
                               sequence=256, batch_size=8), name="gpt2"),
    FitModel(functools.partial(examples.resnet50_shaped, batch_size=16),
             ("ResNetBottleNeckLayer",), name="resnet50"),
    FitModel(examples.unet3d, ("ResidualUnit", "Convolution"), name="unet3d"),
)


def _loop(model: torch.nn.Module, loss_fn: Callable, inputs: tuple,
          optimizer: torch.optim.Optimizer, budget_patch: float | None = None):
    def iteration() -> torch.Tensor:
        torch.manual_seed(0)
        if budget_patch is None:
            loss = loss_fn(model, *inputs)
            loss.backward()
        else:
            with torch._functorch.config.patch(activation_memory_budget=budget_patch):
                loss = loss_fn(model, *inputs)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # a copy: a CPU mse_loss's 0-dim loss is a view of its input-sized elementwise buffer,
        # which the returned detach() would keep alive through the next iteration, on the device
        # but unseen by measure_allocator_peak (allocated before its profile started)
        return loss.detach().clone()

    return iteration


def _builder(example: examples.Example, inputs: tuple, wrap=None, patch=None,
             block_types: tuple[str, ...] | None = None):
    """A fresh copy of the example's model and an AdamW on it, run through ``wrap``; with
    ``block_types``, checkpointed every block (``_checkpoint_every_block``)."""

    def build():
        model = copy.deepcopy(example.model)
        if block_types is not None:
            _checkpoint_every_block(model, block_types)
        optimizer = torch.optim.AdamW(model.parameters())
        runner = wrap(model, optimizer) if wrap else model
        return model, _loop(runner, example.loss_fn, inputs, optimizer, patch), optimizer

    return build


def _checkpoint_every_block(model: torch.nn.Module, block_types: tuple[str, ...]) -> None:
    """What a user writes: transformers' ``gradient_checkpointing_enable`` where the model has
    it, else ``torch.utils.checkpoint`` (non-reentrant) around each block, in place."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    if not block_types:
        raise ValueError(f"{type(model).__name__} has no gradient checkpointing switch: name its "
                         "block classes in FitModel.block_types")
    wrap_blocks(model, block_paths(model, block_types))


def _baselines(example: examples.Example, inputs: tuple, bench: FitModel) -> list[Method]:
    """Eager and checkpointing every block: the peaks memfit's budgets are taken from."""
    return [Method(EAGER, _builder(example, inputs)),
            Method(CHECKPOINT, _builder(example, inputs, block_types=bench.block_types))]


def _compiled_methods(example: examples.Example, inputs: tuple, eager_peak: int,
                      checkpoint_peak: int) -> list[Method]:
    """torch.compile with each compiler, torch's own budget, and memfit with each compiler; an
    inductor memfit row is compared with torch.compile(inductor), the step it reproduces."""
    methods = [Method(compiled_name(compiler), _builder(
        example, inputs, lambda m, o, c=compiler: torch.compile(m, backend=own_backend(c))))
        for compiler in COMPILERS]
    methods.append(Method("torch.compile aot_eager, activation_memory_budget 0.5", _builder(
        example, inputs, lambda m, o: torch.compile(m, backend=own_backend("aot_eager")),
        patch=0.5)))
    for compiler in COMPILERS:
        reference = EAGER if compiler == "aot_eager" else compiled_name(compiler)

        def planned(name: str, compiler=compiler, reference=reference, **options) -> Method:
            return Method(f"memfit.fit {name} ({compiler})", _builder(
                example, inputs, lambda m, o: memfit.fit(m, compiler=compiler, optimizer=o,
                                                         **options)), reference)

        methods.append(planned("keep", strategy="keep"))
        methods += [planned(f"auto, {fraction:g} of eager", budget=int(fraction * eager_peak))
                    for fraction in FRACTIONS]
        methods.append(planned("auto at checkpointing's peak", budget=checkpoint_peak))
    return methods


@dataclass
class Measured:
    """A method after its measured iterations: its model and timed iteration, or why it could
    not run."""

    method: Method
    model: torch.nn.Module | None = None
    peak_bytes: int | None = None
    run: Callable[[], torch.Tensor] | None = None
    refused: str = ""


def _measure(method: Method, inputs: tuple) -> Measured:
    """Two measured iterations (the first compiles and plans; both must fit), then one more
    unmeasured, so that no timed iteration is one memfit still measures (``measure_runs``)."""
    try:
        model, run, optimizer = method.build()
        peaks = []
        for _ in range(2):
            # the model's buffers too (batch norms' running statistics): device bytes that were
            # allocated before the measurement started, as its parameters were
            measured = measure_allocator_peak(run, track=(
                list(model.parameters()), list(model.buffers()), optimizer.state, inputs))
            peaks.append(measured.peak_bytes)
    except memfit.BudgetError as error:
        return Measured(method, refused=f"does not fit: smallest {mib(error.minimum_bytes)}")
    run()
    return Measured(method, model, max(peaks), run)


def weights_verdict(model: torch.nn.Module, reference: torch.nn.Module, name: str) -> str:
    """How ``model``'s parameters compare with ``reference``'s: bitwise, within torch's
    inductor-test tolerance, or the largest difference."""
    return _verdict(list(model.parameters()), list(reference.parameters()), name)


def _verdict(values: list[torch.Tensor], reference: list[torch.Tensor], name: str) -> str:
    pairs = list(zip(values, reference, strict=True))
    if all(torch.equal(a, b) for a, b in pairs):
        return f"bitwise {name}'s"
    if all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in pairs):
        return f"allclose {name}'s"
    largest = max(float((a - b).detach().abs().max()) for a, b in pairs)
    return f"differ from {name}'s (up to {largest:.1e})"


def first_step_gradients(method: Method) -> list[torch.Tensor]:
    """The gradients a fresh build of ``method`` hands its optimizer at its first iteration (an
    unmeasured run: the copies would count in a measured peak)."""
    model, run, optimizer = method.build()
    gradients: list[torch.Tensor] = []

    def snapshot(*_: object) -> None:
        if not gradients:
            gradients.extend(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                             for p in model.parameters())

    handle = optimizer.register_step_pre_hook(snapshot)
    run()
    handle.remove()
    return gradients


def gradients_verdict(method: Method, reference: list[torch.Tensor], name: str) -> str:
    """How ``method``'s first-step gradients compare with ``reference`` (``name``'s, in
    ``weights_verdict``'s terms): where weights differ after several AdamW steps, whether the
    gradients already did. AdamW moves a weight by about its learning rate whatever its
    gradient's size, so a gradient near zero that rounds differently moves it by up to that
    much."""
    return _verdict(first_step_gradients(method), reference, name)


def fit_rows(bench: FitModel, log) -> list[tuple]:
    """One row per method for ``bench``'s model, in one process."""
    example = bench.build()
    torch._dynamo.reset()  # once per model: see RECOMPILE_LIMIT
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        results = _measure_all(example, bench, log)
        times = _timed(results, log)
    eager_peak = results[EAGER].peak_bytes
    assert eager_peak is not None
    rows = []
    for name, result in results.items():
        if result.model is None or result.peak_bytes is None:
            rows.append((example.name, name, "-", "-", "-", "-", result.refused))
            continue
        reference = results[result.method.reference].model
        assert reference is not None
        weights = weights_verdict(result.model, reference, result.method.reference)
        rows.append((example.name, name, mib(result.peak_bytes),
                     f"{result.peak_bytes / eager_peak:.2f}x", ms(times[name]),
                     f"{times[name] / times[EAGER]:.2f}x", weights))
    return rows


def _measure_all(example: examples.Example, bench: FitModel, log) -> dict[str, Measured]:
    """Every method measured in turn: eager and checkpointing first, whose peaks set the
    budgets of the rest."""
    inputs = example.inputs()
    results: dict[str, Measured] = {}
    for method in _baselines(example, inputs, bench):
        log(f"fit bench: {example.name}: {method.name}")
        results[method.name] = _measure(method, inputs)
    eager_peak, checkpoint_peak = (results[name].peak_bytes for name in (EAGER, CHECKPOINT))
    assert eager_peak is not None and checkpoint_peak is not None  # eager code has no budget
    for method in _compiled_methods(example, inputs, eager_peak, checkpoint_peak):
        log(f"fit bench: {example.name}: {method.name}")
        results[method.name] = _measure(method, inputs)
    return results


def _timed(results: dict[str, Measured], log, repeats: int = TIMED_REPEATS) -> dict[str, float]:
    """Median seconds per iteration of each method that ran, interleaved (``repeats`` rounds);
    says so if Dynamo compiled anything while they were timed (then a time includes a
    compile)."""
    from torch._dynamo.utils import counters

    runs: dict[str, Callable[[], object]] = {
        name: r.run for name, r in results.items() if r.run is not None}
    graphs = counters["stats"]["unique_graphs"]
    medians = interleaved_medians_s(list(runs.values()), repeats=repeats)
    if counters["stats"]["unique_graphs"] != graphs:
        log(f"fit bench: {counters['stats']['unique_graphs'] - graphs} graphs compiled while "
            "timed: their methods' times include compiling")
    return dict(zip(runs, medians, strict=True))


def _rows_on_one_thread(bench: FitModel) -> list[tuple]:
    """``fit_rows`` on one intra-op thread (see SINGLE_THREAD_NOTE), deterministic algorithms on
    (as ``bench.run`` sets them for its own process), logging to stderr."""
    from bench.run import log

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return fit_rows(bench, log)


def isolated_rows(bench: FitModel | None, rows_of: Callable[..., list[tuple]] | None = None,
                  width: int = len(FIT_HEADERS)) -> list[tuple]:
    """``rows_of(bench)``'s rows (default: this section's, ``_rows_on_one_thread``) from a child
    process of their own, or one row of ``width`` cells saying how it died.

    Why: a compiled kernel that corrupts memory aborts the whole process (on an AVX-512 CPU,
    torch 2.13's ``torch.compile(backend="inductor")`` of the bench's MONAI U-Net did, in its first
    forward, without memfit), and the other models' rows, written at the end, were lost with it.
    """
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(rows_of or _rows_on_one_thread, bench).result()
        except concurrent.futures.process.BrokenProcessPool as error:
            name = bench.name if bench is not None else "-"
            return [(name, "(every method)", *("-" for _ in range(width - 3)),
                     f"the bench's process died: {error}")]


def fit_section(log) -> str:
    """The Markdown section: GPT-2, ResNet-50-shaped and the 3D U-Net, each in its own process
    on one intra-op thread."""
    rows = []
    for bench in FIT_MODELS:
        log(f"fit bench: {bench.name} in a child process")
        rows.extend(isolated_rows(bench))
    return "\n".join([
        "## memfit.fit in a training loop beside the alternatives (CPU)\n",
        __doc__.split("\n\n", 1)[1].strip() + "\n",
        SINGLE_THREAD_NOTE + "\n",
        "Command: `python -m bench.run --only fit`. Goals (issue 12): `keep` within 1.05x of "
        "`torch.compile` with the same compiler; at checkpointing's peak, memfit faster than "
        "checkpointing.\n",
        "| " + " | ".join(FIT_HEADERS) + " |",
        "|" + "|".join("---" for _ in FIT_HEADERS) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ])
