"""CostGraph: the planner's torch-free view of one captured training step.

An ``Op`` is one node of the captured fx graph, in execution order; a ``Tensor`` is one *storage*
(views, ``detach`` and ``t(weight)`` alias their base and add no bytes). Strategies, solvers and the
simulator see only this structure, so they are tested on synthetic graphs as well as captured ones.

Note:
    Two kinds of edge exist on purpose. ``Op.inputs`` names the storages an op reads: that is what
    memory liveness needs. ``Op.depends_on`` names the ops whose values it reads directly (the fx
    data edges): that is what reachability needs, since a view op allocates nothing but still
    orders its readers after it.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Literal, TypeVar

Found = TypeVar("Found")

Phase = Literal["forward", "backward", "update"]
TensorRole = Literal["parameter", "buffer", "input", "activation", "gradient"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "update")


@dataclass(frozen=True)
class Op:
    """One operation, in execution order.

    Args:
        name: the fx node name (unique).
        kind: the op type, e.g. ``"aten.mm"``; TFLMS's ``incl_types``/``excl_types`` match it.
        phase: ``"forward"``, ``"backward"`` or ``"update"``.
        scope: the module path that produced the op (``"transformer.h.3.attn"``), ``""`` at top level.
        module_type: the class name of that module (``"GPT2Attention"``), ``""`` if none.
        inputs: storages (``Tensor`` names) the op reads, each once.
        outputs: storages the op allocates.
        depends_on: ops whose values it reads directly (fx data edges).
        time_s: estimated or measured run time.
        flops: floating-point operations, for the roofline estimate.
        bytes_accessed: bytes read plus written, for the roofline estimate.
        dtype: the dtype of its first tensor output (``"float32"``), to pick the FLOP rate.
        elements: the elements of its first tensor output, for the per-element cost of a
            memory-bound op (``Hardware.element_rates``); 0 where not known.
        library_call: inductor runs it as eager's kernel whatever its kind (it generates no
            code for an op with a complex tensor among its inputs or outputs), so it is never
            fused, inlined or written in place (``memfit.model.kernels.fusible``).
    """

    name: str
    kind: str
    phase: Phase
    scope: str = ""
    module_type: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    depends_on: tuple[str, ...] = ()
    time_s: float = 0.0
    flops: float = 0.0
    bytes_accessed: int = 0
    dtype: str = "float32"
    elements: int = 0
    library_call: bool = False


@dataclass(frozen=True)
class Tensor:
    """One storage.

    Args:
        name: the name of the op that allocates it, or of the graph input it is.
        size_bytes: bytes of the storage (counted once, whatever views alias it).
        role: ``"parameter"``, ``"buffer"``, ``"input"`` (user inputs, tangents),
            ``"activation"`` (allocated by a forward op) or ``"gradient"`` (by a backward op).
        producer: the allocating op, ``None`` for graph inputs (resident for the whole step).
        consumers: ops that read it (directly or through a view), in execution order.
        is_output: returned by the step (loss, gradients, buffer updates): lives to the end.
    """

    name: str
    size_bytes: int
    role: TensorRole
    producer: str | None = None
    consumers: tuple[str, ...] = ()
    is_output: bool = False


@dataclass(frozen=True)
class CostGraph:
    """Ops in execution order and the storages they read and allocate.

    Build one with ``CostGraph.build(ops, tensors)``: it fills ``Tensor.consumers`` from the ops'
    inputs and checks that every name resolves.

    Args:
        compiler: what runs the ops: ``"aot_eager"`` (each op its own kernel, each output its
            own buffer) or ``"inductor"``, whose generated kernels compute a pointwise value
            inside the kernels that read it instead of storing it (``memfit.model.inlining``).
    """

    ops: tuple[Op, ...]
    tensors: Mapping[str, Tensor] = field(default_factory=dict)
    name: str = "graph"
    compiler: str = "aot_eager"

    @staticmethod
    def build(
        ops: Iterable[Op],
        tensors: Iterable[Tensor],
        name: str = "graph",
        compiler: str = "aot_eager",
    ) -> CostGraph:
        """Make a graph, deriving each tensor's consumers from the ops' inputs.

        Raises:
            ValueError: if an op reads or allocates an unknown tensor, a name repeats, an op
                depends on an op that runs later, or a tensor is read before it is allocated.
        """
        ops = tuple(ops)
        tensors = tuple(tensors)
        by_name = {t.name: t for t in tensors}
        if len(by_name) != len(tensors):
            raise ValueError("tensor names must be unique")
        op_index = {op.name: index for index, op in enumerate(ops)}
        if len(op_index) != len(ops):
            raise ValueError("op names must be unique")
        readers: dict[str, list[str]] = {name: [] for name in by_name}
        producers: dict[str, str] = {}
        allocated = {tensor for op in ops for tensor in op.outputs}
        for op in ops:
            for tensor_name in (*op.inputs, *op.outputs):
                if tensor_name not in by_name:
                    raise ValueError(f"op {op.name!r} names unknown tensor {tensor_name!r}")
            for dependency in op.depends_on:
                if dependency not in op_index:
                    raise ValueError(f"op {op.name!r} depends on unknown op {dependency!r}")
                if op_index[dependency] >= op_index[op.name]:
                    raise ValueError(f"op {op.name!r} depends on {dependency!r}, which runs later")
            for tensor_name in op.inputs:
                if tensor_name in allocated and tensor_name not in producers:
                    raise ValueError(f"op {op.name!r} reads {tensor_name!r} before it is allocated")
                readers[tensor_name].append(op.name)
            for tensor_name in op.outputs:
                if tensor_name in producers:
                    raise ValueError(f"tensor {tensor_name!r} is allocated twice")
                producers[tensor_name] = op.name
        built = {}
        for tensor_name, tensor in by_name.items():
            producer = producers.get(tensor_name)
            if tensor.producer is not None and tensor.producer != producer:
                raise ValueError(
                    f"tensor {tensor_name!r} names producer {tensor.producer!r}, but {producer!r} makes it"
                )
            built[tensor_name] = replace(
                tensor, producer=producer, consumers=tuple(readers[tensor_name])
            )
        return CostGraph(ops=ops, tensors=MappingProxyType(built), name=name, compiler=compiler)

    # ---- lookups -------------------------------------------------------------------------------

    @cached_property
    def index(self) -> Mapping[str, int]:
        """Position of each op in execution order."""
        return MappingProxyType({op.name: i for i, op in enumerate(self.ops)})

    def op(self, name: str) -> Op:
        return self.ops[self.index[name]]

    def remembered(self, key: Hashable, make: Callable[[], Found]) -> Found:
        """``make()``, computed once per graph under ``key``.

        Why: planners ask for the same analyses of a graph (its separators, its unchanged
        actions) once per candidate and budget, and a graph is frozen, so they never go stale.
        What ``make`` returns is shared: it must not be changed by its readers.
        """
        memo = self.__dict__.setdefault("_remembered", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    @cached_property
    def users(self) -> Mapping[str, tuple[str, ...]]:
        """For each op, the ops that depend on it directly (reverse of ``depends_on``)."""
        users: dict[str, list[str]] = {op.name: [] for op in self.ops}
        for op in self.ops:
            for dependency in op.depends_on:
                users[dependency].append(op.name)
        return MappingProxyType({name: tuple(found) for name, found in users.items()})

    @property
    def resident_bytes(self) -> int:
        """Bytes of graph inputs (parameters, buffers, user inputs): live for the whole step."""
        return sum(t.size_bytes for t in self.tensors.values() if t.producer is None)

    @property
    def forward_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.phase == "forward")

    @property
    def step_time_s(self) -> float:
        """Sum of op times: the step time with nothing swapped or recomputed."""
        return sum(op.time_s for op in self.ops)

    def saved_tensors(self) -> tuple[Tensor, ...]:
        """Activations that a backward op reads: what swapping and recomputing act on."""
        phase = {op.name: op.phase for op in self.ops}
        return tuple(
            t
            for t in self.tensors.values()
            if t.producer is not None
            and phase[t.producer] == "forward"
            and any(phase[c] == "backward" for c in t.consumers)
        )

    def with_times(self, time_s: Mapping[str, float]) -> CostGraph:
        """The same graph with op times replaced from ``time_s`` (ops not named keep theirs)."""
        ops = tuple(replace(op, time_s=float(time_s.get(op.name, op.time_s))) for op in self.ops)
        return CostGraph(ops=ops, tensors=self.tensors, name=self.name, compiler=self.compiler)

    # ---- identity and serialisation ------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "compiler": self.compiler,
            "ops": [asdict(op) for op in self.ops],
            "tensors": [asdict(t) for t in self.tensors.values()],
        }

    @staticmethod
    def from_json(data: Mapping) -> CostGraph:
        ops = [Op(**{**op, **_tuples(op, "inputs", "outputs", "depends_on")}) for op in data["ops"]]
        tensors = [Tensor(**{**t, "consumers": ()}) for t in data["tensors"]]
        return CostGraph.build(ops, tensors, name=data.get("name", "graph"),
                               compiler=data.get("compiler", "aot_eager"))

    @cached_property
    def structure_text(self) -> str:
        """The JSON text of ops, edges and sizes (not times), in program order: what
        ``structure_hash`` hashes, and what a hash of every field can start from."""
        payload = [_STRUCTURE_OP(op) for op in self.ops]
        sizes = sorted(_STRUCTURE_TENSOR(tensor) for tensor in self.tensors.values())
        return _ACYCLIC_ENCODER.encode([payload, sizes])

    @cached_property
    def structure_hash(self) -> str:
        """A hash of ops, edges and sizes (not times): plans are keyed by it."""
        return hashlib.sha256(self.structure_text.encode()).hexdigest()[:16]


STRUCTURE_OP_FIELDS = ("name", "kind", "phase", "inputs", "outputs", "depends_on")
STRUCTURE_TENSOR_FIELDS = ("name", "size_bytes", "role", "is_output")
_STRUCTURE_OP = operator.attrgetter(*STRUCTURE_OP_FIELDS)
_STRUCTURE_TENSOR = operator.attrgetter(*STRUCTURE_TENSOR_FIELDS)
# a graph's records hold no cycles: the encoder's check for them costs a fifth of the encoding
_ACYCLIC_ENCODER = json.JSONEncoder(check_circular=False, sort_keys=True)


def _tuples(record: Mapping, *keys: str) -> dict:
    return {key: tuple(record.get(key, ())) for key in keys}
