"""The model layer: what a plan does to a step, torch-free.

Lowering a plan to a schedule (``schedule``, ``recompute``), the memory profile and the
simulator (``simulate``, ``host_memory``, ``rerun_profile``; ``profile``, the incremental model
meant to replace the planners' fast copies), the explanation, checkpoint separators
(``separators``) and the sharding transform. Imports the data layer only.
"""
