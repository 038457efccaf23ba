"""Other fitted models that share the device with a fitted model in the same loop.

A GAN's generator and discriminator, a teacher and a student, two towers: each fitted with the
device's budget, each region's plan must leave room for what the others keep resident (their
parameters, gradients and optimizer state), which a CPU's eager watch does not see (they are
made before it starts and read inside compiled code). Two fitted models are partners once one
is called while a forward of the other, called since the first was fitted, awaits its
backward: their iterations interleave. Models run one after the other (alternatives compared
in turn), a model fitted anew (its earlier fitting) and forwards left open by an error before
a model was fitted are not.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_SERIAL = itertools.count(1)
_FITTED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> when fitted
_CALLED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> last called
_PARTNERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def note_fitted(backend: Any) -> None:
    """``backend`` belongs to a model ``memfit.fit`` fitted now."""
    _FITTED[backend] = next(_SERIAL)


def note_call(backend: Any) -> None:
    """``backend``'s model is being called now: it becomes the partner of every other fitted
    model, called since it was fitted, with a forward whose backward has not run yet."""
    fitted = _FITTED.get(backend)
    if fitted is None:
        return
    _CALLED[backend] = next(_SERIAL)
    for other, called in list(_CALLED.items()):
        if (other is backend or called < fitted or other.model is backend.model
                or not any(region.open_forwards for region in other.regions)):
            continue
        _PARTNERS.setdefault(backend, weakref.WeakSet()).add(other)
        _PARTNERS.setdefault(other, weakref.WeakSet()).add(backend)


def partners_of(backend: Any) -> list[tuple[Any, list]]:
    """(model, optimizers) of each partner of ``backend`` (none for a backend that
    ``memfit.fit`` did not make), less the optimizers ``backend`` counts itself."""
    own = {id(optimizer) for optimizer in backend.optimizers}
    return [(other.model, [o for o in other.optimizers if id(o) not in own])
            for other in list(_PARTNERS.get(backend, ())) if other.model is not None]
