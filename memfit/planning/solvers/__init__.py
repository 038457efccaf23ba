"""Optimal recomputation solvers, torch-free.

- ``revolve``: Griewank's revolve counts (recurrence and binomial closed form).
- ``chain``: the DP of least recompute time under a byte budget for a
  heterogeneous chain; the article's default, memory-poor and sqrt(n) schedules; ``simulate_chain``.
- ``chain_graph``: a chain as a ``CostGraph`` and back, to compare the DP with the MILP.
- ``milp``: Checkmate's MILP on any ``CostGraph`` (HiGHS through ``scipy.optimize.milp``).
- ``milp_swap``: POET's MILP, swapping and recomputing together: the reference step time under a
  budget on small graphs, decoded into a memfit ``Plan``.
"""
