"""Inductor's inlining: the pointwise values its kernels compute where they are read.

Inductor lowers a pointwise op (arithmetic, a broadcast, a cast, a ``where``) to a function of
its inputs' elements and stores the value in a buffer only where it must (``realize``); every
other kernel that reads it computes it again from what it reads. A chain of pointwise ops thus
allocates nothing until a reduction, a library call (a matmul, a convolution, memfit's swap
ops) or the module's end reads it. ``inlined_buffers`` finds the buffers of a lowered plan that
inductor never stores, by the rules of ``torch._inductor.graph.GraphLowering.run_node`` and
``StorageBox.should_realize_on_reuse``. A buffer is inlined when:

- its op is pointwise: fusible (``memfit.model.kernels.fusible``), with one output, not a
  reduction (``REDUCTIONS``) nor an op that writes through indices or joins tensors
  (``STORED_KINDS``);
- every action that reads it is a generated kernel (a fusible op) of the same module: a value
  read by a library call, copied to the host, saved for the backward or returned is stored;
- it reads, through the inlined values it reads, at most ``ACCUMULATED_READS`` buffers and is
  made of at most ``LARGE_OPS`` ops; read by several ops, at most ``REUSED_READS`` buffers,
  ``REUSED_OPS`` ops and no transcendental that inductor's CPU code stores once
  (``REUSED_TRANSCENDENTALS``);
- it is not pinned: ``memfit.lowering.inductor.pin_planned_order`` gives each swap-in and each
  re-run chain's first op an ordering-only dependency on ops before it, its anchors, and
  inductor stores the pinned value and every anchor (``pinned_and_anchors``).

The readers of an inlined value read what it reads instead, so those buffers live until its
last reader (``memfit.model.schedule.memory_profile``).

A generated pointwise kernel also writes its value *in place*, into a buffer it reads last,
where inductor can (``in_place_writes``, the rule of
``torch._inductor.scheduler.SchedulerNode.decide_inplace_update``): that storage then holds the
new value, and no new one is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from memfit.data.costgraph import CostGraph
from memfit.model.actions import Action
from memfit.model.kernels import fusible

REDUCTIONS = frozenset({
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.var_mean", "aten.var", "aten.std",
    "aten.max", "aten.min", "aten.prod", "aten.argmax", "aten.argmin", "aten.any", "aten.all",
    "aten.logsumexp", "aten.cumsum", "aten.cumprod", "aten.norm", "aten.linalg_vector_norm",
    "aten._softmax", "aten._log_softmax", "aten.native_layer_norm", "aten.native_batch_norm",
    "aten._native_batch_norm_legit_functional", "aten.native_layer_norm_backward",
    "aten.native_batch_norm_backward",
})
STORED_KINDS = frozenset({
    "aten.cat", "aten.scatter", "aten.scatter_add", "aten.scatter_reduce", "aten.index_put",
    "aten._unsafe_index_put", "aten.index_add", "aten.copy_", "aten.sort", "aten.topk",
    "aten.embedding_dense_backward", "aten.constant_pad_nd", "aten.nonzero",
})
# pointwise-looking ops that read an input at other indices than the one they write: inductor
# never writes their value into that input's storage (``NodeUser.can_inplace`` is false)
READ_ELSEWHERE = frozenset({
    "aten.gather", "aten.index", "aten._unsafe_index", "aten.index_select", "aten.take",
    "aten.flip", "aten.roll", "aten.repeat", "aten.embedding", "aten.slice_scatter",
    "aten.select_scatter", "aten.diagonal_scatter", "aten.as_strided_scatter",
    "aten.reflection_pad1d", "aten.reflection_pad2d", "aten.reflection_pad3d",
    "aten.replication_pad1d", "aten.replication_pad2d", "aten.replication_pad3d",
    "aten.upsample_nearest2d", "aten.upsample_bilinear2d", "aten.im2col", "aten.col2im",
})
REUSED_TRANSCENDENTALS = frozenset({
    "aten.exp", "aten.log", "aten.log10", "aten.log1p", "aten.log2", "aten.sigmoid", "aten.tanh",
})
REUSED_READS = 4  # inductor's config.realize_reads_threshold
ACCUMULATED_READS = 8  # config.realize_acc_reads_threshold
REUSED_OPS = 30  # config.realize_opcount_threshold
LARGE_OPS = 100  # a pointwise function this large is stored whatever reads it

_PINNED = ("recompute", "swap_in")  # the work pin_planned_order orders


def inlined_buffers(graph: CostGraph, actions: Sequence[Action], outputs: frozenset[str],
                    pins: Mapping[int, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """The buffers of ``actions`` (a lowered plan of ``graph``, run by inductor) that inductor
    computes inside their readers, each with the stored buffers its readers read instead.
    A stored buffer stands for itself and is not in the result."""
    readers: dict[str, list[int]] = {}
    for index, action in enumerate(actions):
        for buffer in action.reads:
            readers.setdefault(buffer, []).append(index)
    inlined: dict[str, tuple[str, ...]] = {}
    made_of: dict[str, tuple[int, bool]] = {}  # inlined buffer -> (ops, has a transcendental)
    pinned_stored = {*pins, *(anchor for anchors in pins.values() for anchor in anchors)}
    for index, action in enumerate(actions):
        if action.kind not in ("compute", "recompute") or len(action.allocates) != 1:
            continue
        op = graph.op(action.op)
        buffer = action.allocates[0]
        if (buffer in outputs or index in pinned_stored or not fusible(op)
                or op.kind in REDUCTIONS or op.kind in STORED_KINDS):
            continue
        reading = readers.get(buffer, ())
        phase = action_phase(graph, action)
        if not reading or not all(
                actions[reader].kind in ("compute", "recompute") and fusible(
                    graph.op(actions[reader].op)) and action_phase(graph, actions[reader]) == phase
                for reader in reading):
            continue
        reads: dict[str, None] = {}
        ops, heavy = 1, op.kind in REUSED_TRANSCENDENTALS
        for source in action.reads:
            if source in inlined:
                reads.update(dict.fromkeys(inlined[source]))
                ops += made_of[source][0]
                heavy = heavy or made_of[source][1]
            else:
                reads[source] = None
        reused = len({actions[reader].op for reader in reading}) > 1
        if len(reads) > ACCUMULATED_READS or ops > LARGE_OPS or reused and (
                len(reads) > REUSED_READS or ops > REUSED_OPS or heavy):
            continue
        inlined[buffer] = tuple(reads)
        made_of[buffer] = (ops, heavy)
    return inlined


def stored_last_reads(actions: Sequence[Action], inlined: Mapping[str, tuple[str, ...]]
                      ) -> dict[str, int]:
    """Each buffer's last reader, an inlined buffer's readers reading what it stands for."""
    last_read: dict[str, int] = {}
    if not inlined:
        for index, action in enumerate(actions):  # once per simulated plan
            for buffer in action.reads:
                last_read[buffer] = index
        return last_read
    for index, action in enumerate(actions):
        for buffer in action.reads:
            last_read.update(dict.fromkeys(inlined.get(buffer, (buffer,)), index))
    return last_read


def in_place_writes(graph: CostGraph, actions: Sequence[Action], outputs: frozenset[str],
                    inlined: Mapping[str, tuple[str, ...]],
                    buffer_bytes: Mapping[str, int]) -> dict[str, str]:
    """The stored values of ``actions`` that inductor writes into the storage of a buffer their
    kernel reads last, each with that buffer (whose bytes it takes: nothing is allocated).

    The rule, as inductor decides it for a generated kernel's output: the kernel is pointwise
    (``_elementwise``) and stores a value the module does not return; the buffer it takes has
    the same bytes, is made by an op of the same module (a module's inputs are taken only
    where AOTAutograd donates them, which this does not count), is not returned either, and
    this kernel is its last reader, through the inlined values it computes. The value is read
    with the index it is written with: this takes only a buffer read along fx data edges of
    ops that allocate (an op read through a view, a ``getitem`` or a permute is not taken,
    whatever its layout), by an op that reads where it writes (not ``READ_ELSEWHERE``), so
    it never claims an in-place write inductor does not make.
    """
    last_read = stored_last_reads(actions, inlined)
    made_by: dict[str, tuple[str, str]] = {}  # buffer -> (its op, the module that made it)
    direct: dict[str, tuple[str, ...]] = {}  # inlined buffer -> stored buffers it reads directly
    taken: dict[str, str] = {}
    for index, action in enumerate(actions):
        if action.kind not in ("compute", "recompute"):
            continue
        phase = action_phase(graph, action)
        op = graph.op(action.op)
        reached = _read_directly(action, op.depends_on, made_by, direct, inlined)
        if len(action.allocates) == 1 and action.allocates[0] in inlined:
            direct[action.allocates[0]] = reached
        elif (len(action.allocates) == 1 and action.allocates[0] not in outputs
              and _elementwise(graph, action) and op.kind not in READ_ELSEWHERE):
            written = action.allocates[0]
            size = buffer_bytes.get(written, 0)
            for source in reached:  # each source dies at one action: none is taken twice
                if (size and last_read.get(source) == index and source not in outputs
                        and made_by[source][1] == phase and buffer_bytes.get(source) == size):
                    taken[written] = source
                    break
        for buffer in action.allocates:
            made_by[buffer] = (action.op, phase)
    return taken


def _read_directly(action: Action, depends_on: Sequence[str],
                   made_by: Mapping[str, tuple[str, str]], direct: Mapping[str, tuple[str, ...]],
                   inlined: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The stored buffers ``action`` reads along fx data edges (its op's ``depends_on``), through
    the inlined values it reads so, in the order it reads them."""
    reached: dict[str, None] = {}
    for buffer in action.reads:
        if buffer not in made_by or made_by[buffer][0] not in depends_on:
            continue
        if buffer in inlined:
            reached.update(dict.fromkeys(direct.get(buffer, ())))
        else:
            reached[buffer] = None
    return tuple(reached)


def pinned_and_anchors(graph: CostGraph, actions: Sequence[Action],
                       buffer_bytes: Mapping[str, int]) -> dict[int, tuple[int, ...]]:
    """The actions ``memfit.lowering.inductor.pin_planned_order`` pins (a swap-in, or the first
    re-run of a chain), each with its anchors, by that function's rule read on the actions.
    Inductor stores the values of both (``control_deps`` realizes them).

    The rule, as the lowering applies it to each module's nodes: of the actions since the
    previous pinned one that read, directly or not, what a pinned action made (before the first,
    every action), those no later such action read (the frontier) are the candidates; a swap-in
    waits for the last one that is not elementwise, else the last one; a re-run chain for the
    last one and each that frees, or follows from one that frees, a buffer at least as large as
    the chain's first value. Where the module reads a value through a view the lowering sees
    the view and this reads the value, so a value read only through views can leave the
    lowering's frontier later than here: its anchors are then a subset of these.
    """
    made_by: dict[str, int] = {}
    last_reader: dict[str, int] = {}
    for index, action in enumerate(actions):
        for buffer in action.allocates:
            made_by[buffer] = index
        for buffer in action.reads:
            last_reader[buffer] = index
    frees: dict[int, int] = {}
    for buffer, index in last_reader.items():
        frees[index] = max(frees.get(index, 0), buffer_bytes.get(buffer, 0))
    pins: dict[int, tuple[int, ...]] = {}
    latest = realized = previous = -1
    frontier: dict[int, None] = {}
    ordered: set[int] = set()
    module = ""
    for index, action in enumerate(actions):
        if action.kind in ("compute", "recompute") and action_phase(graph, action) != module:
            module = action_phase(graph, action)  # another module: its own pins
            latest = realized = previous = -1
            frontier, ordered = {}, set()
        sources = {made_by[buffer] for buffer in action.reads if buffer in made_by}
        anchorable = _can_anchor(action)
        if action.kind in _PINNED and not any(actions[source].kind in _PINNED
                                              for source in sources):
            if action.kind == "swap_in":
                anchors = [next((at for at in (realized, latest, previous) if at >= 0), -1)]
            else:
                least = sum(buffer_bytes.get(buffer, 0) for buffer in action.allocates)
                anchors = [at for at in frontier if at == latest or frees.get(at, 0) >= least]
                anchors = anchors or [previous]
            anchors = [at for at in anchors if at >= 0]
            pins[index] = tuple(anchors)
            previous = index if anchorable else (anchors[-1] if anchors else previous)
            ordered.add(index)
            latest, realized, frontier = -1, -1, {}
        elif ordered and ordered.isdisjoint(sources):
            continue
        elif ordered:
            ordered.add(index)
        if anchorable:
            latest = index
            if not _elementwise(graph, action):
                realized = index
            for source in sources:
                if source in frontier:
                    del frontier[source]
                    frees[index] = max(frees.get(index, 0), frees.get(source, 0))
            frontier[index] = None
    return pins


def _can_anchor(action: Action) -> bool:
    """Whether the lowering's node for ``action`` has one tensor value (not a view, a tuple or
    nothing): a copy to the host is one, though not on the device."""
    return action.kind == "swap_out" or len(action.allocates) == 1 and action.kind != "wait"


def _elementwise(graph: CostGraph, action: Action) -> bool:
    """Whether ``action`` runs a pointwise op (PyTorch's ``pointwise`` tag, read as: fusible, no
    reduction, no op that writes through indices or joins tensors)."""
    if action.kind not in ("compute", "recompute"):
        return False
    op = graph.op(action.op)
    return fusible(op) and op.kind not in REDUCTIONS and op.kind not in STORED_KINDS


def action_phase(graph: CostGraph, action: Action) -> str:
    """The pass whose module runs ``action``: a re-run of a forward op runs in the backward."""
    return "backward" if action.kind == "recompute" else graph.op(action.op).phase
