"""A strategy's parameters as a frozen dataclass that checks itself when built.

Why: a config is the one list of a strategy's parameters, their defaults and their checks, next
to the code that reads them; the registry builds it to check parameters without a graph
(``register(name, config=...)``), so a mistake fails when the strategy is named. Every registered
strategy has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self


@dataclass(frozen=True)
class StrategyConfig:
    """The base of a strategy's config: subclasses add their fields and a ``__post_init__`` that
    raises ``ValueError`` naming the accepted values."""

    strategy: ClassVar[str]  # the registered name, for the error messages
    # the compilers whose programs the strategy plans (fused-chains: inductor's only)
    compilers: ClassVar[tuple[str, ...]] = ("aot_eager", "inductor")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """The config of these user parameters.

        Raises:
            ValueError: for an unknown parameter (naming the accepted ones) or a bad value.
        """
        unknown = sorted(set(params) - {field.name for field in fields(cls)})
        if unknown:
            raise cls.unknown_parameters(unknown)
        return cls(**cls.normalised(params))

    @classmethod
    def normalised(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The known parameters in the form the fields hold (default: as given); a subclass
        that accepts several forms of a value (a string for a list of one) converts them here,
        before its ``__post_init__`` checks them."""
        return dict(params)

    @classmethod
    def unknown_parameters(cls, unknown: list[str]) -> ValueError:
        """The error for parameters the strategy does not take."""
        names = [f"{field.name}=" for field in fields(cls)]
        if not names:
            return ValueError(f"strategy {cls.strategy!r} takes no parameters, got {unknown}")
        accepted = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        return ValueError(f"strategy {cls.strategy!r} got unknown parameters {unknown}; "
                          f"it accepts {accepted}")


def positive_int(name: str, value: object, unit: str = "") -> None:
    """Raise unless ``value`` is an int >= 1 (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{unit}, got {value!r}")
