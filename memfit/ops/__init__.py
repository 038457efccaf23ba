"""The ops stage: what a rewritten graph calls at run time, below everything that runs it.

``swap`` (``memfit::swap_out``, ``swap_in``, ``wait``), ``rng`` (the random-state ops a re-run
draws with), ``host`` (the host-tier buffers swapped tensors land in), ``engine_slot`` (where the
ops find the copy engine of the run in progress). Imports nothing of memfit's torch side.
"""
