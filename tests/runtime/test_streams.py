"""The accelerator path of the swap ops, run on the CPU against a fake device module.

A recording fake stands in for ``torch.cuda`` (streams, events, the ``stream`` context), and
``Tensor.record_stream`` is replaced by a recorder, so the order of stream operations that the
CUDA path issues is checked on a machine without a GPU.
"""

import contextlib

import pytest
import torch

from memfit.ops.swap import SWAP_IN, SWAP_OUT, WAIT
from memfit.runtime.streams import CopyEngine, active_engine, current_engine


class FakeDeviceModule:
    """Just enough of ``torch.cuda`` for ``CopyEngine``, logging every stream operation."""

    def __init__(self):
        self.log = []
        self.compute = self.Stream(name="compute")
        self.current = self.compute

    def Stream(self, device=None, name=None):  # noqa: N802 (mirrors torch.cuda.Stream)
        module = self

        class Stream:
            def __init__(self):
                self.name = name

            def wait_stream(self, other):
                module.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                module.log.append(("wait_event", self.name, event.stream.name))

        return Stream()

    def Event(self):  # noqa: N802
        module = self

        class Event:
            def record(self, stream):
                self.stream = stream
                module.log.append(("record_event", stream.name))

        return Event()

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))
        self.current = previous

    def synchronize(self, device=None):
        self.log.append(("synchronize",))


@pytest.fixture
def fake_engine(monkeypatch):
    engine = CopyEngine("cpu")
    fake = FakeDeviceModule()
    engine.module, engine.is_accelerator = fake, True
    engine.d2h_stream, engine.h2d_stream = fake.Stream(name="d2h"), fake.Stream(name="h2d")
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda tensor, stream: fake.log.append(("record_stream", stream.name)))
    return engine, fake.log


def test_accelerator_path_orders_streams_and_events(fake_engine):
    engine, log = fake_engine
    tensor = torch.randn(8, 4)
    with active_engine(engine):
        host = SWAP_OUT(tensor, 3)
        assert log == [
            ("wait_stream", "d2h", "compute"),  # the copy starts once x is written
            ("enter", "d2h"), ("exit", "d2h"),  # the copy is issued on the d2h stream
            ("record_stream", "d2h"),  # x's block is not reused before the copy ends
            ("record_event", "d2h"),
        ]
        log.clear()
        back = SWAP_IN(host, 3, 4, torch.device("cpu"))
        assert log == [
            ("wait_event", "h2d", "d2h"),  # the host copy must be complete
            ("enter", "h2d"), ("exit", "h2d"),  # allocated and copied on the h2d stream
            ("record_event", "h2d"),
            ("record_stream", "compute"),  # the compute ops that read it keep it alive
        ]
        log.clear()
        WAIT(back, 4)
        assert log == [("wait_event", "compute", "h2d")]
    assert torch.equal(back, tensor)
    assert set(engine.events) == {3, 4}


def test_waiting_on_an_unrecorded_event_names_the_problem(fake_engine):
    engine, _ = fake_engine
    with active_engine(engine), pytest.raises(KeyError, match="no copy event 9"):
        WAIT(torch.ones(2), 9)


def test_cpu_engine_records_nothing():
    engine = CopyEngine("cpu")
    with active_engine(engine):
        WAIT(SWAP_IN(SWAP_OUT(torch.ones(3), 0), 0, 1, torch.device("cpu")), 1)
    assert engine.events == {} and not engine.is_accelerator and not engine.host_pool.pinned


def test_executor_synchronizes_then_forgets_events(fake_engine):
    from memfit.runtime.executor import Executor

    engine, log = fake_engine
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    back = graph.call_function(SWAP_IN, (graph.call_function(SWAP_OUT, (x, 0)), 0, 1, torch.device("cpu")))
    graph.call_function(WAIT, (back, 1))
    graph.output(graph.call_function(torch.ops.aten.neg.default, (back,)))
    result = Executor(torch.fx.GraphModule({}, graph), engine=engine).run(torch.ones(3))
    assert torch.equal(result, -torch.ones(3))
    assert log[-1] == ("synchronize",) and engine.events == {}


def test_each_thread_sees_only_its_own_engine():
    """A run ending in one thread must not take the engine away from a run in another.

    The order is fixed by events: the first thread enters its block, the second enters its own,
    the first leaves, and only then does the second look its engine up.
    """
    import threading

    first_engine, second_engine = CopyEngine("cpu"), CopyEngine("cpu")
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with active_engine(first_engine):
            first_in.set()
            second_in.wait(timeout=30)
            seen["first"] = current_engine()
        first_out.set()

    def second():
        first_in.wait(timeout=30)
        with active_engine(second_engine):
            second_in.set()
            first_out.wait(timeout=30)
            seen["second"] = current_engine()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["first"] is first_engine and seen["second"] is second_engine
