"""memfit.runtime.ranks outside a distributed job: every agreement is the rank's own value, and
a plan's digest tells plans apart by their decisions only (tests/test_distributed.py runs two
ranks)."""

from __future__ import annotations

import pytest
import torch

from memfit.data.errors import BudgetError
from memfit.data.plan import Keep, Plan, Recompute
from memfit.runtime.ranks import (
    agree_max,
    agree_on,
    plan_digest,
    raise_if_any_failed,
    real_tensors,
)


def _plan(decision) -> Plan:
    return Plan("auto", {"a": Keep(reason="small"), "b": decision}, graph_hash="0123",
                budget_bytes=1 << 20, hardware="cpu")


def test_without_a_process_group_each_rank_keeps_its_own_numbers():
    assert agree_max([3, 1, 2]) == [3, 1, 2]
    assert agree_on({"x": 1}) == {"x": 1}
    raise_if_any_failed(None)  # no rank failed: nothing raised


def test_a_failed_plan_is_raised_as_it_is():
    error = BudgetError(100, 250, strategy="auto")
    with pytest.raises(BudgetError) as raised:
        raise_if_any_failed(error)
    assert raised.value is error


def test_plan_digest_follows_the_decisions_not_the_explanation():
    kept, recomputed = _plan(Keep(reason="small")), _plan(Recompute("cheap"))
    assert plan_digest(kept) == plan_digest(_plan(Keep(reason="small")))
    assert plan_digest(kept) != plan_digest(recomputed)


def _python_dispatcher_on() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


def test_collectives_run_without_the_python_dispatcher_that_the_partitioner_runs_under():
    # through it, a gloo collective was called holding the GIL and deadlocked with gloo's worker
    # thread (tests/test_distributed.py's GPT-2 under FSDP2 hung in raise_if_any_failed)
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher():
        assert _python_dispatcher_on()
        with real_tensors():
            assert not _python_dispatcher_on()
        assert _python_dispatcher_on()  # put back after the block
