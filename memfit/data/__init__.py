"""The data layer: the frozen types and units every step of memfit passes on.

``CostGraph``, ``Plan``, ``Timeline``, ``Hardware``, units and errors: no algorithms, torch-free, and
no import of any memfit module outside this folder (``tests/test_layers.py``).
"""
