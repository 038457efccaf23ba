"""The lowering stage: a captured graph rewritten by a ``Plan`` into the graphs that run.

``rewrite`` (swap and wait ops, re-run chains, the forward and backward split), ``inductor``
(``compiler="inductor"``: inductor compiles the rewritten graphs). Imports ``tracing/`` and the
stages below it.
"""
