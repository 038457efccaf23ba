"""A second process of the same ``compiler="inductor"`` script compiles nothing and plans
nothing: inductor's FX graph cache holds memfit's planned forward and backward modules (the
backward's ordering pins included, ``memfit.lowering.inductor``) and memfit's plan cache its plans,
while memfit's partitioner and its bookkeeping still run for every region."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                       reason="inductor needs a C++ compiler on the CPU (install g++)"),
]


def test_a_second_process_finds_every_planned_module_in_inductors_cache(tmp_path):
    """The first process compiles the forward and the backward, whose re-runs are pinned to
    their planned order; the second finds both in inductor's cache (no miss, no bypass), reads
    its plan, runs the same kernels (bitwise the same losses) within the budget, and measures
    and reports each region as the first did."""
    env = dict(os.environ, MEMFIT_CACHE="1", MEMFIT_CACHE_DIR=str(tmp_path / "plans"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    runs = []
    for _ in range(2):
        finished = subprocess.run([sys.executable, str(ROOT / "tests" / "inductor_cache_child.py"),
                                   "0.7"], capture_output=True, text=True, env=env, check=False,
                                  timeout=1800, cwd=ROOT)
        assert finished.returncode == 0, finished.stderr[-3000:]
        runs.append(json.loads(finished.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert sum(first["pinned"]) >= 1, first["pinned"]  # the backward holds control_deps
    assert first["fxgraph"] == {"hit": 0, "miss": 2, "bypass": 0}, first["fxgraph"]
    assert second["fxgraph"] == {"hit": 2, "miss": 0, "bypass": 0}, second["fxgraph"]
    assert first["plans_made"] >= 1 and first["plans_cached"] == 0
    assert second["plans_made"] == 0 and second["plans_cached"] == first["plans_made"]
    assert "read from the plan cache" in second["report"]
    assert second["losses"] == first["losses"]
    assert max(second["peaks"]) <= second["budget_bytes"], second["peaks"]
    assert None not in second["region_peaks"] and second["region_peaks"] == first["region_peaks"]
