"""The PNG renderer: it draws simulated timelines, and redraws one loaded from JSON."""

from __future__ import annotations

import pytest

from memfit.data.hardware import get_hardware
from memfit.data.plan import Plan, Swap, SwapIn
from memfit.data.timeline import Timeline
from memfit.model import synthetic
from memfit.model.simulate import simulate
from memfit.render.plot import memory_plot, with_phases, x_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _timelines():
    """The unplanned and a planned (first activation swapped) timeline of an 8-op chain."""
    graph = synthetic.chain(8)
    hardware = get_hardware("h100-pcie")
    tensor = graph.saved_tensors()[0]
    backward_reader = [c for c in tensor.consumers if graph.op(c).phase == "backward"][0]
    before = graph.ops[graph.index[backward_reader] - 1].name
    planned = Plan("swap", {tensor.name: Swap((SwapIn(before, (backward_reader,)),))})
    keep = with_phases(simulate(graph, Plan("keep"), hardware), graph)
    swap = with_phases(simulate(graph, planned, hardware), graph)
    return graph, keep, swap


def test_two_timelines_make_a_png(tmp_path):
    _, keep, swap = _timelines()
    assert len(swap.memory_bytes) > len(keep.memory_bytes)  # different action counts overlay
    path = memory_plot({"unplanned": keep, "swap": swap}, tmp_path / "memory.png",
                       budget_bytes=keep.peak_bytes // 2)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_phase_starts_mark_the_backward_pass():
    graph, keep, _ = _timelines()
    starts = keep.meta["phase_starts"]
    assert starts["forward"] == 0.0
    first_backward = next(i for i, op in enumerate(graph.ops) if op.phase == "backward")
    assert starts["backward"] == pytest.approx(first_backward / (len(graph.ops) - 1))


def test_a_saved_timeline_rerenders(tmp_path):
    _, _, swap = _timelines()
    swap.save(tmp_path / "swap.json")
    loaded = Timeline.load(tmp_path / "swap.json")
    assert loaded == swap and loaded.meta["phase_starts"] == swap.meta["phase_starts"]
    for x_axis in ("position", "time"):
        path = memory_plot({"loaded": loaded}, tmp_path / f"{x_axis}.png", x_axis=x_axis)
        assert path.read_bytes().startswith(PNG_MAGIC)


def test_peak_only_timeline_and_no_gantt(tmp_path):
    measured = Timeline("measured", peak_bytes=3 * 2**20, step_time_s=0.1)
    path = memory_plot({"measured": measured}, tmp_path / "m.png", gantt=None)
    assert path.stat().st_size > 0


def test_bad_arguments_say_what_to_do(tmp_path):
    _, keep, _ = _timelines()
    with pytest.raises(ValueError, match="at least one timeline"):
        memory_plot({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="names no timeline"):
        memory_plot({"keep": keep}, tmp_path / "x.png", gantt="swap")


def test_a_measured_timeline_is_never_labelled_simulated():
    """Before, ``x_axis="time"`` labelled every plot "simulated time (ms)": also a measured
    timeline's (and the Gantt panel under it), and one beside a measured peak, which has no
    times at all."""
    _, keep, swap = _timelines()
    measured = Timeline("measured", keep.peak_bytes, 0.1, intervals=keep.intervals,
                        memory_labels=keep.memory_labels, memory_bytes=keep.memory_bytes)
    peak_only = Timeline("measured", keep.peak_bytes, 0.1)
    assert x_label({"run": measured}, "time") == "measured time (ms)"
    assert x_label({"plan": swap}, "time") == "simulated time (ms)"
    assert x_label({"plan": swap, "run": measured}, "time") == "measured and simulated time (ms)"
    assert x_label({"run": peak_only}, "time").startswith("program position")
    assert x_label({"plan": swap}, "position").startswith("program position")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memfit.render.plot import _gantt_panel

    figure, axes = plt.subplots()
    _gantt_panel(axes, "run", measured)
    assert axes.get_xlabel() == "measured time of 'run' (ms)"
    plt.close(figure)


def test_gantt_has_a_comm_row_only_for_a_sharded_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memfit.model.sharding import shard_graph
    from memfit.render.plot import _gantt_panel
    from tests.model.test_sharding import HARDWARE, fsdp, layered

    rows = {}
    for name, graph in (("one", layered()), ("rank", shard_graph(layered(), fsdp(), HARDWARE))):
        figure, axes = plt.subplots()
        _gantt_panel(axes, name, simulate(graph, Plan("keep"), HARDWARE))
        rows[name] = [label.get_text() for label in axes.get_yticklabels()]
        plt.close(figure)
    assert rows == {"one": ["compute", "d2h", "h2d"], "rank": ["compute", "d2h", "h2d", "comm"]}
