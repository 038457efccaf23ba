"""The compiler stage: memfit as a ``torch.compile`` backend, every compiled region planned.

``backend`` (``memfit.Backend``) and ``backend_options`` (its frozen configuration),
``partitioner`` (one region's joint graph planned and split), ``outside_bytes`` (the bytes
alive beside it while it runs), ``step_graph`` (the hardware profile and the ``CostGraph`` a
region is planned with; ``memfit.planning.step`` plans it), ``region`` (a planned region as
the backend keeps it), ``region_run`` and ``region_peak`` (its runs and their measured peaks),
``region_lifetimes`` and ``loop_lifetimes`` (what lives outside its graph), ``graph_breaks``,
``joint_planning``, ``repeated_calls``, ``replanning``, ``shape_bound``, ``closed_loop``,
``eager_watching``, ``unplanned``, ``partners``, ``unit_forward``, ``report``
(``memfit.report``'s text). Imports ``lowering/`` and the stages below it.
"""
