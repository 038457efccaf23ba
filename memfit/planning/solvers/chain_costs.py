"""The costs of a chain: the problem ``memfit.planning.solvers.chain`` solves, on its own so that the
solver and its DP tables (``memfit.planning.solvers._chain_tables``) both read it without importing
each other. The model is described in ``memfit.planning.solvers.chain``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainCosts:
    """Per-step costs of a chain; index i - 1 describes step i (a_i, g_i, F_i, B_i).

    Args:
        forward_time_s: run time of F_1..F_l.
        backward_time_s: run time of B_1..B_l.
        activation_bytes: bytes of a_1..a_l (a_0 is resident and not listed).
        gradient_bytes: bytes of g_1..g_l; empty means zeros (activation-only accounting, as in
            the pebble game).
        output_bytes: bytes each B_i allocates that live to the end (weight gradients); empty
            means zeros.
        loss_bytes: bytes of the loss, allocated by ``Loss`` and live to the end.
        in_place_forward: when True, a ``Forward(i)`` followed at once by ``Free(i - 1)``
            overwrites a_{i-1} (the sliding pebble game, and revolve's working state); the
            default False counts a_{i-1} and a_i together, as memfit's program-order liveness
            does.
    """

    forward_time_s: tuple[float, ...]
    backward_time_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    gradient_bytes: tuple[int, ...] = ()
    output_bytes: tuple[int, ...] = ()
    loss_bytes: int = 0
    in_place_forward: bool = False

    def __post_init__(self) -> None:
        steps = len(self.forward_time_s)
        if steps < 1:
            raise ValueError("a chain needs at least one step")
        fields = {
            "forward_time_s": tuple(float(v) for v in self.forward_time_s),
            "backward_time_s": tuple(float(v) for v in self.backward_time_s),
            "activation_bytes": tuple(int(v) for v in self.activation_bytes),
            "gradient_bytes": tuple(int(v) for v in self.gradient_bytes) or (0,) * steps,
            "output_bytes": tuple(int(v) for v in self.output_bytes) or (0,) * steps,
        }
        for name, values in fields.items():
            if len(values) != steps:
                raise ValueError(f"{name} has {len(values)} entries, expected one per step ({steps})")
            if min(values) < 0:
                raise ValueError(f"{name} must not be negative")
            object.__setattr__(self, name, values)
        if self.loss_bytes < 0:
            raise ValueError("loss_bytes must not be negative")

    @property
    def steps(self) -> int:
        return len(self.forward_time_s)

    @staticmethod
    def uniform(steps: int, activation_bytes: int = 1, time_s: float = 1.0,
                in_place_forward: bool = False) -> ChainCosts:
        """Unit chain: every F_i takes ``time_s``, B_i twice that, activations ``activation_bytes``."""
        return ChainCosts((time_s,) * steps, (2 * time_s,) * steps, (activation_bytes,) * steps,
                          in_place_forward=in_place_forward)
