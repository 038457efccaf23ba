"""Strategies that swap activations to the host and back.

``tflms`` (TFLMS: the ``swap`` strategy, its control ops in ``_swap_control`` and tuner in
``_swap_tune``), ``vdnn`` (the three vDNN policies, over ``_vdnn_layers``), and the
helpers ``auto`` uses: ``_free_swaps`` and ``_just_in_time_swap``.
"""
