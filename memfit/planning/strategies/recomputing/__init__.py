"""Strategies that free activations and recompute them in the backward pass.

``checkpoint`` (separators, ``_separator_count_search``), ``optimal_recompute`` (the
chain DP and the MILP), ``memory_poor`` (rebuild from the inputs), ``fused_chains`` (inductor:
every memory-bound chain re-run inside the backward's kernels) and ``_forward_recompute``
(recomputation inside the forward pass).
"""
