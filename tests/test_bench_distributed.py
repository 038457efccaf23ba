"""The 2-rank bench: figures over ranks, and the section's core run on a tiny GPT-2."""

import pytest
import torch

from bench import distributed

TINY_GPT2 = distributed.DistModel(
    "tiny GPT-2", "gpt2", (("layers", 2), ("width", 32), ("heads", 2), ("vocab", 64),
                           ("sequence", 32), ("batch_size", 2)), ("GPT2Block",))
FSDP_WAYS = tuple(way for way in distributed.WAYS if way.engine == "fsdp")[:3]


def _result(peaks, times, losses=(1.0, 2.0), budget=None):
    return distributed.RankResult([torch.tensor(loss) for loss in losses], list(peaks),
                                  list(times), budget)


def test_figures_take_the_larger_peak_and_the_slower_rank():
    eager, planned = distributed.WAYS[0], distributed.WAYS[2]
    ranks = [{eager.label: _result([100, 120], [1.0, 3.0, 2.0]),
              planned.label: _result([90, 95], [2.0, 4.0, 9.0], budget=100)},
             {eager.label: _result([110, 100], [4.0, 4.0, 4.0]),
              planned.label: _result([101, 80], [3.0, 1.0, 3.0], budget=100)}]
    figures = distributed.way_figures("m", planned, ranks)
    assert figures.peak_bytes == 101  # rank 1's first measured iteration
    assert figures.within_budget is False
    assert figures.step_s == 4.0 and figures.eager_step_s == 4.0  # medians: 4 and 3; 2 and 4
    assert figures.steps_s == (3.0, 4.0, 9.0)
    assert figures.losses_bitwise and figures.wall_s == 0.0
    row = distributed.figures_row(figures)
    assert len(row) == len(distributed.HEADERS) and row[4] == "**no**" and row[6] == "1.00x"
    assert distributed.way_figures("m", eager, ranks).within_budget is None


def test_a_loss_one_bit_off_is_not_bitwise():
    eager, checkpointed = distributed.WAYS[0], distributed.WAYS[1]
    off = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()
    ranks = [{eager.label: _result([1], [1.0]), checkpointed.label: _result([1], [1.0])},
             {eager.label: _result([1], [1.0]),
              checkpointed.label: _result([1], [1.0], losses=(1.0, off))}]
    assert not distributed.way_figures("m", checkpointed, ranks).losses_bitwise


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_two_ranks_of_a_tiny_gpt2_under_fsdp2():
    pytest.importorskip("transformers")
    figures, _failures = distributed.distributed_figures(lambda _: None, [TINY_GPT2], FSDP_WAYS)
    assert [f.way for f in figures] == list(FSDP_WAYS)
    eager, checkpointed, planned = figures
    assert all(f.peak_bytes > 0 and f.step_s > 0 and f.losses_bitwise for f in figures)
    assert checkpointed.peak_bytes < eager.peak_bytes  # recomputing each block saves less
    # memfit's budget is checkpointing's measured peak, or the smallest peak it refused for
    asked = [*planned.refused_bytes, planned.budget_bytes]
    assert asked[0] == checkpointed.peak_bytes
    assert eager.budget_bytes is None and checkpointed.budget_bytes is None
    lines = distributed.reading(figures)
    assert len(lines) == 1 and "memfit" in lines[0] and "checkpointing" in lines[0]
