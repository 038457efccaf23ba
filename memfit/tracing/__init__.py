"""The tracing stage: a training step captured as one joint fx graph and analyzed into the
planner's torch-free ``CostGraph``.

``capture`` (``memfit.capture``), ``target`` and ``target_attention`` (the graph the profile's
device would run), ``joint`` (the joint graph AOTAutograd hands a partitioner), ``analyze``
(tensors, sizes, lifetimes, FLOPs), ``flops``, ``temporaries`` and ``kernel_probe`` (bytes a
kernel allocates inside one op), ``rnn``, ``shapes`` (symbolic sizes priced at a bound).
Imports ``runtime/`` and ``ops/`` below it.
"""
