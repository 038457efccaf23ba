"""The GPU part (``--gpu``): the host link, then a GPT-2 medium step unplanned and swap-all,
predicted beside measured. Needs CUDA; about 5 minutes on an H100.

Note:
    GPT-2 medium at sequence 1024 saves several GiB of activations per sample in float32, so the
    batch is chosen from one capture at batch 1: the largest of 8, 4, 2, 1 whose extrapolated
    unplanned peak is under ``DEVICE_FRACTION`` of device memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

import memfit
from bench.common import median_time_s, mib, ms
from memfit import examples
from memfit.data.hardware import Hardware
from memfit.data.tables import table
from memfit.fitting.traced import trace_plan
from memfit.runtime.probe import measure_link

LINK_BYTES = 256 * 2**20
DEVICE_FRACTION = 0.7  # headroom for the allocator's fragmentation and the CUDA context
GPT2_MEDIUM = dict(layers=24, width=1024, heads=16, vocab=50257, sequence=1024)


def link_rates(device: torch.device) -> tuple[float, float, float]:
    """Pinned copy bytes/s device->host alone, host->device alone, and both at once (summed)."""
    link = measure_link(device, LINK_BYTES)
    return link.d2h_bytes_per_s, link.h2d_bytes_per_s, link.both_bytes_per_s


def choose_batch(device: torch.device, hardware: Hardware) -> int:
    """The largest of 8, 4, 2, 1 whose extrapolated unplanned peak fits ``DEVICE_FRACTION``."""
    example = examples.gpt2(**GPT2_MEDIUM, batch_size=1)
    model = example.model.to(device)
    inputs = tuple(t.to("meta") for t in example.inputs(1))  # planned from shapes: nothing runs
    planned = trace_plan(model, example.loss_fn, inputs, None, "keep", hardware, {})
    resident = planned.graph.resident_bytes
    per_sample = planned.baseline.peak_bytes - resident
    for batch in (8, 4, 2, 1):
        if resident + batch * per_sample <= DEVICE_FRACTION * hardware.device_bytes:
            return batch
    return 1  # (the model goes with this frame; gpu_sections empties the cache)


def gpt2_row(strategy: str, batch: int, device: torch.device, hardware: Hardware) -> tuple:
    """Predicted and measured peak and step time of one GPT-2 medium step under ``strategy``."""
    example = examples.gpt2(**GPT2_MEDIUM, batch_size=batch)
    model = example.model.to(device)
    inputs = tuple(t.to(device) for t in example.inputs(batch))
    step = memfit.compile(model, example.loss_fn, strategy=strategy, hardware=hardware)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        step(*inputs)

    run()  # capture, plan, and the first measured peak
    step_s = median_time_s(run, synchronize=lambda: torch.cuda.synchronize(device))
    measured = step.measured
    assert measured is not None
    compiled = step.compiled
    name = "unplanned (keep)" if strategy == "keep" else "swap-all (swap, lb=1)"
    row = (name, batch, mib(compiled.predicted.peak_bytes + compiled.outside_bytes),
           mib(measured.peak_bytes), ms(compiled.predicted.step_time_s), ms(step_s),
           _swapped_of_saved(compiled))
    return row


def _swapped_of_saved(compiled) -> str:
    """Swapped saved tensors over all saved ones (``memfit.model.explain.tally``: one population,
    so the first never exceeds the second)."""
    from memfit.model.explain import tally

    counted = tally(compiled.graph, compiled.plan, compiled.predicted)
    return f"{counted.swapped} / {counted.saved}"


def gpu_sections(log: Callable[[str], None]) -> list[str] | None:
    """Markdown sections of the GPU part, or ``None`` without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    log(f"GPU: {name}; measuring the host link")
    hardware = memfit.measure_hardware(device)
    d2h, h2d, both = link_rates(device)
    sections = [f"## GPU: {name}\n", "Pinned host link (256 MiB copies, best of 5):\n",
                table(("direction", "GB/s"), [("device to host alone", f"{d2h / 1e9:.1f}"),
                                              ("host to device alone", f"{h2d / 1e9:.1f}"),
                                              ("both at once (sum)", f"{both / 1e9:.1f}")]),
                f"\nmemfit's profile: d2h {hardware.d2h_bytes_per_s / 1e9:.1f} GB/s, h2d "
                f"{hardware.h2d_bytes_per_s / 1e9:.1f} GB/s, duplex {hardware.duplex}.\n"]
    return sections + gpt2_sections(device, hardware, log)


def _failed(what: str, error: Exception) -> tuple:
    return (f"{what}: failed", "-", "-", "-", "-", "-", f"{type(error).__name__}: {error}"[:200])


def gpt2_sections(device: torch.device, hardware: Hardware,
                  log: Callable[[str], None]) -> list[str]:
    """The GPT-2 medium table; a part that fails gets a row saying why (the rest still runs)."""
    rows = []
    try:
        batch = choose_batch(device, hardware)
    except Exception as error:  # report what failed on the GPU rather than lose the link table
        batch = 0
        rows.append(_failed("choosing the batch", error))
    gc.collect()
    torch.cuda.empty_cache()
    for strategy in ("keep", "swap") if batch else ():
        log(f"GPT-2 medium, batch {batch}, strategy {strategy}")
        try:
            rows.append(gpt2_row(strategy, batch, device, hardware))
        except Exception as error:
            rows.append(_failed(strategy, error))
        gc.collect()  # the step's model and program go before the next one is built
        torch.cuda.empty_cache()
    return ["GPT-2 medium (24 layers, width 1024, sequence 1024, float32), one step; peaks by "
            "torch.cuda.max_memory_allocated, step time the median of 3 after a warm-up; "
            "predictions on the measured profile:\n",
            table(("run", "batch", "predicted peak", "measured peak", "predicted step time",
                   "measured step time", "swapped / saved"), rows)]
