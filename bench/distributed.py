"""Two ranks on gloo (CPU): FSDP2 and DDP, eager, per-block checkpointing and memfit (issue 14).

Each model trains on 2 processes (``torch.multiprocessing``, a ``FileStore``, gloo), each rank
on its own batch (the example's batch rolled by the rank), one intra-op thread per rank. In one
launch, every way of training runs in turn on a fresh copy of the same weights, with AdamW:

- FSDP2: ``fully_shard`` on each block (GPT-2's transformer blocks, the U-Net's outer stages),
  then on the root, eager;
- the same with ``torch.utils.checkpoint`` (non-reentrant) around each block, as torchtitan's
  per-block activation checkpointing (GPT-2's transformer blocks; the U-Net's ``ResidualUnit``
  and up-sampling ``Convolution`` modules), applied before ``fully_shard``;
- the same FSDP2 model under ``memfit.fit`` (``auto``) at a per-rank budget equal to
  checkpointing's measured peak (the larger of the two ranks'), and at half of eager's;
- DDP rows the same way (eager, checkpointing, memfit at checkpointing's peak).

Peaks are measured per rank over whole iterations (forward, backward, ``optimizer.step``,
``zero_grad``) by ``measure_allocator_peak`` above the resident parameters, optimizer state and
batch, DTensors counted by their local shard, plus DDP's gradient buckets, as
``tests/test_distributed.py`` measures them. Where no plan fits a budget, every rank raises
``BudgetError`` and the way runs again at the smallest peak the error names (the row says so).
Step times are taken after every way is set up and measured, in rounds of one step per way.

Run: ``python -m bench.distributed`` (prints), or ``python -m bench.run --only distributed``
(writes its section of ``bench/RESULTS.md``).
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import memfit
from bench.fit import RECOMPILE_LIMIT
from bench.recompute_methods import block_paths, wrap_blocks
from memfit import examples
from memfit.data.tables import table
from memfit.data.units import format_bytes

WORLD_SIZE = 2
WARMUP_STEPS = 4  # neither measured nor timed: memfit compiles and plans in the first, plans
# the regions between FSDP2's / DDP's hooks again jointly after it (up to 2 rounds), and
# profiles the first 2 runs after each plan (a GPT-2 DDP step took 15.4 s in the 4th iteration,
# 1.1 s after, with 1 warm-up)
MEASURED_STEPS = 2  # iterations whose peak is measured (the larger is reported)
TIMED_STEPS = 3  # iterations timed without the profiler (the median is reported)
ATTEMPTS = 3  # budgets tried per memfit way: the asked one, then the smallest peak refused
WAY_TIMEOUT_S = int(os.environ.get("MEMFIT_RANK_TIMEOUT_S", 240))  # per way's set-up and per
# timed round, on each rank: a rank stuck in a collective longer than this dumps its stack and exits, and the launch is retried
LAUNCHES = 2  # the 2-rank runs hang intermittently under load: one retry


@dataclass(frozen=True)
class Way:
    """One way of training on every rank: the engine, checkpointing, and memfit's budget as a
    fraction of an earlier way's measured peak (``budget_of``; None: no memfit)."""

    label: str
    engine: str  # "fsdp" or "ddp"
    checkpointed: bool = False
    budget_of: str | None = None
    budget_fraction: float = 1.0


FSDP, FSDP_CHECKPOINT = "FSDP2", "FSDP2 + checkpoint per block"
DDP, DDP_CHECKPOINT = "DDP", "DDP + checkpoint per block"
WAYS = (
    Way(FSDP, "fsdp"),
    Way(FSDP_CHECKPOINT, "fsdp", checkpointed=True),
    Way("FSDP2 + memfit auto at checkpointing's peak", "fsdp", budget_of=FSDP_CHECKPOINT),
    Way("FSDP2 + memfit auto at 0.5 x FSDP2's peak", "fsdp", budget_of=FSDP,
        budget_fraction=0.5),
    Way(DDP, "ddp"),
    Way(DDP_CHECKPOINT, "ddp", checkpointed=True),
    Way("DDP + memfit auto at checkpointing's peak", "ddp", budget_of=DDP_CHECKPOINT),
)


@dataclass(frozen=True)
class DistModel:
    """A model of ``memfit.examples`` (``kind``, its builder's keyword arguments), the module
    class names checkpointed as blocks, and how the table names it."""

    name: str
    kind: str  # "gpt2" or "unet3d"
    options: tuple[tuple[str, object], ...]
    checkpoint_types: tuple[str, ...]

    def build(self) -> examples.Example:
        return getattr(examples, self.kind)(**dict(self.options))


DIST_MODELS = (
    DistModel("GPT-2 (4 layers, width 128, sequence 256), batch 4 per rank", "gpt2",
              (("layers", 4), ("width", 128), ("heads", 4), ("vocab", 256), ("sequence", 256),
               ("batch_size", 4)), ("GPT2Block",)),
    DistModel("MONAI 3D U-Net (channels 4-32, 32^3), batch 2 per rank", "unet3d", (),
              ("ResidualUnit", "Convolution")),
)


@dataclass
class RankResult:
    """One way on one rank: losses of every iteration, measured peaks, timed steps."""

    losses: list[torch.Tensor] = field(default_factory=list)
    peaks_bytes: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    budget_bytes: int | None = None
    refused_bytes: list[int] = field(default_factory=list)  # budgets no plan fitted
    wall_s: float = 0.0  # building, compiling, planning, the warm-up and measured iterations


def fsdp_blocks(kind: str, model: torch.nn.Module) -> list[torch.nn.Module]:
    """What ``fully_shard`` wraps one by one before the root: GPT-2's transformer blocks, the
    U-Net's outer stages (the first down stage, the skip connection holding the rest, the last
    up stage)."""
    if kind == "gpt2":
        return list(model.get_submodule("transformer.h").children())
    return list(model.get_submodule("model").children())


def _distribute(kind: str, engine: str, model: torch.nn.Module) -> torch.nn.Module:
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in fsdp_blocks(kind, model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # in place: the model's class becomes an FSDPModule
    return model


def _prepared(bench: DistModel, example: examples.Example, way: Way):
    """A fresh copy of the weights, checkpointed per block where ``way`` says, distributed."""
    model = copy.deepcopy(example.model)
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False  # as under gradient checkpointing, in every way alike
    if way.checkpointed:
        wrap_blocks(model, block_paths(model, bench.checkpoint_types))
    return _distribute(bench.kind, way.engine, model)


def _iteration(loss_fn: Callable, runner: torch.nn.Module, inputs: tuple,
               optimizer: torch.optim.Optimizer, index: int) -> torch.Tensor:
    torch.manual_seed(100 + index)
    loss = loss_fn(runner, *inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().clone()  # a copy: a CPU mse_loss's 0-dim loss views a batch-sized buffer


@dataclass
class Running:
    """A way set up on this rank and past its measured iterations, ready for timed steps."""

    example: examples.Example
    inputs: tuple
    runner: torch.nn.Module  # the distributed model, or memfit's fitted module over it
    optimizer: torch.optim.Optimizer
    result: RankResult

    def step(self, index: int) -> torch.Tensor:
        return _iteration(self.example.loss_fn, self.runner, self.inputs, self.optimizer, index)


def _warm_and_measure(running: Running, wrapped: torch.nn.Module) -> Running:
    """Warm-up iterations, then the measured ones (the same seeds in every way)."""
    from memfit.runtime.measure import measure_allocator_peak
    from memfit.runtime.resident import bucket_bytes

    track = (list(wrapped.parameters()), list(wrapped.buffers()), running.optimizer.state,
             running.inputs)
    for index in range(WARMUP_STEPS + MEASURED_STEPS):
        measured = measure_allocator_peak(running.step, index, track=track)
        running.result.losses.append(measured.result)
        if index >= WARMUP_STEPS:
            running.result.peaks_bytes.append(measured.peak_bytes
                                              + bucket_bytes(wrapped, torch.device("cpu")))
    return running


def _set_up(bench: DistModel, example: examples.Example, inputs: tuple, way: Way,
            budget_bytes: int | None) -> Running:
    """``way`` on this rank, warmed up and measured; under memfit, again at the smallest peak a
    refused budget names (``ATTEMPTS`` budgets in all, then the last refusal is raised)."""
    result = RankResult(budget_bytes=budget_bytes)
    for attempt in range(1, ATTEMPTS + 1):
        wrapped = _prepared(bench, example, way)
        optimizer = torch.optim.AdamW(wrapped.parameters())
        if result.budget_bytes is None:
            return _warm_and_measure(Running(example, inputs, wrapped, optimizer, result), wrapped)
        fitted = memfit.fit(wrapped, budget=result.budget_bytes, optimizer=optimizer)
        try:
            return _warm_and_measure(Running(example, inputs, fitted, optimizer, result), wrapped)
        except memfit.BudgetError as error:  # every rank raises it, with the same minimum
            if attempt == ATTEMPTS:
                raise
            result.refused_bytes.append(result.budget_bytes)
            result.budget_bytes = error.minimum_bytes
            result.losses, result.peaks_bytes = [], []
    raise AssertionError("unreachable: the last attempt returns or raises")


def _largest_over_ranks(value: int) -> int:
    import torch.distributed as dist

    largest = torch.tensor([value])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest)


def _timed_rounds(runnings: Sequence[Running]) -> None:
    """``TIMED_STEPS`` rounds, each one step of every way in turn, each started at a barrier.

    Note:
        Interleaved so that every way gets the same share of the other jobs' load on this
        shared machine: timed way after way, a checkpointed U-Net step came out 0.43x eager's.
    """
    import torch.distributed as dist

    for round_index in range(TIMED_STEPS):
        faulthandler.dump_traceback_later(WAY_TIMEOUT_S, exit=True)
        for running in runnings:
            dist.barrier()
            started = time.perf_counter()
            loss = running.step(WARMUP_STEPS + MEASURED_STEPS + round_index)
            running.result.times_s.append(time.perf_counter() - started)
            running.result.losses.append(loss)


def _worker(rank: int, store_path: str, out_folder: str, bench: DistModel,
            ways: Sequence[Way]) -> None:
    """One rank: every way set up and measured in turn, then timed in rounds; the results
    pickled to ``out_folder``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank,
                            world_size=WORLD_SIZE)
    example = bench.build()
    inputs = tuple(t.roll(rank, 0).contiguous() for t in example.inputs())  # per-rank data
    runnings: dict[str, Running] = {}
    largest_peaks: dict[str, int] = {}
    # every way's compiled code stays in Dynamo's cache until the timed rounds: see fit.py's
    # RECOMPILE_LIMIT
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        for way in ways:
            faulthandler.dump_traceback_later(WAY_TIMEOUT_S, exit=True)
            budget = (None if way.budget_of is None
                      else int(way.budget_fraction * largest_peaks[way.budget_of]))
            started = time.perf_counter()
            runnings[way.label] = _set_up(bench, example, inputs, way, budget)
            result = runnings[way.label].result
            result.wall_s = time.perf_counter() - started
            if rank == 0:
                print(f"distributed: {bench.name}: {way.label}: {result.wall_s:.0f} s",
                      file=sys.stderr, flush=True)
            largest_peaks[way.label] = _largest_over_ranks(max(result.peaks_bytes))
        _timed_rounds(list(runnings.values()))
    faulthandler.cancel_dump_traceback_later()
    with open(os.path.join(out_folder, f"rank{rank}.pickle"), "wb") as file:
        pickle.dump({label: running.result for label, running in runnings.items()}, file)
    dist.destroy_process_group()


def launch(bench: DistModel, ways: Sequence[Way], failures: list[str],
           launches: int = LAUNCHES) -> list[dict[str, RankResult]] | None:
    """Every rank's results, or None where each of ``launches`` launches failed (a rank timed
    out or raised); each failure is said in ``failures``."""
    import torch.multiprocessing as multiprocessing
    from torch.multiprocessing.spawn import ProcessException

    for attempt in range(1, launches + 1):
        with tempfile.TemporaryDirectory(prefix="memfit-dist-") as folder:
            try:
                multiprocessing.start_processes(
                    _worker, args=(str(Path(folder) / "store"), folder, bench, tuple(ways)),
                    nprocs=WORLD_SIZE, start_method="spawn")
            except ProcessException as error:
                failures.append(f"{bench.name}: launch {attempt} of {launches} failed: "
                                f"{str(error).splitlines()[0]}")
                continue
            results = []
            for rank in range(WORLD_SIZE):
                with open(Path(folder) / f"rank{rank}.pickle", "rb") as file:
                    results.append(pickle.load(file))
            return results
    return None


HEADERS = ("model", "way", "per-rank peak", "budget", "peak <= budget", "step time",
           "vs eager", "losses = eager's", "wall time")


@dataclass(frozen=True)
class WayFigures:
    """One way over both ranks: the larger rank's peak, the slower rank's median step time."""

    model: str
    way: Way
    peak_bytes: int
    budget_bytes: int | None
    refused_bytes: tuple[int, ...]
    step_s: float
    eager_step_s: float
    steps_s: tuple[float, ...]  # each timed step, the slower rank's
    losses_bitwise: bool  # every iteration's loss on every rank equal to the engine's eager's
    wall_s: float  # the slower rank's set-up: building, compiling, planning, warm-up, measured

    @property
    def within_budget(self) -> bool | None:
        return None if self.budget_bytes is None else self.peak_bytes <= self.budget_bytes


def eager_label(way: Way) -> str:
    return FSDP if way.engine == "fsdp" else DDP


def way_figures(model: str, way: Way, ranks: list[dict[str, RankResult]]) -> WayFigures:
    """``way``'s figures against the same engine's eager way."""
    mine = [rank[way.label] for rank in ranks]
    eager = [rank[eager_label(way)] for rank in ranks]
    same = all(len(result.losses) == len(reference.losses) and all(
        torch.equal(a, b) for a, b in zip(result.losses, reference.losses, strict=True))
        for result, reference in zip(mine, eager, strict=True))
    return WayFigures(model, way, max(max(result.peaks_bytes) for result in mine),
                      mine[0].budget_bytes, tuple(mine[0].refused_bytes),
                      max(statistics.median(result.times_s) for result in mine),
                      max(statistics.median(result.times_s) for result in eager),
                      tuple(max(times) for times in zip(*(r.times_s for r in mine), strict=True)),
                      same, max(result.wall_s for result in mine))


def figures_row(figures: WayFigures) -> tuple[str, ...]:
    budget = "-" if figures.budget_bytes is None else format_bytes(figures.budget_bytes)
    if figures.refused_bytes:
        budget += f" (refused {', '.join(format_bytes(b) for b in figures.refused_bytes)})"
    within = {None: "-", True: "yes", False: "**no**"}[figures.within_budget]
    return (figures.model, figures.way.label, format_bytes(figures.peak_bytes), budget, within,
            f"{figures.step_s * 1e3:.0f} ms", f"{figures.step_s / figures.eager_step_s:.2f}x",
            "bitwise" if figures.losses_bitwise else "differ", f"{figures.wall_s:.0f} s")


def distributed_figures(log: Callable[[str], None], models: Sequence[DistModel] = DIST_MODELS,
                        ways: Sequence[Way] = WAYS) -> tuple[list[WayFigures], list[str]]:
    """Every way's figures, model by model (none for a model whose launches all failed), and
    what failed (a launch that timed out or raised, retried ``LAUNCHES`` times in all)."""
    figures: list[WayFigures] = []
    failures: list[str] = []
    for bench in models:
        started = time.perf_counter()
        ranks = launch(bench, ways, failures)
        if ranks is not None:
            figures += [way_figures(bench.name, way, ranks) for way in ways]
        log(f"distributed: {bench.name}: {time.perf_counter() - started:.0f} s; failed "
            f"launches so far: {failures or 'none'}")
    return figures, failures


def reading(figures: Sequence[WayFigures]) -> list[str]:
    """Per model and engine: memfit at checkpointing's peak beside checkpointing itself."""
    lines = []
    by_label = {(f.model, f.way.label): f for f in figures}
    for memfit_figures in figures:
        way = memfit_figures.way
        if way.budget_of not in (FSDP_CHECKPOINT, DDP_CHECKPOINT):
            continue
        checkpointing = by_label[(memfit_figures.model, way.budget_of)]
        held = {True: "within", False: "over"}[bool(memfit_figures.within_budget)]
        lines.append(
            f"- {memfit_figures.model}, {way.engine.upper().replace('FSDP', 'FSDP2')}: memfit "
            f"{memfit_figures.step_s * 1e3:.0f} ms a step at "
            f"{format_bytes(memfit_figures.peak_bytes)} ({held} its budget "
            f"{format_bytes(memfit_figures.budget_bytes or 0)}), checkpointing "
            f"{checkpointing.step_s * 1e3:.0f} ms at {format_bytes(checkpointing.peak_bytes)}: "
            f"{memfit_figures.step_s / checkpointing.step_s:.2f}x checkpointing's step time "
            f"(memfit's timed steps: "
            f"{', '.join(f'{s * 1e3:.0f}' for s in memfit_figures.steps_s)} ms).")
    return lines


def distributed_section(log: Callable[[str], None]) -> str:
    """The Markdown section of ``bench/RESULTS.md`` (``python -m bench.run --only distributed``)."""
    from bench.run import machine

    started = time.perf_counter()
    figures, failures = distributed_figures(log)
    rows = [figures_row(f) for f in figures]
    measured = {f.model for f in figures}
    rows += [(bench.name, f"no result: {LAUNCHES} launches timed out or failed",
              *["-"] * (len(HEADERS) - 2)) for bench in DIST_MODELS if bench.name not in measured]
    return "\n".join([
        "## Two ranks on gloo (CPU): FSDP2 and DDP beside per-block checkpointing\n",
        f"`python -m bench.run --only distributed`, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{time.perf_counter() - started:.0f} s: {machine()}; {WORLD_SIZE} ranks on gloo, "
        f"load average at the end {os.getloadavg()[0]:.1f}.\n",
        f"{WORLD_SIZE} processes on this CPU (`torch.multiprocessing`, gloo, one intra-op thread "
        "each), each rank its own batch; every way trains a fresh copy of the same weights with "
        "AdamW in one launch per model, in the table's order. FSDP2 is `fully_shard` on each "
        "block (GPT-2's transformer blocks; the U-Net's first stage, the skip connection "
        "holding the rest, the last stage) and on the root. Checkpointing is "
        "`torch.utils.checkpoint` (non-reentrant) around each GPT-2 transformer block and each "
        "U-Net `ResidualUnit` and up-sampling `Convolution`, applied before `fully_shard`, as "
        "torchtitan's per-block activation checkpointing. memfit is `memfit.fit(model, budget, "
        "optimizer=adamw)` (`auto`) over the distributed model, its per-rank budget "
        "checkpointing's measured peak (the larger rank's: equal measured peak) or half of "
        "eager's; a budget no plan fits is refused on every rank and the way runs again at the "
        "smallest peak the refusal names.\n",
        f"Per-rank peak: the larger over the ranks of each rank's largest iteration peak over "
        f"{MEASURED_STEPS} iterations after {WARMUP_STEPS} warm-up iterations (in which memfit "
        "compiles, plans, plans again jointly and profiles its first runs), measured "
        "by the CPU allocator's events (`measure_allocator_peak`) above the resident "
        "parameters, optimizer state and batch, DTensors counted by their local shard, plus "
        f"DDP's gradient buckets. Step time: the slower rank's median of {TIMED_STEPS} "
        "iterations after those, without the profiler, timed in rounds (one step of every way "
        "in turn, each started at a barrier, so that every way shares the other jobs' load "
        "alike); vs eager is against the same engine's eager row. Wall time: setting the way "
        "up on the slower rank (building, compiling, planning, the warm-up and measured "
        "iterations). Losses: every iteration's loss on every rank "
        "compared with `torch.equal` to the same engine's eager run. Peaks over the budget are "
        "reported as measured (**no**). Timings on this shared 2-core machine are noisy, and "
        "two ranks on two cores compete with other jobs.\n",
        table(HEADERS, rows),
        "\nReading:\n",
        *reading(figures),
        f"- launches that timed out or failed (then retried): {'; '.join(failures) or 'none'}.",
    ])


def main() -> None:
    torch.use_deterministic_algorithms(True)
    figures, failures = distributed_figures(print)
    print(table(HEADERS, [figures_row(f) for f in figures]))
    print(*reading(figures), *failures, sep="\n")


if __name__ == "__main__":
    main()
