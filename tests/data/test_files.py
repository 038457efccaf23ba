"""Atomic writes: the new content whole, or the old file untouched, and no stray files."""

from __future__ import annotations

import os
import stat

import pytest

from memfit.data.files import replacing, write_text
from memfit.data.plan import Plan
from memfit.data.timeline import Timeline


def test_write_text_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "RESULTS.md"
    target.write_text("old")
    write_text(target, "new ✓")
    assert target.read_text(encoding="utf-8") == "new ✓"
    assert os.listdir(tmp_path) == ["RESULTS.md"]


def test_an_exception_mid_write_leaves_the_old_file_intact(tmp_path):
    target = tmp_path / "memory.png"
    target.write_bytes(b"old picture")
    with pytest.raises(RuntimeError, match="disk full"), replacing(target) as temporary:
        assert temporary.parent == tmp_path and temporary.suffix == ".png"
        temporary.write_bytes(b"half a new pic")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old picture"
    assert os.listdir(tmp_path) == ["memory.png"]


def test_a_new_file_gets_the_mode_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        write_text(tmp_path / "new.json", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644


def test_a_failing_save_leaves_a_saved_plan_and_timeline_as_they_were(tmp_path, monkeypatch):
    plan_path, timeline_path = tmp_path / "step.plan.json", tmp_path / "t.json"
    Plan("keep", graph_hash="abc").save(plan_path)
    Timeline("simulated", peak_bytes=7, step_time_s=1.0).save(timeline_path)
    before = plan_path.read_text(), timeline_path.read_text()

    def fail(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", fail)  # fails after the content is written, before replace
    with pytest.raises(OSError, match="no space left"):
        Plan("swap", graph_hash="def").save(plan_path)
    with pytest.raises(OSError, match="no space left"):
        Timeline("measured", peak_bytes=9, step_time_s=2.0).save(timeline_path)
    assert (plan_path.read_text(), timeline_path.read_text()) == before
    assert sorted(os.listdir(tmp_path)) == ["step.plan.json", "t.json"]
