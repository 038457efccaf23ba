"""The frame an FSDP2 unit's forward runs in when memfit compiles it
(``memfit.fitting.dynamo_settings``), and whose code Dynamo enters
(``memfit.compiler.unplanned.entry_codes``)."""

from __future__ import annotations

from typing import Any

import torch


def unit_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A unit's own ``forward``, in a frame Dynamo compiles whose ``self`` is the unit (where
    ``memfit.compiler.graph_breaks.compiling_site`` finds which unit a region is)."""
    return type(self).forward(self, *args, **kwargs)
