"""Other fitted models that share the device with a fitted model in the same loop.

A GAN's generator and discriminator, a teacher and a student, two towers: each fitted with the
device's budget, each region's plan must leave room for what the others keep resident (their
parameters, gradients and optimizer state), which a CPU's eager watch does not see (they are
made before it starts and read inside compiled code). A fitted model's partners are the other
fitted models fitted or called after it was fitted: a model fitted and last used before it (an
earlier experiment still referenced) is not one.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_SERIAL = itertools.count(1)
_FITTED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_LAST_SEEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def note_fitted(backend: Any) -> None:
    """``backend`` belongs to a model ``memfit.fit`` fitted now."""
    _FITTED[backend] = _LAST_SEEN[backend] = next(_SERIAL)


def note_call(backend: Any) -> None:
    """``backend``'s model is being called now."""
    if backend in _FITTED:
        _LAST_SEEN[backend] = next(_SERIAL)


def partners_of(backend: Any) -> list[tuple[Any, list]]:
    """(model, optimizers) of each other fitted model fitted or called since ``backend``'s model
    was fitted; none for a backend not made by ``memfit.fit``."""
    since = _FITTED.get(backend)
    if since is None:
        return []
    return [(other.model, list(other.optimizers)) for other, seen in list(_LAST_SEEN.items())
            if other is not backend and seen > since and other.model is not None]
