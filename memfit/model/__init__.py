"""The model layer: what a plan does to a step, torch-free.

Lowering a plan to a schedule (``schedule``, ``recompute``), the memory profile and the
simulator (``simulate``, ``host_memory``; ``profile``, the incremental model the planners
price with, on ``keys``, ``clock`` and ``rerun_delta``), the explanation, checkpoint separators
(``separators``) and the sharding transform. Imports the data layer only.
"""
