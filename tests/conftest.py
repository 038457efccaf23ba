"""Fixtures shared by the test folders."""

import pytest
import torch


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
