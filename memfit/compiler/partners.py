"""Other fitted models that share the device with a fitted model in the same loop.

A GAN's generator and discriminator, a teacher and a student, two towers: each fitted with the
device's budget, each region's plan must leave room for what the others keep resident (their
parameters, gradients and optimizer state), which a CPU's eager watch does not see (they are
made before it starts and read inside compiled code). Two fitted models are partners once one
is called while a forward of the other awaits its backward: their iterations interleave. Models
run one after the other (alternatives compared in turn) are not.
"""

from __future__ import annotations

import weakref
from typing import Any

_FITTED: weakref.WeakSet[Any] = weakref.WeakSet()  # backends of models memfit.fit fitted
_PARTNERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def note_fitted(backend: Any) -> None:
    """``backend`` belongs to a model ``memfit.fit`` fitted now."""
    _FITTED.add(backend)


def note_call(backend: Any) -> None:
    """``backend``'s model is being called now: it becomes the partner of every other fitted
    model with a forward whose backward has not run yet, and they its."""
    if backend not in _FITTED:
        return
    for other in list(_FITTED):
        if other is not backend and any(region.open_forwards for region in other.regions):
            _PARTNERS.setdefault(backend, weakref.WeakSet()).add(other)
            _PARTNERS.setdefault(other, weakref.WeakSet()).add(backend)


def partners_of(backend: Any) -> list[tuple[Any, list]]:
    """(model, optimizers) of each partner of ``backend`` (none for a backend that
    ``memfit.fit`` did not make)."""
    return [(other.model, list(other.optimizers)) for other in list(_PARTNERS.get(backend, ()))
            if other.model is not None]
