"""The first call, cold and warm (issue 30, part 3): what a training loop's first iteration costs
beyond a steady step, for memfit and for ``torch.compile``, in a fresh process with empty
caches and again in a second process with the caches the first one filled.

Each row is its own child process (``python -m bench.first_call --child ...``), so imports,
Dynamo's in-memory caches and memfit's plans start empty: *cold* is a process with an empty
``MEMFIT_CACHE_DIR`` and an empty ``TORCHINDUCTOR_CACHE_DIR`` (temporary folders), *warm* is a
second process with the same folders. The loop is GPT-2 (``examples.gpt2``) under AdamW at half
of eager's measured peak (memfit: ``memfit.fit(..., budget=, strategy="auto")``;
``torch.compile``: ``activation_memory_budget`` at the same fraction), on one intra-op thread.
The rows marked "graph break" run the same model with transformers' default loss
(``loss_type`` unset), behind a graph break: two compiled regions, which memfit plans jointly
on fake inputs before the first run (one more Dynamo trace, ``memfit.fitting.joint_first``).
"Launch" counts from the child's start (imports included) on the monotonic clock the processes
share. The first iteration (forward, backward, optimizer step) is split as far as the tools can
say: Dynamo's trace (``_compile.compile_inner`` less the backend's call, from
``torch._dynamo.utils.compilation_time_metrics``), the backend's call (AOTAutograd,
partitioning, compiling), within it memfit's planning (each region's ``planning.choosing_s``,
every plan of the loop) and its analysis and rewriting (``planning.around_s``), and the rest:
running the iteration (memfit's first measured run, the optimizer step, inductor's kernels
finished at their first run). The steady step is the median of the iterations after memfit's
measured runs.

The second table is issue 30's other first-call figure: process CPU of ``memfit.plan`` with
``strategy="auto"`` against the same call with ``"keep"`` on a 48-layer GPT-2 (meta inputs,
``h100-pcie``), ``plan.explain()`` included, each in its own child process after a one-layer
warm-up call, with the plan cache off.

Run: ``python -m bench.run --only first_call`` (or ``python -m bench.first_call``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

FIRST_CALL_TITLE = "## The first call, cold and warm (issue 30)"
ROOT = Path(__file__).resolve().parent.parent
FRACTION = 0.5  # of eager's measured peak
ITERATIONS = 6  # the first, memfit's second measured run, then steady ones
STEADY_FROM = 3  # iterations from this index on are steady
LOOP_MODEL = dict(layers=4, width=128, heads=4, vocab=256, sequence=128, batch_size=4)
# (kind, compiler, graph break): with a graph break, GPT-2's loss is transformers' own default
# (``loss_type`` unset: a logger call Dynamo breaks at), so memfit traces the call on fakes first
LOOPS = (("memfit", "aot_eager", False), ("memfit", "inductor", False),
         ("torch.compile", "aot_eager", False), ("torch.compile", "inductor", False),
         ("memfit", "aot_eager", True), ("torch.compile", "aot_eager", True))
BREAK_LABEL = ", graph break"
WARM_GOAL = 0.10  # issue 30: the second process's planning at most 10% of the first's
PLAN_MODEL = dict(layers=48, width=256, heads=4, vocab=1024, sequence=1024)
PLAN_BATCH = 4
PLAN_HARDWARE = "h100-pcie"
AUTO_GOAL_S = 10.0  # issue 30: auto adds at most this much process CPU to keep
CHILD_TIMEOUT_S = 1800
LAUNCHED_KEY = "MEMFIT_BENCH_LAUNCHED"  # time.monotonic() as the parent starts the child
LOOP_HEADERS = ("loop", "cache", "launch to first iteration's end", "first iteration",
                "Dynamo trace", "backend", "memfit planning", "memfit analysis", "rest",
                "plans made / read", "steady step")


def eager_peak_bytes() -> int:
    """The loop's eager peak: the larger of two AdamW iterations' measured peaks (the second
    holds the optimizer state)."""
    from memfit import examples
    from memfit.runtime.measure import measure_allocator_peak

    example = examples.gpt2(**LOOP_MODEL)
    optimizer = torch.optim.AdamW(example.model.parameters())
    parameters = list(example.model.parameters())
    peaks = []
    for _ in range(2):
        inputs = example.inputs()
        measured = measure_allocator_peak(lambda inputs=inputs: _step(example, example.model,
                                                                      optimizer, inputs),
                                          track=(parameters, optimizer.state, inputs))
        peaks.append(measured.peak_bytes)
    return max(peaks)


def _step(example, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          inputs: tuple) -> None:
    loss = example.loss_fn(model, *inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _metric_s(name: str) -> float:
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get(name, ()))


def loop_child(kind: str, compiler: str, budget_bytes: int, graph_break: bool = False) -> dict:
    """One loop in this process: the first iteration split into its parts, the plans, the steady
    step (seconds). ``graph_break``: the model's loss as transformers computes it by default,
    behind a graph break (two compiled regions)."""
    import memfit
    from memfit import examples
    from memfit.fitting.fitted import BACKEND_KEY

    torch.set_num_threads(1)
    example = examples.gpt2(**LOOP_MODEL)
    model = example.model
    if graph_break:
        model.loss_type = None
    optimizer = torch.optim.AdamW(model.parameters())
    if kind == "memfit":
        called = memfit.fit(model, budget=budget_bytes, optimizer=optimizer, compiler=compiler,
                            strategy="auto")
    else:
        torch._functorch.config.activation_memory_budget = FRACTION
        called = torch.compile(model, backend=compiler)
    inputs = example.inputs()
    seconds, split = [], {}
    for index in range(ITERATIONS):
        started = time.perf_counter()
        _step(example, called, optimizer, inputs)
        seconds.append(time.perf_counter() - started)
        if index == 0:
            first_ended = time.monotonic()
            backend_s = _metric_s("OutputGraph.call_user_compiler")
            split = {"trace_s": _metric_s("_compile.compile_inner") - backend_s,
                     "backend_s": backend_s}
    launched = float(os.environ.get(LAUNCHED_KEY, "nan"))
    result = {"first_s": seconds[0], **split, "launch_s": first_ended - launched,
              "steady_s": statistics.median(seconds[STEADY_FROM:]),
              "planning_s": None, "analysis_s": None, "plans_made": None, "plans_cached": None}
    if kind == "memfit":
        costs = [region.planning for region in model.__dict__[BACKEND_KEY].regions
                 if region.planning is not None]
        result.update(planning_s=sum(cost.choosing_s for cost in costs),
                      analysis_s=sum(cost.around_s for cost in costs),
                      plans_made=sum(cost.plans_made for cost in costs),
                      plans_cached=sum(cost.plans_cached for cost in costs))
    return result


def plan_child(strategy: str) -> dict:
    """Process CPU and wall seconds of ``memfit.plan`` with ``strategy`` (``auto`` at
    ``FRACTION``, ``keep`` with no budget: it fits none smaller) on the 48-layer GPT-2 and its
    ``explain()``, after a one-layer call of the same (imports, first calls)."""
    import memfit
    from memfit import examples
    from memfit.search import meta_inputs

    torch.set_num_threads(1)

    def planned(layers: int) -> str:
        example = examples.gpt2(**{**PLAN_MODEL, "layers": layers})
        inputs = meta_inputs(example.make_inputs, PLAN_BATCH)
        started = time.process_time(), time.perf_counter()
        budget = None if strategy == "keep" else FRACTION  # keep fits no smaller budget
        plan = memfit.plan(example.model, example.loss_fn, *inputs, budget=budget,
                           strategy=strategy, hardware=PLAN_HARDWARE)
        plan.explain()
        return time.process_time() - started[0], time.perf_counter() - started[1], plan

    planned(1)
    cpu_s, wall_s, plan = planned(PLAN_MODEL["layers"])
    return {"cpu_s": cpu_s, "wall_s": wall_s, "solver": plan.params.get("solver", plan.strategy)}


def run_child(arguments: Sequence[str], environment: dict[str, str]) -> dict:
    """``python -m bench.first_call --child *arguments`` in a fresh process; its JSON line."""
    env = dict(os.environ, **environment, **{LAUNCHED_KEY: repr(time.monotonic())},
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    finished = subprocess.run([sys.executable, "-m", "bench.first_call", "--child", *arguments],
                              capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                              timeout=CHILD_TIMEOUT_S)
    if finished.returncode != 0:
        raise RuntimeError(f"first_call child {arguments} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def loop_rows(log: Callable[[str], None]) -> list[tuple[str, str, dict]]:
    """Every loop of ``LOOPS`` cold, then warm, each in its own process."""
    budget_bytes = int(FRACTION * eager_peak_bytes())
    rows = []
    for kind, compiler, graph_break in LOOPS:
        loop = f"{kind} {compiler}{BREAK_LABEL if graph_break else ''}"
        with tempfile.TemporaryDirectory() as plans, tempfile.TemporaryDirectory() as kernels:
            environment = {"MEMFIT_CACHE": "1", "MEMFIT_CACHE_DIR": plans,
                           "TORCHINDUCTOR_CACHE_DIR": kernels}
            for cache in ("cold", "warm"):
                measured = run_child([kind, compiler, str(budget_bytes),
                                      *(["graph-break"] if graph_break else [])], environment)
                log(f"first call: {loop} {cache}: {measured}")
                rows.append((loop, cache, measured))
    return rows


def plan_rows(log: Callable[[str], None]) -> dict[str, dict]:
    """``plan_child`` for ``keep`` and ``auto``, the plan cache off."""
    rows = {}
    for strategy in ("keep", "auto"):
        rows[strategy] = run_child(["plan", strategy], {"MEMFIT_CACHE": "0"})
        log(f"first call: memfit.plan {strategy}: {rows[strategy]}")
    return rows


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def loop_table(rows: Sequence[tuple[str, str, dict]]) -> str:
    """One line per loop and cache state."""
    from memfit.data.tables import table

    cells = []
    for loop, cache, measured in rows:
        plans = ("-" if measured["plans_made"] is None
                 else f"{measured['plans_made']} / {measured['plans_cached']}")
        rest = measured["first_s"] - measured["trace_s"] - measured["backend_s"]
        cells.append([loop, cache, _s(measured["launch_s"]), _s(measured["first_s"]),
                      _s(measured["trace_s"]), _s(measured["backend_s"]),
                      _s(measured["planning_s"]), _s(measured["analysis_s"]), _s(rest), plans,
                      f"{1000 * measured['steady_s']:.0f} ms"])
    return table(LOOP_HEADERS, cells)


def warm_goal_lines(rows: Sequence[tuple[str, str, dict]]) -> list[str]:
    """For each memfit loop, the warm process's planning seconds over the cold one's, judged
    against ``WARM_GOAL``."""
    found: dict[str, dict[str, dict]] = {}
    for loop, cache, measured in rows:
        if measured["planning_s"] is not None:
            found.setdefault(loop, {})[cache] = measured
    lines = []
    for loop, caches in found.items():
        if {"cold", "warm"} <= caches.keys():
            cold, warm = caches["cold"]["planning_s"], caches["warm"]["planning_s"]
            ratio = warm / cold if cold > 0 else float("inf")
            verdict = "met" if ratio <= WARM_GOAL else "not met"
            lines.append(f"Goal ({loop}: the second process's planning at most "
                         f"{WARM_GOAL:.0%} of the first's): {_s(warm)} of {_s(cold)}, "
                         f"{ratio:.1%}: **{verdict}**.")
    return lines


def plan_lines(rows: dict[str, dict]) -> list[str]:
    """The ``memfit.plan`` table and its goal line."""
    from memfit.data.tables import table

    cells = [[strategy, f"{measured['cpu_s']:.1f} s", f"{measured['wall_s']:.1f} s",
              measured["solver"]] for strategy, measured in rows.items()]
    added = rows["auto"]["cpu_s"] - rows["keep"]["cpu_s"]
    verdict = "met" if added <= AUTO_GOAL_S else "not met"
    return [table(("strategy", "process CPU", "wall", "plan"), cells), "",
            f"Goal (`auto` adds at most {AUTO_GOAL_S:.0f} s of process CPU to `keep`, what-if "
            f"rows and explanation included): {added:.1f} s: **{verdict}**."]


def first_call_section(log: Callable[[str], None], plans: bool = True) -> str:
    """The Markdown section ``bench.run`` writes (``plans``: with the ``memfit.plan`` table)."""
    load_before = os.getloadavg()
    rows = loop_rows(log)
    planned = plan_rows(log) if plans else None
    load_after = os.getloadavg()
    model = ", ".join(f"{key} {value}" for key, value in LOOP_MODEL.items())
    lines = [FIRST_CALL_TITLE, "", __doc__.split("\n\n", 1)[1].split("\n\nRun:")[0].strip(), "",
             f"Command: `python -m bench.run --only first_call`. Loop: GPT-2 ({model}), budget "
             f"{FRACTION} of eager's measured peak; steady step: median of iterations "
             f"{STEADY_FROM + 1} to {ITERATIONS}. Load average (1, 5, 15 min) before: "
             f"{_load(load_before)}, after: {_load(load_after)}, on {os.cpu_count()} cores: other "
             "jobs shared the machine, so seconds carry their noise; cold and warm of a loop ran "
             "one after the other.", "", loop_table(rows), "", *warm_goal_lines(rows)]
    if planned is not None:
        model = ", ".join(f"{key} {value}" for key, value in PLAN_MODEL.items())
        lines += ["", f"`memfit.plan` on GPT-2 ({model}, batch {PLAN_BATCH}, meta inputs, "
                  f"`{PLAN_HARDWARE}`; `auto` at budget {FRACTION}, `keep` with none: it fits no "
                  "smaller) with `plan.explain()`, one thread, "
                  "each strategy in its own process:", "", *plan_lines(planned)]
    return "\n".join(lines)


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.1f}" for value in load)


def main(argv: Sequence[str]) -> None:
    if argv[:2] == ["--child", "plan"]:
        print(json.dumps(plan_child(argv[2])))
    elif argv[:1] == ["--child"]:
        print(json.dumps(loop_child(argv[1], argv[2], int(argv[3]), argv[4:] == ["graph-break"])))
    else:
        print(first_call_section(lambda message: print(message, file=sys.stderr)))


if __name__ == "__main__":
    main(sys.argv[1:])
