"""Gradients the loop drops between a forward and its backward.

PyTorch's own examples step in this order: ``loss = loss_fn(model(x), y)``,
``optimizer.zero_grad()``, ``loss.backward()``, ``optimizer.step()``. The previous step's
gradients are then alive during the forward and gone (``set_to_none``) before the backward
makes the new ones, so they never coexist. A plan that counts them as resident over the whole
region counts the model's gradients twice in its backward; memfit counts them over the forward
only (``with_dropped_gradients``) once a backward has shown the loop drops them, and as resident
for good once one has shown them kept (accumulation across micro-batches adds into them). Seen
per program (``Region.program``): a GAN's discriminator drops its gradients before the backward
of its calls on real and generated samples, and keeps them through the generator's backward,
which runs through its third call (another program: its input needs a gradient).

Example:
    >>> note_forward(seen, model)  # at each forward of a region
    >>> if note_backward(seen, model): planner.replan_regions()  # at its backward's start
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.runtime.resident import local_tensor


@dataclass
class GradientsSeen:
    """What the loop did with the model's gradients between a compiled code's forward and its
    backward.

    Args:
        at_forward_bytes: the model's gradients alive at its latest forward whose backward has
            not run yet.
        drops: ``True``: a backward found every one of them dropped; ``False``: one found some
            kept (for good); ``None``: not seen yet (no gradient existed at a forward).
    """

    at_forward_bytes: int = 0
    drops: bool | None = None


def gradient_bytes(model: torch.nn.Module | None, device: torch.device | None = None) -> int:
    """Bytes of the ``.grad`` storages of ``model``'s parameters (on ``device``), each once."""
    if model is None:
        return 0
    storages: dict[StorageWeakRef, int] = {}
    for parameter in model.parameters():
        grad = parameter.grad
        if grad is not None and (device is None or grad.device == device):
            storage = local_tensor(grad).untyped_storage()
            storages.setdefault(StorageWeakRef(storage), storage.nbytes())
    return sum(storages.values())


def note_forward(seen: GradientsSeen, model: torch.nn.Module | None) -> None:
    """At a forward: the gradients alive now (not once a backward found them kept)."""
    if seen.drops is not False:
        seen.at_forward_bytes = gradient_bytes(model)


def note_backward(seen: GradientsSeen, model: torch.nn.Module | None) -> bool:
    """At a backward's start: whether the loop dropped the gradients alive at the forward.
    ``True`` where plans made before counted them otherwise and are made again: the first
    backward to show them dropped (counted over the backward too), or the first to show them
    kept after that (counted over the forward only)."""
    if seen.drops is False or not seen.at_forward_bytes:
        return False
    drops = gradient_bytes(model) == 0
    changed = drops if seen.drops is None else not drops
    seen.drops = drops
    seen.at_forward_bytes = 0
    return changed


def dropped_gradient_bytes(seen: GradientsSeen, model: torch.nn.Module | None,
                           device: torch.device) -> int:
    """The model's gradients alive now that the loop drops before the backward: counted over a
    plan's forward only; 0 until a backward showed them dropped."""
    return gradient_bytes(model, device) if seen.drops else 0
