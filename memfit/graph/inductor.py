"""``compiler="inductor"``: inductor compiles the region, memfit is its partitioner.

``torch._inductor.compile_fx.compile_fx`` runs the region through inductor's own pipeline
(decompositions, AOTAutograd, the joint-graph passes) and then asks a partitioner to split the
joint graph; ``config.custom_partitioner_fn`` replaces its min-cut partitioner with memfit's
planner (``Backend.plan_region``). So memfit plans the decomposed joint graph, the one inductor
compiles, and inductor lowers and fuses the planned forward and backward modules as it would
its own. memfit's ops (swap-outs, swap-ins, waits, random-state saves and replays) become
inductor fallback kernels: calls into their Python implementations between the fused kernels.

Note:
    The swap ops find their copy engine through ``active_engine``; inductor's modules run
    inside AOTAutograd (the backward during ``loss.backward()``, outside the forward's call), so
    each compiled module is wrapped (``inner_compile``) to make the region's engine current
    while it runs, as ``aot_eager``'s runner does. AOTAutograd's cache is off for the compile:
    a cached region would skip the partitioner, and a plan depends on the budget and on the
    bytes resident outside the region, not on the graph alone (the partitioner's ``uuid`` is
    ``None`` for the same reason: inductor's FX graph cache still caches the planned modules,
    whose code includes every memfit op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from memfit.runtime.streams import CopyEngine, active_engine


class _Planner(CustomPartitionerFn):
    """Inductor's partitioner hook calling memfit's (``partition``: a ``Backend``'s)."""

    def __init__(self, partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]]) -> None:
        self.partition = partition

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any | None:
        return None  # a plan is not a function of the graph: never reuse a cached partition

    def __getstate__(self) -> dict[str, Any]:
        """What inductor's FX-graph cache key holds of the config's partitioner: nothing. The
        key is for a module already partitioned, whose code has every op memfit inserted."""
        return {}


def compile_with_inductor(graph_module: fx.GraphModule, example_inputs: list,
                          partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
                          engine: CopyEngine) -> Any:
    """The region compiled by inductor with ``partition`` as its partitioner and ``engine``
    current while its modules run."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # fallback_random: inductor would otherwise draw random numbers from seeds it takes at the
    # start of each module, which a re-run's replay of the forward's generator state cannot
    # reach; eager's random kernels draw from the generator memfit saves and restores
    with inductor_config.patch(custom_partitioner_fn=_Planner(partition), fallback_random=True), \
            functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(graph_module, example_inputs, inner_compile=_with_engine(engine))


def _with_engine(engine: CopyEngine) -> Callable[..., Any]:
    """Inductor's ``compile_fx_inner``, its compiled module run with ``engine`` current."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(module: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
                      ) -> Any:
        compiled = compile_fx_inner(module, example_inputs, **kwargs)

        def run(args: list) -> Any:
            with active_engine(engine):
                return compiled(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return inner_compile
