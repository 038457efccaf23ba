"""Optimal recomputation and swapping solvers, torch-free.

A solver takes a problem (a ``CostGraph`` or a chain's costs, and a budget in its own accounting)
and returns a schedule of its own type; it never builds a ``Plan`` nor calls ``simulate``: the
strategies (``memfit.planning.strategies``) do, and tighten where a solver's accounting is not
the exact peak (``tests/test_layers.py`` checks the imports).

- ``revolve``: Griewank's revolve counts (recurrence and binomial closed form).
- ``chain``: the DP of least recompute time under a byte budget for a
  heterogeneous chain; the article's default, memory-poor and sqrt(n) schedules; ``simulate_chain``.
- ``chain_graph``: a chain as a ``CostGraph`` and back, to compare the DP with the MILP.
- ``segments``: the DP over the chain of separator blocks (recomputed tensors per segment).
- ``block_chain``: the chain DP over those blocks, lowered to re-runs (``NestedSchedule``).
- ``milp``: Checkmate's MILP on any ``CostGraph`` (HiGHS through ``scipy.optimize.milp``).
- ``milp_swap``: POET's MILP, swapping and recomputing together: the reference step time under a
  budget on small graphs, as re-runs and swapped tensors (``SwapMilpSolution``).
"""
