"""Device bytes that eager code holds while a planned region runs: the user's loss, code at a
graph break, tensors the loop keeps.

No plan covers what runs between and after the compiled regions, yet the device holds it while a
region runs: CPU ``mse_loss`` (reduced) returns a 0-dim view of an input-sized elementwise buffer
that lives under the user's ``loss`` until the backward ends; the loss's target lives in the
loop. memfit reads these bytes at the start of each region's measured runs and plans the region
again with room for them (``Backend.iteration_closed``).

On CUDA the allocator says it: ``torch.cuda.memory_allocated`` at the region's start, less what
memfit knows to be alive there. A CPU allocator has no such counter, so on a CPU an
``EagerWatch`` notes the storages that ops run outside the regions make or read: a dispatch mode
that Dynamo leaves compiled code running under (``ignore_compile_internals``; an ordinary mode
makes Dynamo fall back to eager), kept on the thread's mode stack only over the iterations memfit
measures. A tensor made before the watch started and never passed to an op since is not in
it, nor one an op only copies, samples from or reads rows of (a ``TensorDataset`` in a
``DataLoader``, a list of batches the loop copies: the step holds the batch made of them).

Example:
    >>> watch = EagerWatch(torch.device("cpu"))
    >>> watch.start(); loss = loss_fn(model(x), y); watch.stop()
    >>> watch.held_bytes(counted=[x, *model.parameters()])
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from memfit.ops.host import is_host_storage
from memfit.runtime.resident import local_tensor

# ops that make new data from what they read: a tensor made before the watch that only these
# read is a store the loop draws its batches from, not the step's
SOURCE_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "index", "index_select", "gather", "take", "take_along_dim", "embedding", "masked_select",
    "clone", "_to_copy", "copy_"))


class EagerWatch(TorchDispatchMode):
    """Notes, weakly, the device storages eager code holds while ``recording``;
    ``held_bytes`` sums those still alive:

    - what an op run inside it makes (a result that is no input's storage; all of
      ``lift_fresh``'s: ``torch.tensor``'s new data);
    - what an op reads that a compiled region made (``note_made``) or that holds a parameter
      (another model's weights);
    - a tensor made before the watch that an op reads or writes whole (the loop's target, an
      average of the weights it updates in place), over that iteration and the next
      (``new_iteration``). Not one an op copies or samples from (``SOURCE_OPS``) or views (a
      dataset's rows): a CPU's profiler sees only what is allocated while it runs, and the
      step holds the batch made of them.

    Compiled regions run with ``recording`` off (``paused``), so what it holds is eager
    code's."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.recording = True
        self.thread = threading.get_ident()  # a mode stack is per thread: only this one's ops
        self._storages: dict[StorageWeakRef, int] = {}
        self._made: dict[StorageWeakRef, int] = {}  # made while watched (ops and regions)
        # tensors made before the watch that ops read whole, in this iteration and the last
        self._read: dict[StorageWeakRef, int] = {}
        self._read_before: dict[StorageWeakRef, int] = {}
        self._loop_storages: dict[StorageWeakRef, int] = {}  # the model's call arguments
        self._pruned_at = 0  # entries after the last pruning of dead storages
        self._windows: dict[Any, GapWindow] = {}  # open regions' gaps (``open_window``)
        self.pushed_in_compiled_calls = 0  # ``compiled_calls_open`` when it was put on the stack

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo keeps compiling and running compiled code while this mode is on."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.recording:
            made, read = self._storages_of(result), self._storages_of((args, kwargs))
            self.note_op(func, (args, kwargs), made, read)
            for window in self._windows.values():
                window.grow(made, read)
        return result

    def note_op(self, func: Any, inputs: Any, results: dict[StorageWeakRef, int],
                read: dict[StorageWeakRef, int]) -> None:
        """Note what op ``func`` made (``results``: its result storages, with ``read`` those of
        its ``inputs``) and what of its inputs eager code holds (see the class)."""
        made = (results if func is torch.ops.aten.lift_fresh.default
                else {ref: size for ref, size in results.items() if ref not in read})
        self._made.update(made)
        self._storages.update(made)
        # a batch drawn from a store: copied, sampled or viewed (in place: the loop's own state)
        source = getattr(func, "overloadpacket", None) in SOURCE_OPS or getattr(
            func, "is_view", False)
        for leaf in tree_leaves(inputs):
            storage = self._device_storage(leaf)
            if storage is None:
                continue
            reference = StorageWeakRef(storage)
            if reference in self._made or isinstance(leaf, torch.nn.Parameter):
                self._storages.setdefault(reference, storage.nbytes())
            elif not source and leaf.numel() * leaf.element_size() >= storage.nbytes():
                self._read.setdefault(reference, storage.nbytes())
        if len(self._storages) > 2 * self._pruned_at + 1024:  # drop the dead now and then
            self._prune()

    def new_iteration(self) -> None:
        """An iteration's backward ended: what ops read of the tensors made before the watch
        counts over this iteration and the next (the loop's target; another model's state its
        optimizer reads each step), not beyond: of a list of batches made before the loop, one
        or two are the step's, not all that were read."""
        self._read_before, self._read = self._read, {}

    def note_made(self, values: Any) -> None:
        """Note the device storages of ``values`` as made while watched (a compiled region's
        outputs): counted once an eager op reads them."""
        if self.recording:
            self._note_into(self._made, values)

    def open_window(self, key: Any, outputs: Any,
                    alive_bytes: Callable[[dict[StorageWeakRef, int]], int],
                    alive_each_op: bool = False) -> None:
        """Track, from now until ``close_window(key)``, the most bytes eager ops make and keep
        alive at once, less the bytes of ``outputs`` (a region's forward outputs, which its plan
        holds to the end) freed by then: what eager code holds at its own peak between a
        region's forward and backward (a loss's softmax and its gradient), which no reading at
        a region's start sees; and, at that peak, every byte alive on the device as
        ``alive_bytes`` counts it, given the storages eager code made (``alive_each_op``: the
        most it counts after any op, for a window where what the device holds beside eager
        code's own bytes changes: another model's weights read as it runs)."""
        self._windows[key] = GapWindow(outputs=self._storages_of(outputs),
                                       alive_bytes=alive_bytes, alive_each_op=alive_each_op)

    def close_window(self, key: Any) -> tuple[int, int]:
        """Eager code's most bytes that the window ``key`` saw, and the device's bytes alive
        then ((0, 0) for none open)."""
        window = self._windows.pop(key, None)
        return (window.peak_bytes, window.alive_at_peak_bytes) if window is not None else (0, 0)

    def _storages_of(self, values: Any) -> dict[StorageWeakRef, int]:
        found: dict[StorageWeakRef, int] = {}
        self._note_into(found, values)
        return found

    def note_call_arguments(self, values: Any) -> None:
        """Note the tensors the loop passed to the model in this call, weakly, in place of the
        last call's: held by the loop beside every region but the ones given them, even where an
        earlier region saved them for its backward (that region's saves leave its inputs out:
        ``memfit.compiler.region.saved_device_bytes``). Earlier batches are the loop's to keep
        or drop: where it keeps them (a list of batches), eager ops that read them count them.
        """
        self._loop_storages = {}
        self._note_into(self._loop_storages, values)

    def noted_storages(self) -> dict[StorageWeakRef, int]:
        """The storages ``held_bytes`` counts that are alive, with their bytes (the model's
        and others it counts elsewhere included)."""
        return {ref: size for ref, size in {**self._read_before, **self._read,
                                            **self._storages}.items() if not ref.expired()}

    def loop_storages(self) -> dict[StorageWeakRef, int]:
        """The storages of the model's latest call arguments still alive, with their bytes."""
        return {ref: size for ref, size in self._loop_storages.items() if not ref.expired()}

    def _note_into(self, storages: dict[StorageWeakRef, int], values: Any) -> None:
        for leaf in tree_leaves(values):
            storage = self._device_storage(leaf)
            if storage is not None:
                storages.setdefault(StorageWeakRef(storage), storage.nbytes())

    def _device_storage(self, leaf: Any) -> Any:
        """``leaf``'s storage where it is a dense tensor on the watched device (a DTensor's
        shard's), not memfit's host tier; else ``None``."""
        if (not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided
                or leaf.device != self.device or leaf.is_meta
                or torch._subclasses.fake_tensor.is_fake(leaf)):
            return None
        storage = local_tensor(leaf).untyped_storage()
        return None if is_host_storage(storage) else storage

    def _prune(self) -> None:
        self._storages = {ref: size for ref, size in self._storages.items() if not ref.expired()}
        self._made = {ref: size for ref, size in self._made.items() if not ref.expired()}
        self._read = {ref: size for ref, size in self._read.items() if not ref.expired()}
        self._read_before = {ref: size for ref, size in self._read_before.items()
                             if not ref.expired()}
        self._loop_storages = {ref: size for ref, size in self._loop_storages.items()
                               if not ref.expired()}
        self._pruned_at = len(self._storages)

    def held_bytes(self, counted: Iterable[Any], storages: Iterable[StorageWeakRef] = (),
                   own_storages: Iterable[StorageWeakRef] = ()) -> int:
        """Bytes of the noted storages alive now, less those of the tensors in ``counted`` and
        of ``storages`` (what memfit counts already: the model, optimizer state, the region's
        arguments, the saves of open regions). The model's call arguments are less only those
        in ``counted`` and ``own_storages`` (the saves of the region measured): another
        region's saves leave its inputs out."""
        self._prune()
        known = {StorageWeakRef(local_tensor(leaf).untyped_storage()) for leaf in tree_leaves(list(counted))
                 if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided
                 and not leaf.is_meta}
        known.update(own_storages)
        loop = {ref: size for ref, size in self._loop_storages.items() if ref not in known}
        known.update(storages)
        held = {ref: size for ref, size in {**self._read_before, **self._read,
                                            **self._storages}.items() if ref not in known}
        return sum({**held, **loop}.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is noted inside the block (a compiled region's run)."""
        recording, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = recording

    def start(self) -> None:
        """Put the watch on this thread's mode stack, where no mode of the user's is on (a mode
        that ends later would otherwise pop this one), and never inside a backward (autograd
        puts each node's thread state back after it runs). Another model's watch left on top
        (its backend stopped measuring with no call since to take it off) is taken off: one
        watch at a time, the latest fitted model's."""
        if (threading.get_ident() != self.thread or self.on_stack()
                or torch._C._current_graph_task_id() != -1):
            return
        while torch._C._len_torch_dispatch_stack() > 0:
            top = _get_current_dispatch_mode()
            if not isinstance(top, EagerWatch) or not top.may_leave_the_stack():
                return
            top.__exit__(None, None, None)
        self.__enter__()
        self.pushed_in_compiled_calls = compiled_calls_open()

    def stop(self) -> None:
        """Take the watch off the mode stack where it is on top (outside a backward), and not
        inside a ``torch.compile``d call it was put on before (``may_leave_the_stack``); what
        it noted stays readable."""
        if (threading.get_ident() == self.thread and self.on_stack()
                and torch._C._current_graph_task_id() == -1 and self.may_leave_the_stack()):
            self.__exit__(None, None, None)

    def may_leave_the_stack(self) -> bool:
        """Whether taking the watch off the stack now leaves the dispatch keys as they should
        be: not inside a ``torch.compile``d call that began after the watch was put on (an
        optimizer step the loop compiled runs memfit's step hook). Dynamo puts back the
        dispatch keys it saw at such a call when it returns, the Python key among them, which
        with no mode left on the stack fails every later op."""
        return compiled_calls_open() <= self.pushed_in_compiled_calls

    def on_stack(self) -> bool:
        return (torch._C._len_torch_dispatch_stack() > 0
                and _get_current_dispatch_mode() is self)


def compiled_calls_open() -> int:
    """How many calls of ``torch.compile``d functions this thread is inside (Dynamo's
    ``compile_wrapper`` frames on the Python stack)."""
    from torch._dynamo import eval_frame

    count, frame = 0, sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == eval_frame.__file__:
            count += 1
        frame = frame.f_back
    return count


@dataclasses.dataclass
class GapWindow:
    """Eager code's high-water mark over a stretch of the iteration: storages eager ops made in
    it (not views of their inputs) that are alive, less ``outputs`` freed (room a plan that
    holds its outputs to the end counts), and what ``alive_bytes`` counts on the device at
    that high-water mark."""

    outputs: dict[StorageWeakRef, int]
    alive_bytes: Callable[[dict[StorageWeakRef, int]], int]
    alive_each_op: bool = False
    made: dict[StorageWeakRef, int] = dataclasses.field(default_factory=dict)
    peak_bytes: int = 0
    alive_at_peak_bytes: int = 0

    def grow(self, results: dict[StorageWeakRef, int], inputs: dict[StorageWeakRef, int]) -> None:
        """Count an op's new result storages, and the bytes alive now toward the peak."""
        for ref, size in results.items():
            if ref not in inputs and ref not in self.outputs:
                self.made.setdefault(ref, size)
        self.made = {ref: size for ref, size in self.made.items() if not ref.expired()}
        freed = sum(size for ref, size in self.outputs.items() if ref.expired())
        held = sum(self.made.values()) - freed
        if held > self.peak_bytes or self.alive_each_op:
            self.peak_bytes = max(self.peak_bytes, held)
            self.alive_at_peak_bytes = max(self.alive_at_peak_bytes, self.alive_bytes(self.made))


CUDA_BLOCK_BYTES = 512  # CUDA's caching allocator rounds every block up to a multiple of this


def cuda_outside_bytes(device: torch.device, counted: Iterable[Any], saves_bytes: int) -> int:
    """Bytes CUDA's allocator holds on ``device`` now beyond the storages in ``counted`` (each as
    the allocator sizes its block) and ``saves_bytes`` of other regions' saves: what no plan
    knows of (eager code's tensors)."""
    sizes: dict[StorageWeakRef, int] = {}
    for leaf in tree_leaves(list(counted)):
        if isinstance(leaf, torch.Tensor) and leaf.device == device:
            storage = local_tensor(leaf).untyped_storage()
            blocks = -(-storage.nbytes() // CUDA_BLOCK_BYTES)
            sizes.setdefault(StorageWeakRef(storage), blocks * CUDA_BLOCK_BYTES)
    return max(0, torch.cuda.memory_allocated(device) - sum(sizes.values()) - saves_bytes)
