"""The auto benchmark's pieces on synthetic graphs: rows, "does not fit", the MILP column, goals,
the splice into RESULTS.md. Copies cost here (64 MiB tensors against 1 ms ops), so swapping and
recomputing both have a price and the planners disagree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import run
from bench.auto import (
    ANCHOR_HEADERS,
    AUTO_TITLE,
    FRACTION_HEADERS,
    MODEL_HEADERS,
    anchor_rows,
    batches_cell,
    fraction_table_rows,
    goal_lines,
    goal_verdict,
    model_table_rows,
)
from bench.auto_plans import (
    ALTERNATIVES,
    MILP,
    PROFILES,
    BudgetRow,
    LargestBatch,
    ModelResult,
    Outcome,
    ProfileResult,
    auto_losses,
    budget_rows,
    overhead,
    profile_result,
)
from memfit.data.hardware import get_hardware
from memfit.model import synthetic

SIZE_BYTES = 64 << 20
FRACTIONS = (0.9, 0.5, 0.3)  # 0.5 and 0.3: the goals and anchors read them


@pytest.fixture(scope="module")
def resnet() -> ModelResult:
    graph = synthetic.resnet_like(5, size_bytes=SIZE_BYTES)
    result = ModelResult("resnet-like", 1, 0.0)
    for name in PROFILES:
        result.profiles[name] = profile_result(graph, get_hardware(name), FRACTIONS)
    return result


def test_auto_fits_wherever_an_alternative_does_and_is_never_slower(resnet):
    for found in resnet.profiles.values():
        for row in found.rows:
            auto = row.outcomes["auto"].step_time_s
            theirs = [row.outcomes[name].step_time_s for name, _, _ in ALTERNATIVES]
            fitting = [t for t in theirs if t is not None]
            assert (auto is not None) == bool(fitting), row
            if fitting:
                assert auto <= min(fitting) * (1 + 1e-9), row
            assert auto_losses(row) == []


def test_the_planners_disagree_and_the_alternatives_cost_something(resnet):
    """Otherwise the comparison above would hold trivially."""
    found = resnet.profiles["h100-pcie"]
    tight = found.rows[-1]
    values = [overhead(tight.outcomes[name], found.keep_step_s) for name, _, _ in ALTERNATIVES]
    fitting = [v for v in values if v is not None]
    assert len(set(fitting)) >= 2 and max(fitting) > 0.01
    assert None in values  # some alternative cannot reach 30%: "does not fit" appears


def test_below_auto_s_minimum_nothing_fits_and_the_table_says_so(resnet):
    graph = synthetic.resnet_like(5, size_bytes=SIZE_BYTES)
    hardware = get_hardware("h100-pcie")
    found = resnet.profiles["h100-pcie"]
    assert 0 < found.minimum_bytes < found.keep_peak_bytes
    below = found.minimum_bytes / found.keep_peak_bytes * 0.95
    (row,) = budget_rows(graph, hardware, found.keep_peak_bytes, (below,))
    assert all(outcome.step_time_s is None for outcome in row.outcomes.values())
    at = (found.minimum_bytes + 1) / found.keep_peak_bytes
    (row,) = budget_rows(graph, hardware, found.keep_peak_bytes, (at,))
    assert row.outcomes["auto"].step_time_s is not None
    cells = fraction_table_rows(ModelResult("m", 1, 0.0, {"h100-pcie": found}), "h100-pcie")
    assert len(cells) == len(FRACTIONS) and all(len(c) == len(FRACTION_HEADERS) for c in cells)
    assert "does not fit" in [cell for row_cells in cells for cell in row_cells]
    assert cells[0][-1] == f"— ({found.ops} ops, beyond the MILP's size)"


def test_the_milp_column_is_solved_on_a_small_graph():
    graph = synthetic.chain(6, size_bytes=SIZE_BYTES)
    found = profile_result(graph, get_hardware("h100-pcie"), (0.7,))
    milp = found.rows[0].outcomes[MILP]
    assert milp.step_time_s is not None and milp.solver in ("optimal", "feasible")
    cells = fraction_table_rows(ModelResult("chain", 1, 0.0, {"h100-pcie": found}), "h100-pcie")
    assert cells[0][-1].endswith("%") and "beyond" not in cells[0][-1]


def _profile(auto_s_by_fraction: dict[float, float | None]) -> ProfileResult:
    rows = tuple(BudgetRow(fraction, 100, {"auto": Outcome(time_s, 0.1)})
                 for fraction, time_s in auto_s_by_fraction.items())
    return ProfileResult("h100-pcie", 10, 1000, 1.0, rows, 100)


def test_the_goal_verdicts_follow_the_numbers():
    lines = goal_lines(_profile({0.5: 1.029, 0.3: 1.2}))
    assert "+2.9%, **met**" in lines[0] and "+20.0%, **not met**" in lines[1]
    lines = goal_lines(_profile({0.5: 1.031, 0.3: None}))
    assert "**not met**" in lines[0] and "does not fit" in lines[1]
    assert goal_verdict(0.149, 0.15) == "met" and goal_verdict(0.15, 0.15) == "not met"


def test_a_slower_auto_is_reported():
    outcomes = {"auto": Outcome(2.0, 0.1), **{name: Outcome(None, 0.1)
                                              for name, _, _ in ALTERNATIVES}}
    outcomes["swap-only"] = Outcome(1.5, 0.1)
    losses = auto_losses(BudgetRow(0.5, 100, outcomes))
    assert len(losses) == 1 and losses[0].startswith("swap-only")
    outcomes["auto"] = Outcome(None, 0.1)
    assert "does not fit" in auto_losses(BudgetRow(0.5, 100, outcomes))[0]


def test_the_summary_and_anchor_tables_render(resnet):
    rows = model_table_rows([resnet])
    assert len(rows) == len(PROFILES) and all(len(r) == len(MODEL_HEADERS) for r in rows)
    anchors = anchor_rows([resnet])
    assert [a[0] for a in anchors][:3] == ["vDNN", "Capuchin", "SwapAdvisor"]
    assert all(len(a) == len(ANCHOR_HEADERS) for a in anchors)
    assert "18%" in anchors[0][1] and "7x" in anchors[1][1] and "53-99%" in anchors[2][1]
    assert rows[0][-1] == "not searched" and "not searched" in anchors[1][3]


def test_the_largest_batch_comes_with_its_throughput():
    found = _profile({0.5: 1.0})
    found = replace(found, keep_largest=LargestBatch(10, 20.0),
                    auto_largest=LargestBatch(125, 0.5))
    assert batches_cell(found) == ("10 (20/s) -> 125 (0.5/s): 12.5x the batch, "
                                   "0.025x the throughput")


RESULTS = """# memfit benchmark results

- command: `python -m bench.run`
- run time: 5 s
- section "Other" rerun alone: `x` (kept)

## Recomputation: memory / step-time curves

old curves

### a subsection

{auto}## Size

| old | counts |
"""
SECTION = AUTO_TITLE + "\n\nnew figures\n\n### sub\n\nmore"


@pytest.mark.parametrize("old_auto", ["", AUTO_TITLE + "\n\nold figures\n\n### x\n\n"])
def test_the_section_is_spliced_before_the_size_table(old_auto):
    stamp = f'- section "{AUTO_TITLE[3:]}" rerun alone: `python -m bench.run --only auto`'
    old = RESULTS.format(auto=old_auto)
    once = run.splice(old, SECTION, stamp)
    assert once.count(AUTO_TITLE) == 1 and "old figures" not in once
    assert AUTO_TITLE + "\n\nnew figures\n" in once and "\n\n" + run.SIZE_TITLE + "\n\n" in once
    assert once.index("old curves") < once.index("### a subsection") < once.index(AUTO_TITLE)
    assert once.index(AUTO_TITLE) < once.index("more") < once.index(run.SIZE_TITLE)
    assert "| old | counts |" not in once and "| folder" in once  # the Size table is recounted
    assert '- section "Other" rerun alone' in once and once.count(stamp) == 1
    assert run.splice(once, SECTION, stamp) == once  # a second splice changes nothing


def test_only_names_every_section_that_can_be_rerun():
    assert set(run.ONLY_CHOICES) == set(run.section_builders())
