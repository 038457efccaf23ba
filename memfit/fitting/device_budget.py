"""The budget of ``memfit.fit(model)`` when none is given, on CUDA: the device's free memory at the
model's first call, less a margin. On a CPU there is none (``keep``, no limit).

The budget bounds the bytes torch's allocator hands out at the peak (``max_memory_allocated``),
while the device runs out when the allocator's *reserved* segments and what lives outside them
fill it. The margin covers that difference:

- the caching allocator rounds each block up and cannot always reuse freed blocks for larger
  requests (fragmentation), so its reserved bytes run ahead of its allocated ones;
- cuBLAS and cuDNN make their handles and workspaces at their first use, and lazy module loading
  grows the CUDA context as each new kernel is first launched: after the budget is read;
- a distributed job's communicator allocates its buffers at its first collective.

``MARGIN_FRACTION`` of what is usable, at least ``MARGIN_MIN_BYTES``. Give ``budget=`` to choose
another number.

Example:
    >>> fit_device(planner, torch.device("cuda:0"), None, {})  # planner.choose_budget(...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.data.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Mapping

    from memfit.compiler.backend import Backend

MARGIN_FRACTION = 0.10  # of the usable bytes: fragmentation grows with the number of blocks
MARGIN_MIN_BYTES = 512 * 2**20  # library workspaces and context growth come whatever the size


def usable_device_bytes(device: torch.device) -> int:
    """Bytes this process's tensors may reach on ``device`` at their peak: what the driver has
    free plus what torch's caching allocator holds already (allocated or cached)."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return free_bytes + torch.cuda.memory_reserved(device)


def automatic_budget(usable_bytes: int) -> tuple[int, int]:
    """(budget, margin) in bytes for ``usable_bytes``: the usable bytes less the margin.

    Raises:
        ValueError: when the margin leaves nothing, saying to give ``budget=``.
    """
    margin_bytes = max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * usable_bytes))
    if usable_bytes <= margin_bytes:
        raise ValueError(
            f"memfit: the device has {format_bytes(usable_bytes)} usable at the model's first "
            f"call, no more than the {format_bytes(margin_bytes)} margin an automatic budget "
            "keeps free; give memfit.fit a budget= in bytes")
    return usable_bytes - margin_bytes, margin_bytes


def fit_device(planner: Backend, device: torch.device, strategy: str | None,
               params: Mapping[str, Any]) -> None:
    """On CUDA, give ``planner`` the automatic budget of ``device`` and the strategy a budget
    takes (``strategy``, else ``auto``, with its ``params``); the report says the number. On another device,
    nothing changes. In a distributed job every rank takes the smallest rank's budget."""
    from memfit.planning.strategies import resolve_budget_and_strategy
    from memfit.runtime.ranks import agree_max

    if device.type != "cuda":
        return
    usable = -agree_max([-usable_device_bytes(device)])[0]
    budget_bytes, margin_bytes = automatic_budget(usable)
    budget, chosen = resolve_budget_and_strategy(budget_bytes, strategy, params,
                                                 planner.options.compiler)
    planner.choose_budget(budget, chosen, note=(
        f"budget: {format_bytes(budget_bytes)}, chosen by memfit: the device's free memory at the "
        f"first call ({format_bytes(usable)}, torch's cached bytes included) less a "
        f"{format_bytes(margin_bytes)} margin for the allocator's fragmentation, library "
        "workspaces and the CUDA context's growth (give budget= to choose)"))
