"""Executor: runs a (rewritten) fx graph node by node, freeing each value right after its last use.

Memory follows program order exactly as ``memfit.model.schedule.memory_profile`` models it: a
node's outputs are allocated, then the values it was the last user of are dropped (and a value
nobody uses is dropped right after it is made). The swap ops run inside the executor's copy
engine.

Example:
    >>> executor = Executor(graph_module, device="cpu")
    >>> loss, *grads = executor.run(*parameters, *inputs)

Note:
    It runs under ``torch.no_grad()``: the graph already contains the backward pass, and with
    grad mode on autograd would keep every intermediate alive until the step ends. A
    multi-output node's value is a tuple that keeps all its outputs alive until the last
    ``getitem`` of it runs; the planner models exactly that.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from memfit.runtime.streams import CopyEngine, active_engine


def last_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the values to drop right after it runs (one reverse scan).

    A value is dropped after its last user; a value with no users (other than the output node's
    own value) is dropped right after the node that makes it.
    """
    free_after: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    seen: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        for used in node.all_input_nodes:
            if used not in seen:
                seen.add(used)
                free_after.setdefault(node, []).append(used)
        if node not in seen and node.op != "output":
            seen.add(node)
            free_after.setdefault(node, []).append(node)
    return free_after


def _drain(values: collections.deque) -> Iterator[Any]:
    """Yield and forget each value, so that nothing here keeps an input alive once it is taken."""
    while values:
        yield values.popleft()


class Executor(torch.fx.Interpreter):
    """A ``torch.fx.Interpreter`` that frees values at their last use and runs the swap ops.

    Args:
        module: the graph module to run (its graph may contain ``memfit::swap_out``/
            ``swap_in``/``wait`` nodes).
        device: the compute device; decides the copy engine (streams, pinned host pool).
        engine: a copy engine to reuse instead of building one for ``device``.
        synchronize: wait for every stream before returning (default ``True``, so the outputs
            and the measured peak are final; turn off to overlap with the next host work).

    Raises:
        RuntimeError: from ``run`` if a node fails, naming the node (as ``Interpreter`` does).
    """

    def __init__(
        self,
        module: torch.fx.GraphModule,
        device: torch.device | str = "cpu",
        engine: CopyEngine | None = None,
        synchronize: bool = True,
    ) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.engine = engine if engine is not None else CopyEngine(device)
        self.synchronize = synchronize
        # Interpreter's own table, extended with values nobody reads (freed where they are made).
        self.user_to_last_uses = last_uses(self.graph)

    def run(self, *args: Any) -> Any:
        """Run the graph on ``args`` (as the graph module would be called) and return its outputs."""
        flat_inputs = list(self.graph.process_inputs(*args))
        del args
        return self.graph.process_outputs(self.run_flat(flat_inputs))

    def run_flat(self, inputs: list[Any]) -> Any:
        """Run on a flat list with one value per placeholder; return the output node's value.

        The list is emptied, so the caller holds no extra references to the inputs: an input
        the caller also drops (a user input only the forward pass reads, say) is freed at its
        last use in the graph, as ``Interpreter.boxed_run`` does.
        """
        self.args_iter = _drain(collections.deque(inputs))
        inputs.clear()
        try:
            with torch.no_grad(), active_engine(self.engine):
                self.env = {}
                result = self._run_nodes()
                if self.synchronize:
                    self.engine.synchronize()
                    self.engine.clear()
        finally:
            self.env = {}
            self.args_iter = iter(())
        return result

    def _run_nodes(self) -> Any:
        """``Interpreter.run``'s loop, without its argument tuple (which would pin every input)."""
        for node in self.graph.nodes:
            try:
                self.env[node] = self.run_node(node)
            except Exception as error:
                if hasattr(error, "add_note"):  # Python 3.11+
                    error.add_note(f"memfit Executor, while executing {node.format_node()}")
                raise
            for value in self.user_to_last_uses.get(node, ()):
                del self.env[value]
            if node.op == "output":
                return self.env[node]
        return None

    # ---- one method per node kind ------------------------------------------------------------

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """The next input; ``args_iter`` holds each input only until its placeholder runs."""
        try:
            return next(self.args_iter)
        except StopIteration:
            if args:
                return args[0]  # the placeholder's default value
            raise RuntimeError(
                f"Executor: missing input for placeholder {target!r}; pass one value per placeholder"
            ) from None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """Call the op (aten, ``memfit::`` swap ops, ``operator.getitem``)."""
        return target(*args, **kwargs)

    def output(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """The graph's outputs, as the output node lists them."""
        return args[0]
