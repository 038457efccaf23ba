"""Survey of kernel temporaries: every op of a captured joint graph, run alone under the allocator.

For each ``call_function`` node of an example's captured fwd+bwd graph, real inputs are made from
the node's fake values (random floats, zeros for integer tensors so indices stay in range), the op
runs once under the profiler's CPU allocator events, and the bytes the allocator held at its
high-water mark above the outputs' storages are reported beside what
``memfit.tracing.temporaries`` predicts. Ops whose measured and predicted extra bytes differ are
the ones a rule is missing for (or has wrong).

Usage:
    python -m bench.kernel_survey cnn unet3d
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from memfit import examples
from memfit.runtime.measure import allocator_peak_above_start
from memfit.tracing.capture import capture
from memfit.tracing.kernel_probe import new_storage_bytes, real_like
from memfit.tracing.temporaries import kernel_temporary_bytes_of

EXAMPLES = {"cnn": examples.cnn, "unet3d": lambda: examples.unet3d(channels=(4, 8, 16), size=16)}


@dataclass(frozen=True)
class Finding:
    """One op's measured and predicted bytes beyond its outputs."""

    node: str
    target: str
    output_bytes: int
    measured_extra_bytes: int
    predicted_extra_bytes: int


def _argument(argument: object) -> object:
    return tree_map(lambda item: real_like(item.meta.get("val")) if isinstance(item, fx.Node) else item,
                    argument)


def survey(graph_module: fx.GraphModule) -> Iterator[Finding]:
    """Each op node of ``graph_module``, measured alone."""
    predicted = kernel_temporary_bytes_of(graph_module.graph.nodes)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        args, kwargs = _argument(node.args), _argument(node.kwargs)
        result, peak_bytes = allocator_peak_above_start(
            lambda op=node.target, args=args, kwargs=kwargs: op(*args, **kwargs))
        output_bytes = new_storage_bytes(result, (args, kwargs))
        yield Finding(node.name, str(node.target), output_bytes, peak_bytes - output_bytes,
                      predicted.get(node, 0))


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    for name in names or sorted(EXAMPLES):
        example = EXAMPLES[name]()
        captured = capture(example.model, example.loss_fn, *example.inputs())
        print(f"# {name}: ops with bytes beyond their outputs (measured / predicted)")
        for finding in survey(captured.graph_module):
            if finding.measured_extra_bytes or finding.predicted_extra_bytes:
                mark = "" if finding.measured_extra_bytes == finding.predicted_extra_bytes else "  !"
                print(f"{finding.node:32s} {finding.target:44s} out {finding.output_bytes:>10,d}"
                      f"  extra {finding.measured_extra_bytes:>10,d}"
                      f" / {finding.predicted_extra_bytes:>10,d}{mark}")


if __name__ == "__main__":
    main(sys.argv[1:])
