"""Kernel temporaries measured: each op run once, alone, on real tensors, in a child process.

Where no exact rule for a kernel's scratch is known (``temporaries.py`` says which), its bytes are
measured on the installed kernels instead of guessed: oneDNN's 3D and transposed convolutions
pick among implementations (jit, gemm with per-thread im2col buffers and per-thread weight-gradient
copies, ...) by shape, ISA and thread count, so a formula fitted to a few shapes would hold for
those shapes only. A probe runs the op at the node's exact shapes, strides and dtype, with this
process's thread count and oneDNN / determinism flags, under the profiler's CPU-allocator events,
and reports the bytes the allocator held at its high-water mark beyond the op's outputs (the
larger of two runs, so a first call's one-off buffers are not missed either).

Why a child process: the probes allocate nothing in the process being planned (planning happens
inside a step whose peak is measured), and the profiler cannot be started inside a step that is
already being profiled. Results are cached per signature (op, argument shapes and values, thread
count, flags), in the process and on disk per machine (``_MachineCache``: the CPU, torch's build),
so each distinct op is measured once per machine; one child measures all the new signatures of a
graph.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

_TIMEOUT_S = 600  # one child measures a whole graph's new signatures; large 3D convolutions are slow
_MEASURED_BYTES: dict[str, int] = {}  # signature -> bytes beyond the outputs


class _Unsupported(Exception):
    """An argument the probe cannot rebuild as a real value (a symbolic size, an object)."""


def _encode(argument: object) -> object:
    """A JSON form of one argument: a tensor's layout, or the value itself."""
    if isinstance(argument, fx.Node):
        return _encode(argument.meta.get("val"))
    if isinstance(argument, torch.Tensor):
        sizes = (*argument.shape, *argument.stride(), argument.storage_offset())
        if not all(type(size) is int for size in sizes):
            raise _Unsupported("symbolic sizes")
        return {"tensor": [list(argument.shape), list(argument.stride()),
                           argument.storage_offset(), str(argument.dtype).removeprefix("torch.")]}
    if isinstance(argument, (list, tuple)):
        return [_encode(item) for item in argument]
    if isinstance(argument, dict):
        return {str(key): _encode(item) for key, item in argument.items()}
    if argument is None or type(argument) in (bool, int, float, str):
        return argument
    raise _Unsupported(type(argument).__name__)


def _signature(node: fx.Node, channels_last: bool = False) -> str | None:
    """What the measurement depends on, as one string (``None`` when it cannot be probed).
    ``channels_last``: the node's dense 4-D tensor arguments (activations, gradients and the
    weight: inductor converts the weight too) are measured in the channels-last layout
    (``memfit.tracing.temporaries``: inductor's) instead of their fake values'. A convolution
    backward given a contiguous weight beside channels-last activations converts it into
    scratch of its own, which inductor's never does."""
    try:
        arguments = [_encode(argument) for argument in node.args]
        if channels_last:
            arguments = [_channels_last(argument) for argument in arguments]
        request = [str(node.target), arguments, _encode(dict(node.kwargs))]
    except _Unsupported:
        return None
    return json.dumps(request + [_settings()])


def _channels_last(encoded: object) -> object:
    """An encoded dense 4-D tensor with channels-last strides; anything else as it is."""
    if not (isinstance(encoded, dict) and "tensor" in encoded):
        return encoded
    shape, stride, offset, dtype = encoded["tensor"]
    if len(shape) != 4 or offset or not torch._prims_common.is_non_overlapping_and_dense_or_false(
            torch.empty_strided(shape, stride, device="meta")):
        return encoded
    layout = list(torch._prims_common.make_channels_last_strides_for(shape))
    return {"tensor": [shape, layout, 0, dtype]}


def _settings() -> dict:
    """The process-wide switches that choose a kernel's implementation."""
    return {"threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.enabled,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def measured_temporary_bytes(nodes: Iterable[fx.Node], channels_last: Collection[fx.Node] = ()
                             ) -> dict[fx.Node, int]:
    """Each node's kernel bytes beyond its outputs, measured (once per signature) in a child;
    the nodes in ``channels_last`` with their activations in that layout (``_signature``).

    Nodes that cannot be probed (symbolic sizes, arguments that are not tensors or plain values)
    or whose probe failed are left out, with a warning for a failed probe.
    """
    signatures = {node: signature for node in nodes
                  if (signature := _signature(node, node in channels_last)) is not None}
    missing = sorted({s for s in signatures.values() if s not in _MEASURED_BYTES})
    if missing:  # measured by an earlier process on this machine, with this torch
        _MEASURED_BYTES.update(machine_cache.read())
        missing = [s for s in missing if s not in _MEASURED_BYTES]
    if missing and (measured := _run_child(missing)):
        _MEASURED_BYTES.update(zip(missing, measured, strict=True))
        machine_cache.add(dict(zip(missing, measured, strict=True)))
    return {node: _MEASURED_BYTES[s] for node, s in signatures.items() if s in _MEASURED_BYTES}


class _MachineCache:
    """Measurements kept on disk for later processes (``memfit.data.files.cache_dir``), in a
    file per machine: keyed by the CPU's model and flags, torch's version and build (its oneDNN
    included) and this module's code; each entry by its op signature (``_signature``). A file
    that cannot be read, of another format or machine, is ignored (with a warning) and
    written again."""

    FORMAT = "memfit-kernel-cache"
    VERSION = 1

    @staticmethod
    @functools.cache
    def machine() -> dict[str, str]:
        """What a measurement depends on beyond its signature: the CPU, torch's build, this
        module's code."""
        import hashlib
        import platform

        cpu: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "flags"):
                    cpu.setdefault(name.strip(), value.strip())
        return {"cpu": cpu.get("model name") or platform.processor(),
                "cpu_flags": hashlib.sha256(cpu.get("flags", "").encode()).hexdigest()[:16],
                "machine": platform.machine(), "torch": torch.__version__,
                "build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
                "probe": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}

    def path(self) -> Path | None:
        import hashlib

        from memfit.data.files import cache_dir

        folder = cache_dir()
        if folder is None:
            return None
        name = hashlib.sha256(json.dumps(self.machine(), sort_keys=True).encode()).hexdigest()
        return folder / "kernels" / f"{name[:32]}.json"

    def read(self) -> dict[str, int]:
        path = self.path()
        if path is None or not path.exists():
            return {}
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
            if (found.get("format"), found.get("version")) != (self.FORMAT, self.VERSION) or \
                    found.get("machine") != self.machine():
                raise ValueError("of another format or machine")
            measured = found["bytes"]
            if not all(type(size) is int and size >= 0 for size in measured.values()):
                raise ValueError("a measurement is not a byte count")
            return dict(measured)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as why:
            warnings.warn(f"memfit: ignored the kernel measurements cached in {path} "
                          f"({type(why).__name__}: {str(why)[:120]}); they are measured again",
                          stacklevel=4)
            return {}

    def add(self, measured: dict[str, int]) -> None:
        """Write ``measured`` beside what the file holds, atomically."""
        from memfit.data.files import write_text

        path = self.path()
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text(path, json.dumps({"format": self.FORMAT, "version": self.VERSION,
                                         "machine": self.machine(),
                                         "bytes": {**self.read(), **measured}}))


machine_cache = _MachineCache()


def _run_child(signatures: list[str]) -> list[int]:
    """The child's measurements in order, or none (with a warning) when it could not run."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    try:
        finished = subprocess.run(
            [sys.executable, "-m", "memfit.tracing.kernel_probe"], input=json.dumps(signatures),
            capture_output=True, text=True, timeout=_TIMEOUT_S, check=True,
            env=dict(os.environ, PYTHONPATH=path))
        measured = json.loads(finished.stdout.strip().splitlines()[-1])
        if len(measured) != len(signatures):
            raise ValueError(f"{len(measured)} results for {len(signatures)} kernels")
        return measured
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
        detail = getattr(error, "stderr", "") or ""
        warnings.warn(
            f"memfit: measuring {len(signatures)} kernels' scratch buffers in a child process "
            f"failed ({type(error).__name__}: {str(error)[:200]} {detail[-400:]}); their bytes "
            "are estimated instead, so a CPU step may exceed its budget by them. Check that "
            f"`{sys.executable} -m memfit.tracing.kernel_probe` can run here.", stacklevel=3)
        return []


# ---- the child ---------------------------------------------------------------------------------

def real_like(value: object) -> object:
    """A real tensor like (fake) ``value``: same shape, strides, offset and dtype, random floats,
    zeros for integers (indices stay in range); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return _real_tensor([int(size) for size in value.shape], [int(step) for step in value.stride()],
                        int(value.storage_offset()), value.dtype)


def _real_tensor(shape: list[int], stride: list[int], offset: int,
                 dtype: torch.dtype) -> torch.Tensor:
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    flat = torch.empty(offset + extent if all(shape) else 0, dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        flat.normal_()
    elif dtype == torch.bool:
        flat.copy_(torch.rand(flat.shape) > 0.5)
    else:
        flat.zero_()
    return flat.as_strided(shape, stride, offset if all(shape) else 0)


def new_storage_bytes(result: object, inputs: object) -> int:
    """Bytes of the result's storages that are not the inputs' (views and in-place ops own none)."""
    seen = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs)
            if isinstance(t, torch.Tensor)}
    total = 0
    for leaf in tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in seen:
            seen.add(leaf.untyped_storage().data_ptr())
            total += leaf.untyped_storage().nbytes()
    return total


def _decode(encoded: Any) -> Any:
    if isinstance(encoded, dict) and "tensor" in encoded:
        shape, stride, offset, dtype = encoded["tensor"]
        return _real_tensor(shape, stride, offset, getattr(torch, dtype))
    if isinstance(encoded, list):
        return [_decode(item) for item in encoded]
    if isinstance(encoded, dict):
        return {key: _decode(item) for key, item in encoded.items()}
    return encoded


def _resolve(target: str) -> torch._ops.OpOverload:
    """``torch.ops.aten.convolution.default`` from ``"aten.convolution.default"``."""
    namespace, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def measure_one(signature: str) -> int:
    """Run the op of ``signature`` twice and return its most bytes beyond its outputs."""
    from memfit.runtime.measure import allocator_peak_above_start

    target, args, kwargs, settings = json.loads(signature)
    torch.set_num_threads(settings["threads"])
    torch.backends.mkldnn.enabled = settings["mkldnn"]
    torch.use_deterministic_algorithms(settings["deterministic"])
    op, args, kwargs = _resolve(target), list(_decode(args)), dict(_decode(kwargs))
    extra_bytes = 0
    for _ in range(2):
        result, peak_bytes = allocator_peak_above_start(lambda: op(*args, **kwargs))
        extra_bytes = max(extra_bytes, peak_bytes - new_storage_bytes(result, (args, kwargs)))
        del result
    return extra_bytes


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps([measure_one(signature) for signature in json.loads(sys.stdin.read())]))
