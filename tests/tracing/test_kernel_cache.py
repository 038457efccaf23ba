"""Kernel-probe measurements cached on disk per machine (``kernel_probe._MachineCache``): a later
process reads them instead of starting a child; a corrupt file is ignored with a warning."""

from __future__ import annotations

import warnings

import pytest

from memfit.tracing import kernel_probe
from tests.tracing.test_temporaries import MEASURED_CONVOLUTIONS, measured_case, traced


def test_a_measurement_is_read_back_without_a_child_and_a_corrupt_file_is_ignored(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_probe, "_MEASURED_BYTES", {})
    function, arguments = measured_case(MEASURED_CONVOLUTIONS[0], (True, True, True), True)
    node = traced(function, *arguments)
    measured = kernel_probe.measured_temporary_bytes([node])
    assert set(measured) == {node}
    (path,) = (tmp_path / "kernels").glob("*.json")

    # a later process: nothing measured in it, and no child can start
    monkeypatch.setattr(kernel_probe, "_MEASURED_BYTES", {})
    monkeypatch.setattr(kernel_probe.sys, "executable", "/nonexistent/python")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_probe.measured_temporary_bytes([node]) == measured

    monkeypatch.setattr(kernel_probe, "_MEASURED_BYTES", {})
    path.write_text('{"format": "memfit-kernel-cache", "version": 1, "bytes": [')
    with pytest.warns(UserWarning, match="ignored the kernel measurements"), \
            pytest.warns(UserWarning, match="scratch buffers"):
        assert kernel_probe.measured_temporary_bytes([node]) == {}
