"""The planning layer: choosing a plan under the budget, torch-free.

``step`` (the one planning pipeline: a parsed budget resolved to bytes once, planned with a
strategy, explained and simulated), ``plan_cache`` (its plans kept on disk), ``strategies/``
(registered by name), ``solvers/`` (the chain DP, the MILPs, segments) and ``batches`` (which
batches ``max_batch_size`` tries). Imports the model and data layers.
"""
