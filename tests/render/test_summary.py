"""``memfit show``'s timeline summary says where each time comes from."""

from __future__ import annotations

from memfit.data.timeline import Timeline
from memfit.render.summary import timeline_summary


def test_a_measured_step_is_not_given_simulated_figures():
    """Before, a measured whole-step timeline read "exposed transfer 0.000 ms" (never measured)
    and nothing said the step time was measured."""
    measured = Timeline("measured", 5 << 20, 0.25, meta={"run": "swap"})
    text = timeline_summary(measured)
    assert text.startswith("measured timeline")
    assert "step time 250.0 ms (measured, the whole step: copy and re-run times not measured)" \
        in text
    assert "exposed transfer" not in text and "simulated" not in text


def test_a_simulated_step_shows_its_copies_and_reruns():
    simulated = Timeline("simulated", 5 << 20, 0.25, exposed_transfer_s=0.01, recompute_s=0.02)
    text = timeline_summary(simulated)
    assert "step time 250.0 ms, exposed transfer 10.000 ms, re-runs 20.000 ms (simulated)" in text
