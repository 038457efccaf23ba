"""layout_copy_bytes: the channels-last copies inductor makes of a region's convolution inputs.

Checked on a traced program (no inductor compile): a graph input a convolution reads is copied
where it is not channels last already; values made inside the graph are not.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.graph import GraphLowering
from torch.fx.experimental.proxy_tensor import make_fx

import memfit.ops.swap  # noqa: F401  (registers torch.ops.memfit.*)
from memfit.lowering.inductor import layout_copy_bytes


def two_convolutions(x, weight, pointwise_weight):
    """A 3x3 convolution of the input, then a 1x1 convolution of its output."""
    hidden = torch.nn.functional.conv2d(x, weight, padding=1)
    return torch.nn.functional.conv2d(hidden.relu(), pointwise_weight)


def test_inputs_read_by_convolutions_are_counted_once_each():
    x, weight = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    pointwise_weight = torch.randn(5, 4, 1, 1)  # channels last already: its layout is the same
    traced = make_fx(two_convolutions)(x, weight, pointwise_weight)
    if not GraphLowering.decide_layout_opt(traced, is_inference=False):
        pytest.skip("inductor lays this program out as traced (no mkldnn): nothing is copied")
    assert layout_copy_bytes(traced) == x.nbytes + weight.nbytes


def test_no_copies_where_layout_optimization_is_off():
    from torch._inductor import config as inductor_config

    arguments = (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(5, 4, 1, 1))
    traced = make_fx(two_convolutions)(*arguments)
    with inductor_config.patch(layout_optimization=False):
        assert layout_copy_bytes(traced) == 0


def test_a_symbolic_channels_last_host_copy_is_computed_where_it_runs():
    """At symbolic image sizes the channels-last strides of a convolution's swapped output are
    symbolic: the swap-out gets them as ops on the value's sizes (a graph holding the sizes
    themselves made torch warn at every compile), and the host copy is laid out channels last
    at whatever size runs."""
    import warnings

    from memfit.lowering.inductor import host_copies_in_saved_layout
    from memfit.runtime.streams import CopyEngine, active_engine

    def saved(x, weight, pointwise_weight):
        hidden = torch.nn.functional.conv2d(x, weight, padding=1).relu()
        host = torch.ops.memfit.swap_out.default(hidden, 0, list(hidden.stride()))
        return host, torch.nn.functional.conv2d(hidden, pointwise_weight)

    weights = (torch.randn(4, 3, 3, 3), torch.randn(5, 4, 1, 1))
    traced = make_fx(saved, tracing_mode="symbolic")(torch.randn(2, 3, 8, 8), *weights)
    swap_out = next(node for node in traced.graph.nodes
                    if node.target is torch.ops.memfit.swap_out.default)
    swap_out.meta["memfit"] = {"kind": "swap_out", "tensor": "hidden", "buffer": ""}
    if not GraphLowering.decide_layout_opt(traced, is_inference=False):
        pytest.skip("inductor lays this program out as traced (no mkldnn): nothing is copied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_copies_in_saved_layout(traced) == 1
    assert not any(isinstance(step, torch.SymInt) for step in swap_out.args[2])
    with active_engine(CopyEngine("cpu")):
        for size in (8, 6):
            host, _ = traced(torch.randn(2, 3, size, size), *weights)
            assert host.is_contiguous(memory_format=torch.channels_last), size
            assert host.shape == (2, 4, size, size)
