"""Run a program and measure it into a ``Timeline``: the same type the simulator predicts.

After every node the device bytes are sampled (the CPU tracker, or the CUDA allocator's
``memory_allocated``), so a measured memory curve can be drawn beside the predicted one; op times
are measured too when asked (on CUDA that synchronizes after every op, which costs speed, so it
is off by default there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit.core.timeline import Interval, Timeline
from memfit.runtime.executor import Executor
from memfit.runtime.tracker import DeviceMemoryTracker


class ProfilingExecutor(Executor):
    """An ``Executor`` that samples device bytes, and optionally time, after every node.

    Note:
        The sample is taken after the node ran and before its dead inputs are freed, the moment
        the simulator's ``memory_bytes`` describes (allocations made, nothing freed yet).
    """

    def __init__(self, module: torch.fx.GraphModule, device: torch.device,
                 live_bytes: Callable[[], int], time_ops: bool) -> None:
        super().__init__(module, device=device)
        self.live_bytes = live_bytes
        self.time_ops = time_ops
        self.labels: list[str] = []
        self.samples: list[int] = []
        self.intervals: list[Interval] = []
        self.started = time.perf_counter()

    def run_node(self, node: torch.fx.Node) -> Any:
        start = time.perf_counter()
        value = super().run_node(node)
        if node.op != "call_function":
            return value
        if self.time_ops:
            self.engine.synchronize()
            end = time.perf_counter()
            kind = (node.meta.get("memfit") or {}).get("kind", "compute")
            self.intervals.append(
                Interval("compute", node.name, start - self.started, end - self.started, kind)
            )
        self.labels.append(node.name)
        self.samples.append(self.live_bytes())
        return value


def run_measured(program: torch.fx.GraphModule, inputs: list[torch.Tensor],
                 track: Iterable[torch.Tensor] = (), time_ops: bool | None = None) -> tuple[Any, Timeline]:
    """Run ``program`` on ``inputs`` and return its outputs and the measured ``Timeline``.

    Args:
        program: a (rewritten) captured graph.
        inputs: one value per placeholder; the list is emptied (see ``Executor.run_flat``).
        track: tensors alive outside the graph that count as device bytes (existing ``.grad``).
        time_ops: time every op (default: on CPU yes, on CUDA no, as it synchronizes per op).
    """
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    time_ops = device.type != "cuda" if time_ops is None else time_ops
    if device.type == "cuda":
        return _run_cuda(program, inputs, device, time_ops)
    tracker = DeviceMemoryTracker(device)
    tracker.register((inputs, list(track)))
    executor = ProfilingExecutor(program, device, lambda: tracker.current_bytes, time_ops)
    with tracker:
        started = time.perf_counter()
        outputs = executor.run_flat(inputs)
        elapsed_s = time.perf_counter() - started
    return outputs, _timeline(executor, tracker.peak_bytes, elapsed_s)


def _run_cuda(program, inputs, device, time_ops) -> tuple[Any, Timeline]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    executor = ProfilingExecutor(program, device, lambda: torch.cuda.memory_allocated(device),
                                 time_ops)
    started = time.perf_counter()
    outputs = executor.run_flat(inputs)
    torch.cuda.synchronize(device)
    elapsed_s = time.perf_counter() - started
    return outputs, _timeline(executor, torch.cuda.max_memory_allocated(device), elapsed_s)


def _timeline(executor: ProfilingExecutor, peak_bytes: int, elapsed_s: float) -> Timeline:
    peak_index = max(range(len(executor.samples)), key=executor.samples.__getitem__, default=-1)
    return Timeline(
        source="measured",
        peak_bytes=int(peak_bytes),
        step_time_s=elapsed_s,
        intervals=tuple(executor.intervals),
        memory_labels=tuple(executor.labels),
        memory_bytes=tuple(executor.samples),
        peak_label=executor.labels[peak_index] if peak_index >= 0 else "",
    )


def op_times(timeline: Timeline) -> dict[str, float]:
    """Measured time of each op by name, to replace roofline estimates: ``graph.with_times(...)``."""
    return {i.label: i.end_s - i.start_s for i in timeline.intervals if i.kind == "compute"}
