"""``strategy="auto"`` against the plans it chooses among, at real model sizes, simulated.

Issue 4's comparison: for GPT-2 medium, ResNet-50 and a 3D U-Net on the ``h100-pcie`` and
``gh200`` profiles, the simulated step-time overhead of auto, swap-only, recompute-only and the
vDNN policies at 90/70/50/30% of the unplanned peak, the MILP optimum where it can be solved,
auto's smallest reachable peak, its planning time, the largest batch each fits in 80 GiB, the
issue's goals judged on those numbers, and other systems' published figures beside them.
The figures come from ``bench/auto_plans.py``; this module renders them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from bench.auto_plans import (
    ALTERNATIVES,
    AUTO_MODELS,
    BATCH_BUDGET,
    GPT2_SMALL,
    MILP,
    MILP_MAX_OPS,
    PROFILES,
    AutoModel,
    ModelResult,
    Outcome,
    ProfileResult,
    auto_losses,
    largest_batches,
    measure_model,
    overhead,
    planning_times,
)
from bench.common import mib, ms
from memfit.data.tables import table

AUTO_TITLE = "## Budget planner (auto) vs the alternatives"
GOALS = ((0.5, 0.03), (0.3, 0.15))  # issue 4: (fraction of the peak, overhead limit), GPT-2 medium
GOAL_PROFILE = "h100-pcie"
PLANNING_GOAL_S = 1.0  # issue 4: GPT-2 small planned in under a second


def percent_cell(value: float | None) -> str:
    """An overhead as ``+2.3%``, or ``does not fit`` for ``None``."""
    return "does not fit" if value is None else f"{value * 100:+.1f}%"


def overhead_cell(outcome: Outcome | None, keep_step_s: float) -> str:
    return percent_cell(overhead(outcome, keep_step_s))


def goal_verdict(value: float | None, limit: float) -> str:
    """``met`` when the overhead fits and is under ``limit``, else ``not met`` with the reason."""
    if value is None:
        return "not met (auto does not fit)"
    return "met" if value < limit else "not met"


def goal_lines(result: ProfileResult) -> list[str]:
    """Issue 4's overhead goals, judged on ``result``'s own numbers."""
    lines = []
    for fraction, limit in GOALS:
        row = next(r for r in result.rows if r.fraction == fraction)
        value = overhead(row.outcomes["auto"], result.keep_step_s)
        lines.append(f"- auto at {fraction:.0%} of the peak under {limit:.0%} overhead: "
                     f"{percent_cell(value)}, **{goal_verdict(value, limit)}**")
    return lines


FRACTION_HEADERS = ("model", "budget (of the peak)", "auto", "auto's pick", "auto planning",
                    *(name for name, _, _ in ALTERNATIVES), MILP)


def fraction_table_rows(result: ModelResult, profile: str) -> list[tuple]:
    """One Markdown row per fraction: overheads over the unplanned simulated step."""
    found = result.profiles[profile]
    rows = []
    for row in found.rows:
        auto = row.outcomes["auto"]
        milp = row.outcomes.get(MILP)
        milp_cell = (overhead_cell(milp, found.keep_step_s) if milp is not None
                     else f"— ({found.ops} ops, beyond the MILP's size)")
        rows.append((result.name, f"{row.fraction:.0%} ({mib(row.budget_bytes)})",
                     overhead_cell(auto, found.keep_step_s), auto.solver or "-",
                     f"{auto.planning_s:.1f} s",
                     *(overhead_cell(row.outcomes[name], found.keep_step_s)
                       for name, _, _ in ALTERNATIVES), milp_cell))
    return rows


def model_table_rows(results: Sequence[ModelResult]) -> list[tuple]:
    """Per model and profile: the graph, the unplanned step, auto's minimum, planning times and
    the largest batches."""
    rows = []
    for result in results:
        for profile, found in result.profiles.items():
            auto_s = [row.outcomes["auto"].planning_s for row in found.rows]
            rows.append((result.name, result.batch_size, profile, found.ops,
                         mib(found.keep_peak_bytes), ms(found.keep_step_s),
                         f"{found.minimum_bytes / found.keep_peak_bytes:.0%} "
                         f"({mib(found.minimum_bytes)})",
                         f"{result.capture_s:.1f} s", f"{statistics.median(auto_s):.1f} s",
                         batches_cell(found)))
    return rows


def batches_cell(found: ProfileResult) -> str:
    """``11 (14.2/s) -> 136 (0.1/s): 12.4x the batch, 0.01x the throughput``: keep, then auto."""
    keep, auto = found.keep_largest, found.auto_largest
    if keep is None or auto is None:
        return "not searched"
    ratios = (f": {auto.batch_size / keep.batch_size:.1f}x the batch, "
              f"{auto.samples_per_s / keep.samples_per_s:.2g}x the throughput"
              if keep.batch_size and keep.samples_per_s else "")
    return (f"{keep.batch_size} ({_rate(keep.samples_per_s)}) -> {auto.batch_size} "
            f"({_rate(auto.samples_per_s)}){ratios}")


def _rate(samples_per_s: float) -> str:
    return f"{samples_per_s:,.0f}/s" if samples_per_s >= 100 else f"{samples_per_s:.3g}/s"


MODEL_HEADERS = ("model", "batch", "profile", "ops", "unplanned peak", "unplanned step",
                 "auto's minimum (of the peak)", "capture + analysis",
                 "auto planning (median of the budgets)",
                 f"largest batch in {BATCH_BUDGET}, keep -> auto (predicted samples/s)")


ANCHOR_HEADERS = ("system", "published figure (theirs, not measured here)", "source",
                  "nearest figure of ours (simulated)")


def anchor_rows(results: Sequence[ModelResult]) -> list[tuple]:
    """Published figures of other systems, each beside the nearest figure this section made."""
    first = results[0].profiles[GOAL_PROFILE]

    def auto_overheads(fraction: float, profiles: Sequence[str]) -> list[float]:
        values = []
        for result in results:
            for profile in profiles:
                found = result.profiles[profile]
                row = next(r for r in found.rows if r.fraction == fraction)
                value = overhead(row.outcomes["auto"], found.keep_step_s)
                if value is not None:
                    values.append(value)
        return values

    def spread(values: list[float], show: Callable[[float], str]) -> str:
        return "-" if not values else f"{show(min(values))} to {show(max(values))}"

    percent = "{:+.1%}".format
    at_half = auto_overheads(0.5, [GOAL_PROFILE])
    at_third = auto_overheads(0.3, list(PROFILES))
    throughput = [1 / (1 + value) for value in at_third]
    half = next(r for r in first.rows if r.fraction == 0.5)
    recompute = overhead(half.outcomes["recompute-only"], first.keep_step_s)
    return [
        ("vDNN", "VGG-16 at batch 256 in a 12 GB GPU, 18% slower than with enough memory",
         "Rhu et al., vDNN, MICRO 2016",
         f"auto at 50% of the peak on {GOAL_PROFILE}: {spread(at_half, percent)}"),
        ("Capuchin", "7x the largest batch of plain TensorFlow on BERT",
         "Peng et al., Capuchin, ASPLOS 2020",
         f"largest batch, keep -> auto, {results[0].name}, {GOAL_PROFILE}: "
         f"{batches_cell(first)}"),
        ("SwapAdvisor", "53-99% of the throughput with infinite GPU memory",
         "Huang, Jin and Li, SwapAdvisor, ASPLOS 2020",
         "auto's throughput at 30% of the peak, as a share of the unplanned step's (all "
         f"models and profiles): {spread(throughput, '{:.0%}'.format)}"),
        ("torch.compile activation memory budget",
         "50% less activation memory by recomputing pointwise ops",
         "PyTorch blog, \"Current and New Activation Checkpointing Techniques in PyTorch\" (2025)",
         f"recompute-only at 50% of the whole step's peak, {results[0].name}, {GOAL_PROFILE}: "
         + ("does not fit" if recompute is None else percent(recompute))),
    ]


def planning_goal_line(times: tuple[float, float, float]) -> str:
    capture_s, auto_s, whole_s = times
    verdict = "met" if auto_s < PLANNING_GOAL_S else "not met"
    return (f"- {GPT2_SMALL.name}, batch {GPT2_SMALL.batch_size}, planned by auto in under "
            f"{PLANNING_GOAL_S:.0f} s at 50% of the peak on {GOAL_PROFILE}: auto's plan call "
            f"{auto_s:.1f} s, **{verdict}** (capture and analysis {capture_s:.1f} s more; the "
            f"whole `memfit.plan`, which also captures and explains with two what-if plans, "
            f"{whole_s:.1f} s)")


def intro(search_note: str) -> str:
    return (
        "Every figure here is the simulator's, on the named profile: the models are captured on "
        "meta inputs (shapes only, nothing of an activation's size is allocated; the weights "
        "are real, on the CPU) and planned; no GPU ran. Budgets are fractions of the unplanned "
        "(keep) step's simulated peak, which counts parameters, gradients, inputs and "
        "activations in float32. Overhead is the planned step's simulated time over the "
        "unplanned one's; \"does not fit\" means the planner raised `BudgetError` or its plan "
        "simulates over the budget. The alternatives run with the parameters auto uses for "
        "them (recompute-only is `optimal-recompute` with `method=\"segments\"`, the "
        "separator-block DP), so auto, which simulates each of them among its candidates, can "
        "only tie or beat them. The MILP optimum (POET's swap + recompute MILP, "
        f"`memfit.planning.solvers.milp_swap`) is solved only on graphs of up to {MILP_MAX_OPS} ops: "
        "its model has a binary per pair of ops, and these graphs have hundreds to thousands. "
        "Planning times are wall seconds on this shared 2-core CPU. " + search_note)


def auto_section(log: Callable[[str], None], models: Sequence[AutoModel] = AUTO_MODELS,
                 with_batches: bool = True) -> str:
    """The Markdown section of RESULTS.md (see the module docstring)."""
    started = time.perf_counter()
    results = []
    for bench in models:
        example = bench.build()
        result = measure_model(bench, example, log)
        if with_batches:
            largest_batches(bench.name, example, result, log)
        results.append(result)
        log(f"auto {bench.name}: {time.perf_counter() - started:.0f} s so far")
    times = planning_times(GPT2_SMALL)
    goal_model = results[0]
    losses = [f"{result.name}, {profile}, {row.fraction:.0%}: {loss}"
              for result in results for profile, found in result.profiles.items()
              for row in found.rows for loss in auto_losses(row)]
    search_note = (f"Largest batches: `memfit.max_batch_size(..., budget=\"{BATCH_BUDGET}\", "
                   "verify=False)` with `strategy=\"keep\"` and `\"auto\"`, planned on meta "
                   "inputs, not run; beside each, its predicted throughput on the profile: the "
                   "largest batch is not the fastest one when fitting it takes heavy "
                   "recomputation."
                   if with_batches else "Largest batches were not searched in this run.")
    parts = [AUTO_TITLE + "\n", intro(search_note),
             f"\n### Goals (issue 4), {goal_model.name} on {GOAL_PROFILE}\n",
             "\n".join(goal_lines(goal_model.profiles[GOAL_PROFILE])
                       + [planning_goal_line(times)]),
             "\n### The models\n", table(MODEL_HEADERS, model_table_rows(results))]
    for profile in PROFILES:
        parts += [f"\n### Step-time overhead on {profile} (simulated)\n",
                  table(FRACTION_HEADERS, [row for result in results
                                           for row in fraction_table_rows(result, profile)])]
    parts += ["\nAuto slower than an alternative that fits (a bug if any): "
              + ("; ".join(losses) if losses else "none") + ".",
              "\n### Published figures of other systems (not ours)\n",
              "Their models, hardware and measurements differ from these simulated ones; they "
              "are context, not a like-for-like comparison.\n",
              table(ANCHOR_HEADERS, anchor_rows(results)),
              f"\nThis section took {time.perf_counter() - started:.0f} s."]
    return "\n".join(parts)
