"""The runtime stage: the copy engine and memory measurement a planned step runs with.

``streams`` (copy streams, events, the host pool), ``executor`` (an fx Interpreter that frees
values at their last use), ``tracker`` and ``resident`` (device bytes on the CPU; what stays
resident across an iteration), ``outside`` (what eager code holds), ``measure``
(``measure_peak``), ``probe`` and ``cpu_probe`` (``measure_hardware``), ``ranks`` (what ranks of
a distributed job agree on). Imports ``ops/`` only, of the torch side.
"""
