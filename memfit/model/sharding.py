"""One rank of an FSDP2 or DDP job, as a transform of the step's CostGraph.

``shard_graph`` rewrites a step captured whole (every parameter full size) into what one of
``world_size`` ranks holds and waits for, so that every strategy plans, and the simulator times,
per-rank bytes without knowing about sharding:

- **FSDP2** (``fully_shard`` on each unit, ``reshard_after_forward=True``, as torchtitan does):
  parameters are resident at ``1/W`` of their bytes. Each unit's parameters are all-gathered
  (unsharded, in their dtype) before its forward and again before its backward and freed after
  each, and the next unit's all-gather is issued when a unit starts (FSDP2's prefetch: two units'
  unsharded parameters may be live at once). The root unit (the ops outside every unit) is
  all-gathered once and kept to the end of its backward, as FSDP2 does for the root. A unit's
  gradients live unsharded until its reduce-scatter, after its last backward op; what stays is
  ``1/W`` of them.
- **DDP**: parameters and gradients stay whole; gradients are all-reduced in buckets of
  ``bucket_bytes`` in the order the backward makes them, and the buckets' flat buffers (one more
  copy of the gradients, ``gradient_as_bucket_view=False``) are resident.

Collectives are ops of kind ``comm.*`` that the simulator runs on a communication stream of
their own; a ``comm.wait`` op holds the compute stream until its collective has landed, as
FSDP2's ``wait_stream`` does. Swaps keep their own copy streams, so they never queue behind a
collective. A unit's parameters are identified by the ops that read them: a parameter belongs
to the unit of its first reader, an op to the unit whose module path is the longest prefix of
its scope (``""``: the root).

Note:
    Kept simple on purpose: a compiled region's static inputs are all ``"parameter"`` tensors,
    so module buffers (rotary ``inv_freq``, norm statistics: small) are sharded with the
    parameters, which FSDP2 does not do. FSDP2's copy-in buffer (``1/W`` of a unit) and its reduce-scatter
    input buffer (a flat copy of the unit's gradients, freed with them) are not counted, nor
    DDP's smaller first bucket. The transform is deterministic: the same graph and sharding
    give the same graph on every rank, so every rank plans the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from memfit.data.costgraph import CostGraph, Op, Phase, Tensor, TensorRole
from memfit.data.hardware import Hardware

ShardingKind = Literal["none", "fsdp", "ddp"]
SHARDING_KINDS: tuple[ShardingKind, ...] = ("none", "fsdp", "ddp")
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "comm.all_gather", "comm.reduce_scatter", "comm.all_reduce"
COLLECTIVE_KINDS = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE})
WAIT = "comm.wait"  # holds the compute stream until the collective it depends on has landed
RESHARD = "comm.reshard"  # frees a unit's unsharded parameters (no time)
DDP_BUCKETS = "ddp.buckets"  # the resident tensor of DDP's gradient buckets
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default


@dataclass(frozen=True)
class Sharding:
    """How the step is spread over ranks: what one rank of the job holds.

    Args:
        kind: ``"none"`` (one device, the default), ``"fsdp"`` (FSDP2 ``fully_shard`` per unit)
            or ``"ddp"`` (``DistributedDataParallel``).
        world_size: ranks in the job (default 1). With 1 rank nothing changes, whatever
            ``kind``: the plan is the single-device plan.
        units: module paths of the FSDP units (``"layers.0"``, ...); the root is implied.
        bucket_bytes: DDP's bucket size (``bucket_cap_mb``; default 25 MiB).
    """

    kind: ShardingKind = "none"
    world_size: int = 1
    units: tuple[str, ...] = ()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.kind not in SHARDING_KINDS:
            raise ValueError(f"sharding must be one of {SHARDING_KINDS}, got {self.kind!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        object.__setattr__(self, "units", tuple(self.units))

    @property
    def active(self) -> bool:
        """Whether the graph changes: a sharding kind on more than one rank."""
        return self.kind != "none" and self.world_size > 1

    def shard_bytes(self, size_bytes: int) -> int:
        """One rank's share of ``size_bytes`` under FSDP (rounded up: FSDP2 pads dim 0)."""
        return math.ceil(size_bytes / self.world_size)

    def outside_bytes(self, outside_bytes: int, optimizer_state_bytes: int) -> int:
        """Bytes one rank holds outside the graph: FSDP shards the optimizer state (its
        parameters are DTensor shards); DDP keeps it whole. Other bytes (buffers) stay whole."""
        if self.kind != "fsdp" or not self.active:
            return outside_bytes
        state = min(optimizer_state_bytes, outside_bytes)
        return outside_bytes - state + self.shard_bytes(state)


def shard_graph(graph: CostGraph, sharding: Sharding, hardware: Hardware) -> CostGraph:
    """What one rank of ``sharding`` holds and waits for, as a graph (``graph`` when inactive).

    Raises:
        ValueError: if ``hardware`` states no collective bandwidth for ``world_size`` ranks.
    """
    if not sharding.active:
        return graph
    if sharding.kind == "fsdp":
        return _FullyShard(graph, sharding, hardware).graph()
    return _data_parallel(graph, sharding, hardware)


def unit_of(scope: str, units: Sequence[str]) -> str:
    """The unit whose module path is the longest prefix of ``scope`` (``""``: the root)."""
    found = ""
    for unit in units:
        if (scope == unit or scope.startswith(unit + ".")) and len(unit) > len(found):
            found = unit
    return found


def gradient_outputs(graph: CostGraph) -> list[Tensor]:
    """The gradients the step returns (what FSDP reduce-scatters and DDP all-reduces), in the
    order the backward makes them."""
    index = graph.index
    found = [(index[t.producer], t) for t in graph.tensors.values()
             if t.is_output and t.role == "gradient" and t.producer is not None]
    return [t for _, t in sorted(found, key=lambda item: item[0])]


class _FullyShard:
    """The FSDP2 transform: ops to insert before / after each op, then one rebuild."""

    def __init__(self, graph: CostGraph, sharding: Sharding, hardware: Hardware) -> None:
        self.source, self.sharding, self.hardware = graph, sharding, hardware
        self.before: dict[int, list[Op]] = {}
        self.after: dict[int, list[Op]] = {}
        self.new_tensors: list[Tensor] = []
        self.reduced: set[str] = set()  # gradients reduce-scattered: no longer outputs
        self.unit = {op.name: unit_of(op.scope, sharding.units) for op in graph.ops}

    def graph(self) -> CostGraph:
        parameters = self._parameters_by_unit()
        phases: tuple[Phase, ...] = ("forward", "backward")
        for phase in phases:
            self._gather(phase, parameters)
        self._reduce_scatter()
        tensors = {name: self._sharded_input(t) for name, t in self.source.tensors.items()}
        for tensor in self.new_tensors:
            tensors[tensor.name] = tensor
        ops: list[Op] = []
        for position, op in enumerate(self.source.ops):
            ops.extend(self.before.get(position, ()))
            ops.append(op)
            ops.extend(self.after.get(position, ()))
        return CostGraph.build(ops, tensors.values(), name=self.source.name,
                               compiler=self.source.compiler)

    def _sharded_input(self, tensor: Tensor) -> Tensor:
        changes: dict = {"consumers": ()}
        if tensor.role == "parameter" and tensor.producer is None:
            changes["size_bytes"] = self.sharding.shard_bytes(tensor.size_bytes)
        if tensor.name in self.reduced:
            changes["is_output"] = False  # freed once reduce-scattered
        return replace(tensor, **changes)

    def _parameters_by_unit(self) -> dict[str, list[Tensor]]:
        """Each unit's parameters: those whose first reader is one of its ops."""
        found: dict[str, list[Tensor]] = {}
        for tensor in self.source.tensors.values():
            if tensor.role == "parameter" and tensor.producer is None and tensor.consumers:
                found.setdefault(self.unit[tensor.consumers[0]], []).append(tensor)
        return found

    def _spans(self, phase: Phase) -> dict[str, tuple[int, int]]:
        """Unit -> (first, last) position of its ops in ``phase``, in order of the first."""
        spans: dict[str, tuple[int, int]] = {}
        for position, op in enumerate(self.source.ops):
            if op.phase == phase:
                first, _ = spans.get(self.unit[op.name], (position, position))
                spans[self.unit[op.name]] = (first, position)
        return spans

    def _gather(self, phase: Phase, parameters: dict[str, list[Tensor]]) -> None:
        """All-gathers of ``phase``: each issued when the unit before it starts (the prefetch),
        waited for before the unit's first op, freed after its last (the root: after its last
        backward op, and gathered once)."""
        spans = self._spans(phase)
        order = [u for u in spans if u in parameters and (phase == "forward" or u != "")]
        backward_spans = self._spans("backward")
        for number, unit in enumerate(order):
            first, last = spans[unit]
            issue = spans[order[number - 1]][0] if number else first
            if unit == "":  # FSDP2 keeps the root unsharded from its forward to its backward's end
                last = backward_spans.get("", (last, last))[1]
            size = sum(t.size_bytes for t in parameters[unit])
            label = f"{unit or 'root'}.{phase}"
            gather = self._collective(f"all_gather.{label}", ALL_GATHER, phase, unit, size,
                                      tuple(t.name for t in parameters[unit]), size)
            wait = Op(f"wait.{label}", WAIT, phase, unit, inputs=gather.outputs,
                      depends_on=(gather.name,))
            phase_of_last = self.source.ops[last].phase
            reshard = Op(f"reshard.{label}", RESHARD, phase_of_last, unit, inputs=gather.outputs)
            self.before.setdefault(issue, []).append(gather)
            self.before.setdefault(first, []).append(wait)
            self.after.setdefault(last, []).append(reshard)

    def _reduce_scatter(self) -> None:
        """After each unit's last backward op, its gradients are reduce-scattered: the
        unsharded ones die, ``1/W`` of them stays to the end."""
        spans = self._spans("backward")
        by_unit: dict[str, list[Tensor]] = {}
        for tensor in gradient_outputs(self.source):
            by_unit.setdefault(self.unit[str(tensor.producer)], []).append(tensor)
        self.reduced = {t.name for group in by_unit.values() for t in group}
        for unit in sorted(by_unit, key=lambda u: spans[u][1]):
            gradients = by_unit[unit]
            size = sum(t.size_bytes for t in gradients)
            op = self._collective(f"reduce_scatter.{unit or 'root'}", REDUCE_SCATTER, "backward",
                                  unit, size, tuple(t.name for t in gradients),
                                  self.sharding.shard_bytes(size), output=True,
                                  depends_on=tuple(str(t.producer) for t in gradients))
            self.after.setdefault(spans[unit][1], []).append(op)  # after the reshard, as FSDP2

    def _collective(self, name: str, kind: str, phase: Phase, unit: str, size_bytes: int,
                    inputs: tuple[str, ...], output_bytes: int, output: bool = False,
                    depends_on: tuple[str, ...] = ()) -> Op:
        """A collective op over ``size_bytes`` (unsharded) allocating ``output_bytes``."""
        role: TensorRole = "activation" if phase == "forward" else "gradient"
        self.new_tensors.append(Tensor(name, output_bytes, role, is_output=output))
        time_s = self.hardware.collective_time_s(kind.removeprefix("comm."), size_bytes,
                                                 self.sharding.world_size)
        return Op(name, kind, phase, unit, inputs=inputs, outputs=(name,),
                  depends_on=tuple(dict.fromkeys(depends_on)), time_s=time_s)


def _data_parallel(graph: CostGraph, sharding: Sharding, hardware: Hardware) -> CostGraph:
    """DDP: an all-reduce after the last gradient of each bucket, and the buckets resident."""
    gradients = gradient_outputs(graph)
    after: dict[str, list[Op]] = {}
    for number, bucket in enumerate(_buckets(gradients, sharding.bucket_bytes)):
        size = sum(t.size_bytes for t in bucket)
        last = bucket[-1].producer
        assert last is not None
        producers = tuple(dict.fromkeys(t.producer for t in bucket if t.producer))
        time_s = hardware.collective_time_s("all_reduce", size, sharding.world_size)
        after.setdefault(last, []).append(
            Op(f"all_reduce.bucket{number}", ALL_REDUCE, "backward", graph.op(last).scope,
               inputs=tuple(t.name for t in bucket), depends_on=producers, time_s=time_s))
    ops = [item for op in graph.ops for item in (op, *after.get(op.name, ()))]
    tensors = [replace(t, consumers=()) for t in graph.tensors.values()]
    bucket_bytes = sum(t.size_bytes for t in gradients)
    if bucket_bytes:
        tensors.append(Tensor(DDP_BUCKETS, bucket_bytes, "buffer"))
    return CostGraph.build(ops, tensors, name=graph.name, compiler=graph.compiler)


def _buckets(gradients: Iterable[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Gradients in backward order, cut into buckets that close once they reach the cap."""
    buckets: list[list[Tensor]] = [[]]
    filled = 0
    for tensor in gradients:
        buckets[-1].append(tensor)
        filled += tensor.size_bytes
        if filled >= bucket_bytes:
            buckets.append([])
            filled = 0
    return [bucket for bucket in buckets if bucket]
