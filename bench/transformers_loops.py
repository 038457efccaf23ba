"""transformers models in a user's loop: memfit.fit at per-block checkpointing's peak, and a
fine-tune on padded batches of changing length (issue 28's table).

At checkpointing's peak: GPT-2 and Llama with their ``labels=`` loss, BERT with a padded attention
mask. Each method trains a fresh copy of the same weights on the same batch with the same seed
(bench/fit.py's loop: forward, ``backward``, AdamW ``step``, ``zero_grad``); per-block
checkpointing is transformers' ``gradient_checkpointing_enable`` (non-reentrant); memfit's budget
is that method's measured iteration peak in bytes. Peaks are the largest of two measured
iterations (the first compiles and plans), by the profiler's CPU-allocator events above the
resident parameters, optimizer state and batch; times are medians of interleaved iterations.
Weights are compared after every method's 8 steps (2 measured, 1 more, 5 timed).

Padded batches: a BERT classifier fine-tuned on batches padded to their longest sequence (one
length per batch, then a smaller last batch), as a user's DataLoader with a padding collator
gives them. Eager, ``torch.compile(backend="aot_eager", dynamic=True)`` and memfit.fit at 0.7 of
eager's largest iteration peak each train through every batch once; the table gives the loop's
wall time, the graphs compiled or plans made, memfit's seconds tracing and planning, and the
largest measured iteration peak.
"""

from __future__ import annotations

import copy
import functools
import time

import torch

import memfit
from bench.common import mib, ms
from bench.fit import (
    CHECKPOINT,
    EAGER,
    FitModel,
    Method,
    _baselines,
    _builder,
    _measure,
    _timed,
    isolated_rows,
    weights_verdict,
)
from bench.recompute_methods import SINGLE_THREAD_NOTE
from memfit import examples
from memfit.runtime.measure import measure_allocator_peak

PEAK_HEADERS = ("model", "method", "iteration peak", "vs checkpointing's", "step time",
                "vs checkpointing", "regions", "weights after 8 steps")
PADDED_HEADERS = ("method", "loop time", "graphs compiled / plans made", "tracing and planning",
                  "largest iteration peak", "vs budget", "weights")
MEMFIT_AT_CHECKPOINTING = "memfit.fit at checkpointing's peak"
PEAK_MODELS = (
    FitModel(functools.partial(examples.gpt2, layers=4, width=128, heads=4, vocab=1024,
                               sequence=256, batch_size=8), name="gpt2"),
    FitModel(functools.partial(examples.bert, layers=4, width=128, heads=4, vocab=1024,
                               sequence=256, batch_size=16), name="bert"),
    FitModel(functools.partial(examples.llama, layers=4, width=128, heads=4, kv_heads=2,
                               vocab=1024, sequence=256, batch_size=8), name="llama"),
)
PADDED_LENGTHS = (40, 56, 72, 88, 104, 120, 136, 152, 168, 184, 200, 232, 256, 96)
PADDED_BUDGET_FRACTION = 0.7


def peak_rows(bench: FitModel, log) -> list[tuple]:
    """Eager, checkpointing every block and memfit at checkpointing's measured peak, in one
    process."""
    example = bench.build()
    inputs = example.inputs()
    torch._dynamo.reset()
    results = {}
    for method in _baselines(example, inputs, bench):
        log(f"transformers bench: {example.name}: {method.name}")
        results[method.name] = _measure(method, inputs)
    checkpoint_peak = results[CHECKPOINT].peak_bytes
    assert checkpoint_peak is not None
    fitted = Method(MEMFIT_AT_CHECKPOINTING, _builder(
        example, inputs, lambda m, o: memfit.fit(m, budget=checkpoint_peak, optimizer=o)))
    log(f"transformers bench: {example.name}: {fitted.name}")
    results[fitted.name] = _measure(fitted, inputs)
    times = _timed(results, log)
    rows = []
    for name, result in results.items():
        if result.model is None or result.peak_bytes is None:
            rows.append((example.name, name, result.refused, "-", "-", "-", "-", "-"))
            continue
        backend = getattr(result.model, "_memfit_backend", None)
        regions = "-" if backend is None else str(_running_regions(backend))
        rows.append((example.name, name, mib(result.peak_bytes),
                     f"{result.peak_bytes / checkpoint_peak:.3f}x", ms(times[name]),
                     f"{times[name] / times[CHECKPOINT]:.2f}x", regions,
                     weights_verdict(result.model, results[EAGER].model, EAGER)))
    return rows


def _running_regions(backend) -> int:
    """How many compiled regions the model's iteration runs (graph breaks + 1)."""
    from memfit.compiler.graph_breaks import latest_regions

    return len(latest_regions(backend.regions) or backend.regions)


def padded_batches(lengths=PADDED_LENGTHS, batch_size: int = 8, last_batch_size: int = 3):
    """Token batches padded to their longest sequence; every other row a quarter padding."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for index, length in enumerate(lengths):
        size = batch_size if index < len(lengths) - 1 else last_batch_size
        ids = torch.randint(0, 1024, (size, length), generator=generator)
        mask = torch.ones(size, length, dtype=torch.long)
        mask[::2, length * 3 // 4:] = 0
        batches.append((ids, mask, torch.randint(0, 2, (size,), generator=generator)))
    return batches


def _train_padded(model, optimizer, batches) -> tuple[list[int], float]:
    """One pass over ``batches``: each iteration's measured peak, and the loop's wall time."""
    peaks = []
    started = time.perf_counter()
    for index, (ids, mask, labels) in enumerate(batches):
        def iteration(ids=ids, mask=mask, labels=labels, index=index):
            torch.manual_seed(100 + index)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        parameters = list(optimizer.param_groups[0]["params"])
        peaks.append(measure_allocator_peak(iteration, track=(
            parameters, optimizer.state, ids, mask, labels)).peak_bytes)
    return peaks, time.perf_counter() - started


def padded_rows(log) -> list[tuple]:
    """Eager, torch.compile(dynamic=True) and memfit.fit on the padded fine-tune, in one process."""
    from torch._dynamo.utils import counters

    base = examples.bert(layers=4, width=128, heads=4, vocab=1024, sequence=256).model
    batches = padded_batches()
    torch._dynamo.reset()
    rows, budget, reference = [], 0, None
    for name in ("eager", 'torch.compile(backend="aot_eager", dynamic=True)', "memfit.fit"):
        log(f"transformers bench: padded batches: {name}")
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters())
        graphs = counters["stats"]["unique_graphs"]
        if name == "memfit.fit":
            runner = memfit.fit(model, budget=budget, optimizer=optimizer)
        elif name == "eager":
            runner = model
        else:
            runner = torch.compile(model, backend="aot_eager", dynamic=True)
        peaks, seconds = _train_padded(runner, optimizer, batches)
        if name == "eager":
            budget, reference = int(PADDED_BUDGET_FRACTION * max(peaks)), model
        backend = getattr(model, "_memfit_backend", None)
        made = (len(backend.regions) if backend is not None
                else counters["stats"]["unique_graphs"] - graphs)
        planning = f"{backend.planning_s:.1f} s" if backend is not None else "-"
        rows.append((name, f"{seconds:.1f} s", "-" if name == "eager" else str(made), planning,
                     mib(max(peaks)), f"{max(peaks) / budget:.3f}x",
                     weights_verdict(model, reference, EAGER)))
    return rows


def _rows_on_one_thread(bench: FitModel | None) -> list[tuple]:
    """A model's rows at checkpointing's peak, or with ``None`` the padded fine-tune's, on one
    intra-op thread with deterministic algorithms (as ``bench.run`` sets them)."""
    from bench.run import log

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return peak_rows(bench, log) if bench is not None else padded_rows(log)


def _markdown(headers: tuple[str, ...], rows: list[tuple]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def transformers_section(log) -> str:
    """The Markdown section: each model's rows and the padded fine-tune, each in a child process
    on one intra-op thread."""
    peak = []
    for bench in PEAK_MODELS:
        log(f"transformers bench: {bench.name} in a child process")
        peak.extend(isolated_rows(bench, _rows_on_one_thread, len(PEAK_HEADERS)))
    log("transformers bench: padded batches in a child process")
    padded = isolated_rows(None, _rows_on_one_thread, len(PADDED_HEADERS))
    intro, padded_text = __doc__.split("\n\n", 1)[1].split("\n\nPadded batches: ", 1)
    return "\n".join([
        "## transformers loops: at per-block checkpointing's peak, and on padded batches\n",
        intro.strip() + " " + SINGLE_THREAD_NOTE + "\n",
        "Command: `python -m bench.run --only transformers`. Goal (issue 28): memfit within "
        "checkpointing's peak on every model, at its speed or faster.\n",
        *_markdown(PEAK_HEADERS, peak),
        "\nPadded batches: " + padded_text.strip() + f" Lengths {', '.join(map(str, PADDED_LENGTHS))}"
        f" (batch 8, the last batch 3); BERT of 4 layers, width 128.\n",
        *_markdown(PADDED_HEADERS, padded),
    ])
