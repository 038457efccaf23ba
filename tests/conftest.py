"""Fixtures shared by the test folders, and how the suite spreads over processes."""

import os

import pytest
import torch

MAX_WORKERS = 4  # each worker holds torch, transformers and a few models: ~1-2 GB


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most ``MAX_WORKERS``."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_configure(config):
    """In a worker, torch's intra-op threads share the cores with the other workers (more
    OpenMP threads than cores made single CPU steps many times slower at random). memfit's
    on-disk cache of plans and kernel measurements is off (tests count the plans they make, and
    one test's plan must not be another's); a test of the cache turns it on in a folder of its
    own."""
    os.environ["MEMFIT_CACHE"] = "0"
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def compiled_fresh():
    """Deterministic algorithms on (bitwise claims need them) and Dynamo's caches emptied before
    and after, so no test reuses another's compiled regions or plans; the flag is put back."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(was_deterministic)
