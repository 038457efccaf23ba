"""The planning layer: choosing a plan under the budget, torch-free.

``strategies/`` (registered by name), ``solvers/`` (the chain DP, the MILPs, segments) and
``batches`` (which batches ``max_batch_size`` tries). Imports the model and data layers.
"""
