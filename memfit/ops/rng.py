"""Random-state ops, so a recomputed random op (dropout) draws exactly what the forward drew.

In a rewritten graph::

    state = memfit.rng_save(x)                     # right before the forward's random op
    mask = native_dropout(x, ...)
    ...
    stashed = memfit.rng_replay_begin(x, state)    # set the saved state, keep the current one
    mask_again = native_dropout(x, ...)
    memfit.rng_replay_end(x, stashed)              # put it back: later draws are unchanged

Each op takes an *anchor* tensor only to know its device and its place in the program. The
replay ops change the generator, so they are registered as side-effectful and
``eliminate_dead_code`` keeps them.
"""

from __future__ import annotations

import torch
import torch.fx.node
from torch.utils._python_dispatch import _disable_current_modes

from memfit.ops.host import host_copy
from memfit.ops.swap import define


def is_random(node: torch.fx.Node) -> bool:
    """Whether an fx node draws from a random generator (PyTorch tags such ops)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device).set_rng_state(state, device)


def _state_bytes(device: torch.device) -> int:
    with _disable_current_modes():
        return _get_state(device).numel()


def rng_save(anchor: torch.Tensor) -> torch.Tensor:
    """The generator state of ``anchor``'s device, as a host-tier byte tensor.

    Note:
        The state is a value of the program, not an entry in a table: under ``torch.compile`` it
        is saved for the backward module like any activation, so a region run twice before its
        backward (two micro-batches) replays each forward's own draws. Generator states live in
        host memory on every device, so it is a host buffer, never counted as device bytes.
    """
    return host_copy(_get_state(anchor.device))


def _rng_save_fake(anchor: torch.Tensor) -> torch.Tensor:
    return torch.empty(_state_bytes(anchor.device), dtype=torch.uint8, device="cpu")


def rng_replay_begin(anchor: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Set the generator to ``state``; return the state it had (for ``rng_replay_end``)."""
    stashed = host_copy(_get_state(anchor.device))
    _set_state(anchor.device, state)
    return stashed


def _rng_replay_begin_fake(anchor: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(state)


def rng_replay_end(anchor: torch.Tensor, stashed: torch.Tensor) -> None:
    """Restore the state stashed by ``rng_replay_begin``, so later random ops are unaffected."""
    _set_state(anchor.device, stashed)


def _rng_replay_end_fake(anchor: torch.Tensor, stashed: torch.Tensor) -> None:
    return None


RNG_SAVE = define("rng_save(Tensor anchor) -> Tensor", rng_save, _rng_save_fake)
RNG_REPLAY_BEGIN = define("rng_replay_begin(Tensor anchor, Tensor state) -> Tensor",
                          rng_replay_begin, _rng_replay_begin_fake)
RNG_REPLAY_END = define("rng_replay_end(Tensor anchor, Tensor stashed) -> ()", rng_replay_end,
                        _rng_replay_end_fake)
torch.fx.node._side_effectful_functions.update({RNG_REPLAY_BEGIN, RNG_REPLAY_END})
