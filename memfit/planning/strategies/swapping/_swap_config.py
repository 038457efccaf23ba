"""``swap``'s parameters (TFLMS's Table 2) as a frozen config that checks itself.

On its own so that the strategy (``memfit.planning.strategies.swapping.tflms``) and its tuner
(``memfit.planning.strategies.swapping._swap_tune``), which both read it, do not import each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from memfit.planning.strategies._strategy_config import StrategyConfig
from memfit.planning.strategies.swapping._swap_control import CTRLD_STRATEGIES, CtrldStrategy

NAME_LISTS = ("starting_op_names", "incl_scopes", "excl_scopes", "incl_types", "excl_types")


@dataclass(frozen=True)
class SwapConfig(StrategyConfig):
    """The parameters of TFLMS's Table 2 (those that apply to a captured step), checked when built."""

    strategy: ClassVar[str] = "swap"
    threshold: int = 1  # rewrite producer -> consumer only if the consumer runs > this many ops later
    n_tensors: int = -1  # how many tensors to swap, in BFS order from the start; -1: all, 0: none
    starting_scope: str | None = None  # module-path glob of the BFS start; None: the graph entry
    starting_op_names: tuple[str, ...] = ()  # op names of the BFS start (with starting_scope: both)
    incl_scopes: tuple[str, ...] = ()  # if non-empty, swap only outputs of ops in these scopes
    excl_scopes: tuple[str, ...] = ()  # never swap outputs of ops in these scopes (wins)
    incl_types: tuple[str, ...] = ()  # op kinds ("aten.mm", "mm") or module class names
    excl_types: tuple[str, ...] = ()
    lb: int = 1  # 1: the latest swap-in; larger prefetches earlier (less stall, more memory)
    ub: int = 10000
    ctrld_strategy: CtrldStrategy = "chain_rule"
    fuse_swapins: bool = False  # TFLMS's default: one swap-in per rewritten consumer
    fuse_distance: int = 10  # ops between consecutive consumers that share one fused swap-in
    swap_branches: bool = False  # also rewrite long forward -> forward edges (U-Net skips)
    branch_threshold: int = 0  # with swap_branches: forward edges longer than this are rewritten

    def __post_init__(self) -> None:
        for name, minimum in (("threshold", 0), ("n_tensors", -1), ("lb", 0), ("ub", 0),
                              ("fuse_distance", 0), ("branch_threshold", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"swap: {name} must be an int >= {minimum}, got {value!r}")
        if self.lb > self.ub:
            raise ValueError(f"swap: lb ({self.lb}) must not exceed ub ({self.ub})")
        if self.ctrld_strategy not in CTRLD_STRATEGIES:
            raise ValueError(f"swap: ctrld_strategy must be one of {list(CTRLD_STRATEGIES)}, "
                             f"got {self.ctrld_strategy!r}")
        for name in ("fuse_swapins", "swap_branches"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"swap: {name} must be True or False, got {getattr(self, name)!r}")
        if self.starting_scope is not None and not isinstance(self.starting_scope, str):
            raise ValueError(f"swap: starting_scope must be a glob string or None, "
                             f"got {self.starting_scope!r}")

    @classmethod
    def normalised(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The name lists as tuples: a single string counts as a list of one.

        Raises:
            ValueError: for a name list that is neither a string nor a list of strings.
        """
        return {name: _names(name, value) if name in NAME_LISTS else value
                for name, value in params.items()}

    def params(self) -> dict[str, Any]:
        return asdict(self)


def _names(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        items = tuple(value)
        if all(isinstance(item, str) for item in items):
            return items
    raise ValueError(f"swap: {name} must be a string or a list of strings, got {value!r}")
