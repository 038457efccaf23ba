"""The data layer: the frozen types and units every step of memfit passes on.

``CostGraph``, ``Plan`` (with its JSON schema and its text: ``plan_json``, ``plan_text``),
``Timeline``, ``Hardware``, units, errors and the plain text tables they print in: no algorithms,
torch-free, and no import of any memfit module outside this folder (``tests/test_layers.py``).
"""
