"""The torch side's front: memfit as a ``torch.compile`` backend.

``backend`` (every compiled region planned), ``partitioner`` (one region's joint graph planned
and split), ``fitted`` (``memfit.fit``), ``replanning``, ``graph_breaks``, ``closed_loop``,
``traced`` (a step traced for ``memfit.plan``), ``plan_step`` (one planning pipeline),
``sharding`` (FSDP units). Uses ``graph/`` and ``runtime/``, and the planning layer below them.
"""
