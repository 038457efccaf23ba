"""The garbage collector is paused while any plan, in any thread, is in progress."""

import gc
import threading

import pytest

from memfit.planning.strategies import collector_paused


@pytest.fixture
def collector_on():
    was_enabled = gc.isenabled()
    gc.enable()
    yield
    if was_enabled:  # as it was: a test that switched it off must not leave it off
        gc.enable()
    else:
        gc.disable()


def in_thread(action):
    thread = threading.Thread(target=action)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_interleaved_plans_in_two_threads_resume_the_collector_only_after_the_last(collector_on):
    first, second = collector_paused(), collector_paused()
    in_thread(first.__enter__)
    assert not gc.isenabled()
    in_thread(second.__enter__)
    in_thread(lambda: first.__exit__(None, None, None))
    assert not gc.isenabled()  # the second plan is still running
    in_thread(lambda: second.__exit__(None, None, None))
    assert gc.isenabled()


def test_a_collector_off_before_planning_stays_off(collector_on):
    gc.disable()
    first, second = collector_paused(), collector_paused()
    first.__enter__()
    in_thread(second.__enter__)
    first.__exit__(None, None, None)
    in_thread(lambda: second.__exit__(None, None, None))
    assert not gc.isenabled()


def test_an_error_while_planning_still_resumes_the_collector(collector_on):
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("planning failed")
    assert gc.isenabled()
