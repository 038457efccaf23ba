"""The planner's tuning constants in one place, each with the reason that chose it.

A tuning constant trades a plan's quality against planning time, or picks between plans; units,
formats and API limits are not tuning and stay where they are used. Modules read these from
``TUNING``; the module-level names that other modules, tests or benchmarks import
(``milp.NODE_LIMIT``, ``optimal_recompute.MILP_MAX_OPS`` and ``POOR_MAX_FORWARD_OPS``) are
references to it.

Note:
    The compiler's settings are not here: the closed loop has its own frozen ``ClosedLoop``
    (``memfit.compiler.closed_loop``), and the backend's re-plan bounds live in
    ``memfit.compiler.backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["TUNING", "Tuning"]


@dataclass(frozen=True)
class Tuning:
    """The planner's tuning constants (``TUNING``); each comment says what chose the value."""

    # --- solvers: the MILPs (solvers/milp.py, solvers/_milp_swap_model.py)
    # HiGHS's branch-and-bound nodes: enough for a small MLP to prove its optimum; a node of
    # a 100-op model can take most of a second, so this bounds planning to minutes
    milp_node_limit: int = 200
    # the swap MILP's cost of one copy, in mean op times: a tie-break, so no copy is made that
    # the optimum does not need
    milp_swap_copy_cost: float = 1e-4

    # --- solvers: revolve over the separator blocks (solvers/block_chain.py)
    # the chain DP's memory resolution (its time grows linearly with it)
    chain_memory_units: int = 200
    # chain budget cuts by the simulated excess before giving up
    chain_tighten_rounds: int = 6

    # --- strategies: optimal-recompute (strategies/recomputing/optimal_recompute.py)
    # the default max_ops: the MILP's root takes seconds to a minute at this size
    milp_max_ops: int = 100
    # separator blocks beyond this are merged: the segment table grows with their square
    segment_max_blocks: int = 48
    # re-solves of the segment DP with a budget lowered by the assembled plan's excess
    segment_tighten_rounds: int = 6
    # memory-poor re-runs O(n^2) ops: beyond this many forward ops its step would take a
    # thousand forward passes or more, and lowering it alone takes seconds and gigabytes
    memory_poor_max_forward_ops: int = 2000

    # --- strategies: recomputation in the forward pass (strategies/recomputing/_forward_recompute.py)
    # a longer segment costs about a block's forward: checkpointing's business
    forward_segment_max_ops: int = 16
    # each move adds a few re-runs; a bound on the search, not a tuning knob
    forward_max_moves: int = 256
    # candidates simulated per move, best score first
    forward_tries_per_move: int = 24

    # --- strategies: vDNN (strategies/swapping/vdnn.py)
    # boundaries tried past the smallest that fits: time is not monotone in it
    vdnn_extra_boundaries: int = 4

    # --- strategies: auto (strategies/auto.py)
    # smaller copies are mostly link latency
    auto_min_swap_bytes: int = 1 << 16
    # the hybrid's budget relaxations, shares of what free swaps save
    auto_hybrid_shares: tuple[float, ...] = (1.25, 1.0, 0.75, 0.5, 0.25, 0.0)
    # recompute-then-swap rounds of swapped checkpoints; a captured GPT-2 settles (or cycles)
    # before this
    auto_checkpoint_rounds: int = 6
    # library calls auto's fused-chains candidate tries re-running (one simulation each): a
    # CNN fits once its first convolution re-runs; a transformer's calls are many and alike
    fused_chains_calls_tried: int = 8

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"Tuning.{field.name} must be a positive int, got {value!r}")
        if self.milp_swap_copy_cost <= 0 or any(s < 0 for s in self.auto_hybrid_shares):
            raise ValueError("Tuning: the copy cost must be positive and the shares non-negative")


TUNING = Tuning()
