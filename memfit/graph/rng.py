"""Random-state ops, so a recomputed random op (dropout) draws exactly what the forward drew.

In a rewritten graph::

    memfit.rng_save(x, key=3)          # right before the forward's random op
    mask = native_dropout(x, ...)
    ...
    memfit.rng_replay_begin(x, key=3)  # set the saved state (the current one is stashed)
    mask_again = native_dropout(x, ...)
    memfit.rng_replay_end(x, key=3)    # put the stashed state back: later draws are unchanged

Each op takes an *anchor* tensor only to know its device and its place in the program. The ops
return nothing and are registered as side-effectful so ``eliminate_dead_code`` keeps them.
"""

from __future__ import annotations

import torch
import torch.fx.node

from memfit.runtime.streams import current_engine


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


@torch.library.custom_op("memfit::rng_save", mutates_args=())
def rng_save(anchor: torch.Tensor, key: int) -> None:
    """Remember the generator state of ``anchor``'s device under ``key``."""
    current_engine("memfit::rng_save").rng_states[key] = _get_state(anchor.device)


@torch.library.custom_op("memfit::rng_replay_begin", mutates_args=())
def rng_replay_begin(anchor: torch.Tensor, key: int) -> None:
    """Stash the current generator state and set the one saved under ``key``."""
    states = current_engine("memfit::rng_replay_begin").rng_states
    states[-1 - key] = _get_state(anchor.device)
    _set_state(anchor.device, states[key])


@torch.library.custom_op("memfit::rng_replay_end", mutates_args=())
def rng_replay_end(anchor: torch.Tensor, key: int) -> None:
    """Restore the state stashed by ``rng_replay_begin``, so later random ops are unaffected."""
    _set_state(anchor.device, current_engine("memfit::rng_replay_end").rng_states.pop(-1 - key))


for _op in (rng_save, rng_replay_begin, rng_replay_end):
    _op.register_fake(lambda anchor, key: None)

RNG_SAVE = torch.ops.memfit.rng_save.default
RNG_REPLAY_BEGIN = torch.ops.memfit.rng_replay_begin.default
RNG_REPLAY_END = torch.ops.memfit.rng_replay_end.default
torch.fx.node._side_effectful_functions.update({RNG_SAVE, RNG_REPLAY_BEGIN, RNG_REPLAY_END})
