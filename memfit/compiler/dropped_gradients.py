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
    >>> if note_backward(seen, model): ...  # at its backward's start: plan its program again
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfit.runtime.resident import has_gradients, local_tensor


@dataclass
class GradientsSeen:
    """What the loop did with the model's gradients between a compiled code's forward and its
    backward.

    Args:
        at_forward: the model had gradients at its latest forward whose backward has not run.
        drops: ``True``: a backward found every one of them dropped; ``False``: one found some
            kept (for good); ``None``: not seen yet (no gradient existed at a forward).
    """

    at_forward: bool = False
    drops: bool | None = None


def gradient_bytes(model: torch.nn.Module | None, device: torch.device) -> int:
    """Bytes of the ``.grad`` storages of ``model``'s parameters on ``device``, each once."""
    if model is None:
        return 0
    storages = {StorageWeakRef(local_tensor(p.grad).untyped_storage()):
                local_tensor(p.grad).untyped_storage().nbytes() for p in model.parameters()
                if p.grad is not None and p.grad.device == device}
    return sum(storages.values())


def note_forward(seen: GradientsSeen, model: torch.nn.Module | None) -> None:
    """At a forward: the gradients alive now (not once a backward found them kept)."""
    if seen.drops is not False:
        seen.at_forward = has_gradients(model)


def note_backward(seen: GradientsSeen, model: torch.nn.Module | None) -> bool:
    """At a backward's start: whether the loop dropped the gradients alive at the forward.
    ``True`` where plans made before counted them otherwise and are made again: the first
    backward to show them dropped (counted over the backward too), or the first to show them
    kept after that (counted over the forward only)."""
    if seen.drops is False or not seen.at_forward:
        return False
    drops = not has_gradients(model)
    changed = drops if seen.drops is None else not drops
    seen.drops = drops
    seen.at_forward = False
    return changed


def dropped_gradient_bytes(seen: GradientsSeen, model: torch.nn.Module | None,
                           device: torch.device) -> int:
    """The model's gradients alive now that the loop drops before the backward: counted over a
    plan's forward only; 0 until a backward showed them dropped."""
    return gradient_bytes(model, device) if seen.drops else 0
