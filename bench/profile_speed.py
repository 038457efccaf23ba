"""Micro-benchmark: the incremental profile (``memfit.model.profile``) against the copy it
replaced (``_swap_tune.PeakModel`` and ``step_time_s``, loaded from a file of an older tree) and
the truth (``lower`` + ``memory_profile``, ``simulate``), answering the TFLMS tuner's questions on
one synthetic graph.

Run: ``python -m bench.profile_speed OPS_IN_FORWARD OLD_SWAP_TUNE_PY`` (seconds), e.g. ``820``
(2,007 ops) and a file made by
``git show 2419219:memfit/planning/strategies/swapping/_swap_tune.py > /tmp/old_swap_tune.py``.
Prints medians of repeated timings; every answer is checked equal (peaks to the byte, times to the
bit) before it is timed. Not part of ``bench/run.py`` (``docs/memory-model.md`` describes the
model).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan
from memfit.model import synthetic
from memfit.model.profile import BaseProfile
from memfit.model.schedule import peak_bytes
from memfit.model.simulate import simulate
from memfit.planning.strategies.swapping.tflms import plan as tflms

HARDWARE = get_hardware("h100-pcie")


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls (the machine is shared: medians, not means)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_copy(path: str) -> ModuleType:
    """The old ``_swap_tune`` module (with ``PeakModel`` and ``step_time_s``) from ``path``."""
    spec = importlib.util.spec_from_file_location("old_swap_tune", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_swap_tune"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(forward_ops: int, copy_path: str, seed: int = 1) -> None:
    old = load_copy(copy_path)
    PeakModel, step_time_s = old.PeakModel, old.step_time_s  # noqa: N806 (class from a module)
    graph = synthetic.random_dag(forward_ops, seed=seed)
    decisions = list(tflms(graph, HARDWARE, n_tensors=-1).decisions.items())
    print(f"graph {graph.name}: {len(graph.ops)} ops, {len(decisions)} swap candidates")
    model, base = PeakModel(graph), BaseProfile(graph)
    events, delta = model.events(decisions), base.swaps(decisions)
    rows = [("build (once per graph)", lambda: PeakModel(graph), lambda: BaseProfile(graph), None),
            ("changes of all decisions (once per rung)", lambda: model.events(decisions),
             lambda: base.swaps(decisions), None)]
    for count in sorted({1, 10, 100, len(decisions) // 2, len(decisions)}):
        plan = Plan("prefix", dict(decisions[:count]))
        truth = peak_bytes(graph, plan)
        for method in ("dense", "sparse"):
            assert model.peak(events, count) == base.peak_bytes(delta, count, method) == truth
            rows.append((f"peak, first {count} decisions, {method}",
                         lambda c=count: model.peak(events, c),
                         lambda c=count, m=method: base.peak_bytes(delta, c, m),
                         lambda p=plan: peak_bytes(graph, p)))
    for count in sorted({10, len(decisions)}):
        plan = Plan("prefix", dict(decisions[:count]))
        truth_s = simulate(graph, plan, HARDWARE, record_intervals=False).step_time_s
        assert base.step_time_s(delta, HARDWARE, count) == truth_s
        rows.append((f"step time, first {count} decisions",
                     lambda p=plan: step_time_s(graph, p, HARDWARE),
                     lambda c=count: base.step_time_s(delta, HARDWARE, c),
                     lambda p=plan: simulate(graph, p, HARDWARE, record_intervals=False)))
    print(f"{'question':44} {'copy (ms)':>10} {'profile (ms)':>13} {'truth (ms)':>11}")
    for label, copy, incremental, truth_run in rows:
        repeats = 20
        truth_ms = f"{1e3 * median_s(truth_run, 5):11.3f}" if truth_run else f"{'':11}"
        print(f"{label:44} {1e3 * median_s(copy, repeats):10.3f} "
              f"{1e3 * median_s(incremental, repeats):13.3f} {truth_ms}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(int(sys.argv[1]), sys.argv[2])
