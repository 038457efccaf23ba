"""The runtime layer (L2): runs a rewritten step and measures it.

``executor`` (an fx Interpreter that frees values at their last use), ``streams`` (copy streams,
events and the engine the swap ops use), ``host`` (the host-tier pool), ``tracker`` (device bytes
on the CPU), ``measure`` (``measure_peak``), ``probe`` (``measure_hardware``).
"""
