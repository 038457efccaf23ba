"""The memfit swap ops: round trips, fake implementations, the engine check, and DCE."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.ops.host import is_host_storage
from memfit.ops.swap import SWAP_IN, SWAP_OUT, WAIT
from memfit.runtime.streams import CopyEngine, active_engine

CPU = torch.device("cpu")


def _bits(tensor):
    """The raw bytes, so that NaNs and signed zeros compare too."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    yield torch.randn(5, 7, generator=generator)
    yield torch.randn(5, 7, generator=generator).to(torch.bfloat16)
    yield torch.randint(-(2**40), 2**40, (3, 4, 5), generator=generator)
    yield torch.randn(6, 8, generator=generator).t()[::2]  # non-contiguous view
    yield torch.tensor(float("nan"))  # a 0-d tensor, and NaN bits survive


@pytest.mark.parametrize("tensor", list(_inputs()), ids=["float32", "bfloat16", "int64", "strided", "scalar"])
def test_swap_round_trip_is_bitwise(tensor):
    with active_engine(CopyEngine(CPU)):
        host = SWAP_OUT(tensor, 0)
        back = SWAP_IN(host, 0, 1, CPU)
        WAIT(back, 1)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(_bits(back), _bits(tensor))
    assert is_host_storage(host.untyped_storage())
    assert not is_host_storage(back.untyped_storage())
    # outputs never alias inputs (the custom_op rule)
    assert host.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert back.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()


def test_fake_impls_give_shapes_dtypes_devices():
    with FakeTensorMode():
        activation = torch.empty(4, 3, dtype=torch.bfloat16)
        host = SWAP_OUT(activation, 0)
        back = SWAP_IN(host, 0, 1, torch.device("cuda", 0))
        assert WAIT(back, 1) is None
    assert (host.shape, host.dtype, host.device) == ((4, 3), torch.bfloat16, CPU)
    assert (back.shape, back.dtype, back.device) == ((4, 3), torch.bfloat16, torch.device("cuda", 0))


@pytest.mark.parametrize("call", [
    lambda t: SWAP_OUT(t, 0),
    lambda t: SWAP_IN(t, 0, 1, CPU),
    lambda t: WAIT(t, 1),
], ids=["swap_out", "swap_in", "wait"])
def test_ops_outside_an_engine_raise_a_clear_error(call):
    with pytest.raises(RuntimeError, match="outside a copy engine.*active_engine"):
        call(torch.ones(3))


def test_engine_context_nests_and_restores():
    outer, inner = CopyEngine(CPU), CopyEngine(CPU)
    from memfit.runtime.streams import current_engine

    with active_engine(outer):
        with active_engine(inner):
            assert current_engine() is inner
        assert current_engine() is outer
    with pytest.raises(RuntimeError):
        current_engine()


def test_wait_survives_dead_code_elimination():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    host = graph.call_function(SWAP_OUT, (x, 0))
    back = graph.call_function(SWAP_IN, (host, 0, 1, CPU))
    wait = graph.call_function(WAIT, (back, 1))
    unused = graph.call_function(torch.ops.aten.sin.default, (x,))
    graph.output(x)
    graph.eliminate_dead_code()
    nodes = list(graph.nodes)
    assert wait in nodes and back in nodes and host in nodes
    assert unused not in nodes
    assert wait.is_impure()


def test_a_swap_moves_the_whole_storage_with_its_layout():
    """A root that leaves gaps or an offset in its storage (``aten.copy`` into a slice,
    ``slice_scatter`` into a slice) comes back with the same shape, strides and offset over a
    copy of every byte of the storage: the bytes the CostGraph counts, and views of it agree."""
    base = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    gapped = base[:, 1:]  # strides (32, 1), offset 1: not dense, not from offset 0
    with active_engine(CopyEngine(CPU)):
        host = SWAP_OUT(gapped, 0)
        back = SWAP_IN(host, 0, 1, CPU)
    for moved in (host, back):
        assert (moved.shape, moved.stride(), moved.storage_offset()) == ((4, 31), (32, 1), 1)
        assert moved.untyped_storage().nbytes() == base.untyped_storage().nbytes()
        assert torch.equal(moved.as_strided(base.shape, base.stride(), 0), base)
    assert back.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_a_swap_out_with_strides_converts_the_layout_while_it_copies():
    """Inductor may lay a value out unlike the graph (``memfit.lowering.inductor``): the host copy
    takes the strides it is given, the values are the tensor's, and the fake agrees."""
    channels_last = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    stride = [60, 20, 5, 1]
    with active_engine(CopyEngine(CPU)):
        host = SWAP_OUT(channels_last, 0, stride)
        back = SWAP_IN(host, 0, 1, CPU)
    assert host.stride() == tuple(stride) and back.stride() == tuple(stride)
    assert torch.equal(back, channels_last) and is_host_storage(host.untyped_storage())
    with FakeTensorMode():
        fake = SWAP_OUT(torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
                        0, stride)
    assert fake.stride() == tuple(stride) and fake.device == CPU
