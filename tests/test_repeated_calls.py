"""The plan of a region whose forward runs again before its backward: which copies of its saves
its plan did not fit beside, and the plan that fits beside them, on stand-in regions and plans
(no model runs; ``tests/test_joint_planning.py`` runs the loop)."""

from __future__ import annotations

from types import SimpleNamespace

from memfit.compiler.repeated_calls import fit_copies, uncounted_copies
from memfit.data.errors import BudgetError


def region(saved_bytes=20, copies=1, own_pending_bytes=0, minimum_bytes=None, cap=None,
           copies_planned=0):
    return SimpleNamespace(site="code", saved_bytes=saved_bytes, most_open_forwards=copies,
                           own_pending_bytes=own_pending_bytes, minimum_bytes=minimum_bytes,
                           saves_cap_bytes=cap, copies_planned=copies_planned)


def test_copies_count_where_its_plan_did_not_fit_beside_them():
    assert uncounted_copies(region(copies=3)) == 2  # its forward ran 3 times, planned for one
    assert uncounted_copies(region()) == 0
    assert uncounted_copies(region(saved_bytes=0, copies=3)) == 0  # nothing saved: no copies
    assert uncounted_copies(region(copies=3, cap=7)) == 0  # a unit capped in its first iteration
    # planned again before its second call, beside the first's 25 bytes of saves
    assert uncounted_copies(region(copies=2, own_pending_bytes=25)) == 0
    assert uncounted_copies(region(copies=3, own_pending_bytes=25)) == 2  # a third call too
    # planned beside them, but only at its smallest peak, over the budget
    assert uncounted_copies(region(copies=2, own_pending_bytes=25, minimum_bytes=130)) == 1
    # fitted beside that copy already (``fit_copies``), at the closest plan: not planned again
    assert uncounted_copies(region(copies=2, own_pending_bytes=25, minimum_bytes=130,
                                   copies_planned=1)) == 0
    assert uncounted_copies(region(copies=3, own_pending_bytes=25, minimum_bytes=130,
                                   copies_planned=1)) == 2  # but a third call is new


def plan_at(budget_bytes):
    """A stand-in strategy: no plan below 40 bytes; at budget b the plan is b, peaking at b."""
    if budget_bytes < 40:
        raise BudgetError(budget_bytes, 40)
    return budget_bytes, budget_bytes


def saves_half(plan):
    return ("forward", "backward", 5 if plan == "fewest" else plan // 2)


def test_the_bisection_keeps_the_largest_budget_whose_peak_with_its_copies_fits():
    # peak b plus two more copies of b // 2 within 104: b <= 52
    made, lowered, fits = fit_copies(plan_at, saves_half, 2, 104, lambda: None)
    assert fits and made + 2 * lowered[-1] <= 104
    assert made >= 52 - (104 - 40) // 64  # within the bisection's resolution of the best
    made, _, fits = fit_copies(plan_at, saves_half, 0, 104, lambda: None)
    assert fits and made == 104  # no copies: the budget's own plan


def test_where_even_the_smallest_peak_misses_the_fewest_saves_plan_is_the_fallback():
    # the smallest-peak plan (40, saving 20) needs 40 + 4 * 20 = 120 beside four copies;
    # re-run whole (peak 60, saving 5): 60 + 20 = 80
    made, lowered, fits = fit_copies(plan_at, saves_half, 4, 104, lambda: ("fewest", 60))
    assert fits and made == "fewest" and lowered[-1] == 5
    # and where nothing fits, the plan whose peak with its copies is least, said to miss
    made, _, fits = fit_copies(plan_at, saves_half, 4, 70, lambda: ("fewest", 60))
    assert not fits and made == "fewest"
    made, _, fits = fit_copies(plan_at, saves_half, 4, 70, lambda: None)
    assert not fits and made == 40
