"""The shares of saved bytes that graph-broken regions get when planned jointly, and the
bisection that finds a plan within a share, on stand-in regions and plans (no model runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.compiler.graph_breaks import (
    latest_regions,
    regions_ahead,
    save_at_most,
    saves_caps,
    units_ahead_cap,
)
from memfit.data.errors import BudgetError


def region(index, code, saved_bytes, budget_bytes=100, minimum_bytes=None, pending_bytes=0,
           replaced=False, site=None, copies=1):
    return SimpleNamespace(index=index, site=site or code, saved_bytes=saved_bytes,
                           budget_bytes=budget_bytes, minimum_bytes=minimum_bytes,
                           pending_bytes=pending_bytes, replaced=replaced,
                           most_open_forwards=copies)


def test_a_short_region_splits_its_room_among_the_earlier_regions_by_what_they_saved():
    # the third region needs 70 without the earlier saves (its minimum 130 less 60 pending):
    # the 30 left of its budget of 100 goes 1:2 to the two regions before it
    regions = [region(0, "a", 20), region(1, "b", 40),
               region(2, "c", 10, minimum_bytes=130, pending_bytes=60)]
    assert saves_caps(regions) == {"a": 10, "b": 20}


def test_no_caps_where_nothing_ran_short_or_even_alone_it_cannot_fit():
    assert saves_caps([region(0, "a", 20), region(1, "b", 40)]) == {}
    hopeless = region(1, "b", 40, minimum_bytes=170, pending_bytes=20)  # 150 alone > 100
    assert saves_caps([region(0, "a", 20), hopeless]) == {}


def test_the_tighter_of_two_short_regions_caps_a_shared_earlier_region():
    regions = [region(0, "a", 50),
               region(1, "b", 50, minimum_bytes=120, pending_bytes=50),   # room 30 for "a"
               region(2, "c", 0, minimum_bytes=150, pending_bytes=100)]   # room 50 for a and b
    assert saves_caps(regions) == {"a": 25, "b": 25}


def test_a_region_run_for_several_blocks_shares_the_room_among_its_copies():
    # one compiled code ran for 4 blocks (20 saved each: 80 alive), then the tail ran short:
    # it needs 70 alone (150 - 80), so 30 is left for 4 copies of the same saves
    regions = [region(0, "block", 20, copies=4),
               region(1, "tail", 5, minimum_bytes=150, pending_bytes=80)]
    assert saves_caps(regions) == {"block": 7}
    # and beside another region, each copy counts in the proportion
    regions = [region(0, "embed", 20), region(1, "block", 20, copies=3),
               region(2, "tail", 5, minimum_bytes=150, pending_bytes=80)]
    assert saves_caps(regions) == {"embed": 7, "block": 7}


def test_the_latest_region_of_each_code_is_the_current_one():
    old = region(0, "a", 1, replaced=True)
    regions = [old, region(1, "b", 1), region(2, "a", 1)]
    assert [r.index for r in latest_regions(regions)] == [1, 2]


def test_one_code_run_for_several_modules_is_a_region_each():
    # FSDP2's per-block regions: one block's forward code, one site per block module
    blocks = [region(index, "block", 1, site=("block", index)) for index in range(3)]
    assert [r.index for r in latest_regions(blocks)] == [0, 1, 2]


def test_a_unit_counts_the_units_not_yet_run_and_the_roots_code_after_them():
    # FSDP2 units 10, 11, 12, 13 (module ids); a region's site is (code, owner id, place)
    units = [10, 11, 12, 13]
    assert regions_ahead(units, ("block", 10, 0), set()) == 4  # 11, 12, 13 and the root's tail
    assert regions_ahead(units, ("block", 12, 0), {10, 11}) == 2  # 13 and the tail
    assert regions_ahead(units, ("block", 13, 0), {10, 11, 12}) == 1  # the tail only
    assert regions_ahead(units, ("block", 11, 0), {10, 99}) == 3  # 99 is not a unit


def test_regions_not_of_a_unit_or_of_an_open_unit_get_no_share():
    units = [10, 11]
    assert regions_ahead(units, ("head", 99, 0), set()) is None  # the root's code
    assert regions_ahead(units, "code", set()) is None  # no module owns it
    assert regions_ahead(units, ("block", 10, 1), {10}) is None  # its unit already ran
    assert regions_ahead([], ("block", 10, 0), set()) is None  # no FSDP2


def test_a_unit_keeps_its_share_of_the_room_beyond_one_regions_transient():
    # 100 of room, 20 for one region's peak beyond its saves, 4 regions after it: 80 / 5
    assert units_ahead_cap(100, 20, 4) == 16
    assert units_ahead_cap(100, 20, 0) == 80  # alone: all the room beyond its transient
    assert units_ahead_cap(10, 20, 3) == 0  # no room: save nothing it can re-run


def plan_at(budget_bytes):
    """A stand-in strategy: its smallest peak is 40; its plan at a budget is the budget."""
    if budget_bytes < 40:
        raise BudgetError(budget_bytes, 40)
    return budget_bytes


def test_the_bisection_keeps_the_largest_budget_whose_saves_fit_the_cap():
    """A plan at budget b saves b // 2: the best within a cap of 30 is b = 60 or 61."""
    made, lowered = save_at_most(plan_at, lambda plan: ("forward", "backward", plan // 2),
                                 cap_bytes=30, budget_bytes=104)
    assert lowered[-1] <= 30 and made // 2 == lowered[-1]
    assert made >= 60 - (104 - 40) // 64  # within the bisection's resolution of the best, 60
    smallest, _ = save_at_most(plan_at, lambda plan: (None, None, plan), cap_bytes=1,
                               budget_bytes=104)
    assert smallest == 40  # nothing fits the cap: the smallest-peak plan


@pytest.mark.parametrize("cap", [20, 52])
def test_the_bisection_never_returns_a_plan_over_the_cap_when_one_fits(cap):
    made, lowered = save_at_most(plan_at, lambda plan: (None, None, plan // 2), cap_bytes=cap,
                                 budget_bytes=104)
    assert lowered[-1] <= cap and made >= 40


def test_where_no_bisected_plan_meets_the_cap_the_fewest_saves_plan_is_the_fallback():
    """``fewest`` saves 5: with a cap of 10 (no bisected plan saves that little) it is taken, as
    it saves less than the smallest-peak plan; with a cap of 30 the bisection's plan within it
    is faster; without a fitting ``fewest``, the smallest-peak plan."""
    def lower(plan):
        return (None, None, 5 if plan == "fewest" else plan // 2)

    assert save_at_most(plan_at, lower, 10, 104, lambda: "fewest")[0] == "fewest"
    assert save_at_most(plan_at, lower, 30, 104, lambda: "fewest")[0] != "fewest"
    assert save_at_most(plan_at, lower, 10, 104, lambda: None)[0] == 40
