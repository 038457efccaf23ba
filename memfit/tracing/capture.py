"""Capture one training step as a joint forward+backward fx graph of aten ops.

``capture(model, loss_fn, *inputs)`` traces ``loss_fn(model, *inputs)`` and its gradient with
``torch._functorch.aot_autograd.aot_export_joint_with_descriptors``. Every placeholder and output
of that graph carries a *descriptor* (``meta["desc"]``) saying what it is: a parameter (by its
qualified name), a buffer, a user input, the loss's tangent, a parameter's gradient, or a buffer
mutation (BatchNorm's running statistics). memfit binds values by those descriptors, never by
position, so tied weights (GPT-2's ``lm_head``/``wte``) and buffer updates come out right.

Note:
    The joint export does not record ``nn_module_stack``, so each node's module path ("scope",
    TFLMS's name for it) is recorded with global module hooks that enter
    ``torch.fx.traceback.annotate`` around every module's forward; the annotation reaches both the
    forward nodes and the backward nodes autograd derives from them.

    Captures run one at a time in a process (``_CAPTURE_LOCK``): aot export keeps tracing state
    in process globals (``torch.fx.traceback``'s annotation level, the patcher of
    ``torch.fx._symbolic_trace``), and two captures at once in two threads corrupt each other's
    ("Expected current_level > 0"). The module hooks are process-wide too, so they annotate only
    modules run by the capturing thread. Planning and running a step need no lock.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._decomp import get_decompositions
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from memfit.data.errors import CaptureError
from memfit.data.hardware import Hardware

SCOPE_KEY = "memfit_scope"

# Ops whose real kernels return a small result as a view into a larger internal buffer (the CPU
# ``mse_loss`` keeps its whole elementwise-loss buffer alive behind a 0-d loss), while their fake
# kernels allocate only the result. Decomposing them makes the graph show every allocation, so
# the planner's memory model stays exact. ``tests/models`` checks every real storage against the
# fake one, so a new such op is caught there.
DECOMPOSE = get_decompositions([torch.ops.aten.mse_loss])


def _mse_loss_backward_of_empty(grad_output: torch.Tensor, input: torch.Tensor,
                                target: torch.Tensor, reduction: int) -> object:
    """``mse_loss_backward`` of an empty batch, as the eager kernel computes it (an empty grad).

    Why: torch's fake kernel for it divides by ``input.numel()`` in Python, so an empty batch
    failed to capture with ``ZeroDivisionError`` although eager PyTorch returns a nan loss and
    an empty gradient. Any other input returns ``NotImplemented``: the op is traced as it is.
    """
    if input.numel() != 0:
        return NotImplemented
    return (input - target) * grad_output


DECOMPOSE[torch.ops.aten.mse_loss_backward.default] = _mse_loss_backward_of_empty
TYPE_KEY = "memfit_type"
# torch's tracing state is process-global: one capture at a time (see the module's Note).
_CAPTURE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Binding:
    """What a placeholder or an output of the captured graph stands for.

    Args:
        kind: ``"parameter"``, ``"buffer"``, ``"input"`` (a user input, by position),
            ``"tangent"`` (the seed of backward), ``"loss"``, ``"gradient"`` (of a parameter) or
            ``"buffer_update"`` (the new value of a mutated buffer).
        target: the parameter or buffer's qualified name in the user's model.
        index: the user input's position.
    """

    kind: str
    target: str = ""
    index: int = -1


@dataclass
class Captured:
    """A captured step: the graph and what its inputs and outputs mean."""

    graph_module: torch.fx.GraphModule
    inputs: tuple[Binding, ...]
    outputs: tuple[Binding, ...]
    signature: tuple = ()
    meta: dict = field(default_factory=dict)


class _StepModule(torch.nn.Module):
    """``loss_fn(model, *inputs)`` as a module, so that aot export sees the model's state."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        return scalar_loss(self.loss_fn(self.model, *inputs))


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss``, what ``loss_fn`` returned, where it is a one-element tensor.

    Raises:
        CaptureError: for anything else, saying to reduce it inside ``loss_fn``.
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
           else type(loss).__name__)
    raise CaptureError(f"loss_fn must return a scalar tensor, got {got}: reduce it (e.g. "
                       ".mean()) inside loss_fn")


def input_signature(model: torch.nn.Module, inputs: Sequence) -> tuple:
    """What decides whether a captured graph can be reused: shapes, dtypes, devices, mode."""
    return (
        model.training,
        tuple((tuple(t.shape), t.dtype, str(t.device), t.requires_grad) for t in inputs),
    )


def check_inputs(inputs: Sequence) -> None:
    """Raise ``ValueError`` unless every input is a tensor."""
    for position, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"input {position} is a {type(value).__name__}: memfit steps take tensors only; "
                "close over other values in loss_fn instead"
            )


def capture(model: torch.nn.Module, loss_fn: Callable, *inputs: torch.Tensor,
            hardware: Hardware | None = None, autocast: torch.dtype | None = None) -> Captured:
    """Trace ``loss_fn(model, *inputs)`` and its backward into one aten fx graph.

    Args:
        model: the module whose parameters receive gradients.
        loss_fn: ``loss_fn(model, *inputs) -> scalar tensor``.
        inputs: tensors (real, or ``meta`` to capture without data).
        hardware: the profile the step is planned for: its device's kernels and autocast
            policy are traced (``memfit.tracing.target``); ``None``: the step as it runs here.
        autocast: the target's autocast dtype (``torch.bfloat16``, ``torch.float16``).

    Raises:
        ValueError: if an input is not a tensor.
        CaptureError: if tracing fails, naming the op and the user's source line.
    """
    check_inputs(inputs)
    refuse_meta_parameters(model)
    if any(t.device.type == "meta" for t in inputs):
        inputs = _fake_inputs(model, inputs)
    step = _StepModule(model, loss_fn)
    with _CAPTURE_LOCK, _record_scopes(model), contextlib.ExitStack() as stack:
        stack.enter_context(_personality(model, hardware, autocast))
        try:
            joint = aot_export_joint_with_descriptors(
                stack, step, tuple(inputs), decompositions=DECOMPOSE
            )
        except CaptureError:
            raise
        except Exception as error:  # tracing errors come in many types; keep each one's own
            raise CaptureError(_explain(error)) from error
    graph_module = joint.graph_module
    bindings_in = tuple(_bind(n.meta.get("desc")) for n in _placeholders(graph_module))
    output_node = graph_module.graph.find_nodes(op="output")[0]
    bindings_out = tuple(_bind(d) for d in output_node.meta.get("desc", ()))
    _check_gradients(model, bindings_out, output_node.args[0])
    refuse_sparse_values(graph_module.graph)
    return Captured(graph_module, bindings_in, bindings_out, input_signature(model, inputs))


def _personality(model: torch.nn.Module, hardware: Hardware | None,
                 autocast: torch.dtype | None) -> contextlib.AbstractContextManager:
    """What the trace runs under: the target's personality for a profile, else this device's
    own autocast (or nothing)."""
    from memfit.tracing.target import retargeted

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if hardware is not None:
        return retargeted(hardware, device, autocast)
    if autocast is not None:
        return torch.autocast(device.type, dtype=autocast)
    return contextlib.nullcontext()


def refuse_sparse_values(graph: torch.fx.Graph) -> None:
    """Refuse a graph with a tensor of a sparse layout (``nn.Embedding(sparse=True)``'s
    gradient) before anything runs: memfit prices each value by its storage, and a sparse tensor
    has none of its own (it keeps its indices and values alive), so a plan of it could leave
    the budget.

    Raises:
        CaptureError: naming the module that made it and what to do.
    """
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            custom = node.meta.get("custom", {})
            made_by = (f" by {custom.get(TYPE_KEY, 'a module')} '{custom[SCOPE_KEY]}'"
                       if custom.get(SCOPE_KEY) else "")
            raise CaptureError(
                f"memfit does not plan tensors of layout {value.layout}: the step makes one "
                f"({node.target}){made_by}, such as nn.Embedding(sparse=True)'s gradient. Use "
                "dense gradients (sparse=False), or fit only the modules after the embedding "
                "(memfit.fit(model.body, ...)), which leaves it to run eagerly")


def refuse_meta_parameters(model: torch.nn.Module) -> None:
    """Refuse a trainable model whose parameters are on the meta device, before tracing.

    Why: such a trace loses its backward pass, wholly or in part, without an error: a
    transformers GPT-2's loss comes out detached from meta weights; a transformers Llama traced
    for an H100 profile kept 75 of its 162 backward ops (1 layer), and a plan of that graph
    would price and budget a step that is not the one that runs. ``model.to_empty(device=
    "cpu")`` gives real (unfilled, so untouched) pages and a whole backward pass.
    """
    if any(p.requires_grad and p.device.type == "meta" for p in model.parameters()):
        raise CaptureError(
            "the model's parameters are on the meta device, where tracing loses the backward "
            "pass: build it on the CPU, or on the meta device and then "
            "model.to_empty(device='cpu') (pages not written take no memory), and pass meta "
            "inputs")


def _check_gradients(model: torch.nn.Module, outputs: tuple[Binding, ...],
                     values: Sequence) -> None:
    """Refuse a step whose backward pass computes no gradient while parameters want one: its
    plan would price a forward pass only (a model built on the meta device does this: the
    transformers' loss comes out detached from the meta weights)."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable or any(b.kind == "gradient" and value is not None
                            for b, value in zip(outputs, values, strict=True)):
        return
    raise CaptureError(
        f"the captured step computes no gradient for any of the model's {len(trainable)} "
        "trainable parameters, so there is no backward pass to plan; check that loss_fn's "
        "result depends on the parameters (no .detach(), no torch.no_grad())")


def _placeholders(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(graph_module.graph.find_nodes(op="placeholder"))


def _strip(target: str) -> str:
    return target.removeprefix("model.")


def _bind(desc) -> Binding:
    """Turn an aot descriptor into a Binding, by its type name (the classes are private)."""
    kind = type(desc).__name__
    if desc is None:
        return Binding("unused")
    if kind == "ParamAOTInput":
        return Binding("parameter", _strip(desc.target))
    if kind == "BufferAOTInput":
        return Binding("buffer", _strip(desc.target))
    if kind == "PlainAOTInput":
        return Binding("input", index=desc.idx)
    if kind == "TangentAOTInput":
        return Binding("tangent")
    if kind == "PlainAOTOutput":
        return Binding("loss", index=desc.idx)
    if kind == "GradAOTOutput":
        inner = desc.grad_of
        if type(inner).__name__ != "ParamAOTInput":
            return Binding("gradient_of_input")
        return Binding("gradient", _strip(inner.target))
    if kind == "InputMutationAOTOutput":
        inner = desc.mutated_input
        if type(inner).__name__ == "BufferAOTInput":
            return Binding("buffer_update", _strip(inner.target))
        raise CaptureError(
            f"the step mutates an input in place ({inner}); memfit updates only buffers in place: "
            "clone the input inside loss_fn before mutating it"
        )
    raise CaptureError(f"memfit does not know the graph descriptor {desc!r}; please report it")


@contextlib.contextmanager
def _record_scopes(model: torch.nn.Module):
    """Annotate every traced node with the path and class of the module that produced it."""
    names = {module: name for name, module in model.named_modules()}
    entered: list[contextlib.AbstractContextManager] = []
    capturing_thread = threading.get_ident()

    def pre_hook(module, args):
        if threading.get_ident() != capturing_thread:
            return  # a module another thread runs meanwhile (the hooks are process-wide)
        label = {SCOPE_KEY: names.get(module, ""), TYPE_KEY: type(module).__name__}
        manager = fx_traceback.annotate(label)
        manager.__enter__()
        entered.append(manager)

    def post_hook(module, args, output):
        if threading.get_ident() == capturing_thread and entered:
            entered.pop().__exit__(None, None, None)

    pre = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    post = torch.nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        while entered:
            entered.pop().__exit__(None, None, None)


def _fake_inputs(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple:
    """Meta inputs as fake tensors on the model's device: shapes to trace, no data, no copy.

    Note:
        aot export reuses the fake mode of fake inputs; a meta *model* instead breaks on code
        that makes real tensors on the model's device while tracing (transformers' caches).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return tuple(
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if t.device.type == "meta" else mode.from_tensor(t)
            for t in inputs
        )


def _is_data_dependent(error: BaseException) -> bool:
    """Whether tracing failed because the step needs a tensor's values, which fake tensors lack:
    ``.item()``, ``bool(x)``, ``.tolist()`` (``DataDependentOutputException``), an output whose
    shape depends on values (``nonzero``, boolean masks: ``DynamicOutputShapeException``), a
    branch on a value-dependent size (``GuardOnDataDependentSymNode``), or ``.numpy()``."""
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException,
                          GuardOnDataDependentSymNode)):
        return True
    return isinstance(error, RuntimeError) and ".numpy() is not supported" in str(error)


def _user_frame(error: BaseException) -> str:
    """`` at file:line (source)`` of the innermost traceback frame outside torch, memfit and the
    standard library (the user's code, or a library it calls), or ``""`` if there is none."""
    frames = traceback.extract_tb(error.__traceback__)
    library_dirs = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    standard_library = sysconfig.get_paths()["stdlib"]
    installed = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    user = [f for f in frames if not f.filename.startswith(library_dirs)
            and (f.filename.startswith(installed) or not f.filename.startswith(standard_library))]
    return f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line})" if user else ""


def _explain(error: BaseException) -> str:
    """The message of a ``CaptureError`` for a tracing error: the error's own message and the
    user's source line; the data-dependence advice only when values were needed."""
    where = _user_frame(error)
    text = str(error).strip() or type(error).__name__
    if not _is_data_dependent(error):
        return f"{type(error).__name__}: {text} (while capturing the training step{where})"
    return (
        f"memfit could not capture the training step{where}: {type(error).__name__}: "
        f"{text.splitlines()[0].rstrip('.')}. memfit traces loss_fn(model, *inputs) once with fake tensors, "
        "which have shapes but no values: code that reads tensor values into Python "
        "(if x.sum() > 0, .item(), .tolist(), .numpy()) or whose shapes depend on them "
        "(x[x > 0], nonzero) cannot be captured; make that code independent of tensor values."
    )
