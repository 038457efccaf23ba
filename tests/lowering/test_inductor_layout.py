"""layout_copy_bytes: the channels-last copies inductor makes of a region's convolution inputs.

Checked on a traced program (no inductor compile): a graph input a convolution reads is copied
where it is not channels last already; values made inside the graph are not.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.graph import GraphLowering
from torch.fx.experimental.proxy_tensor import make_fx

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
