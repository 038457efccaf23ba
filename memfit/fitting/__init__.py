"""The fitting stage: ``memfit.fit``'s model and the steps ``memfit.plan`` traces.

``fitted`` (``memfit.fit``, ``unfit``, ``backend``), ``arguments`` (their checks),
``dynamo_settings`` (what Dynamo compiles a fitted call under), ``loop_optimizer`` (the loop's
optimizer found where none was given),
``device_budget`` (the automatic budget on CUDA), ``traced`` (a step traced and planned without
running), ``joint_first`` (graph-broken regions planned before the first run),
``symbolic_batch`` (one trace for every batch), ``callers_compile`` (a fitted model inside the
caller's ``torch.compile``), ``cluster`` (one rank's plan of an FSDP job). Imports
``compiler/`` and the stages below it.
"""
