"""Hardware: the numbers the cost model needs, as plain data, with built-in profiles.

``measure_hardware()`` (in ``memfit.runtime.probe``) fills one in on the machine at hand; the
profiles below let a CPU laptop plan for a GPU it does not have. ``Hardware.save`` and
``Hardware.load`` keep one as JSON.

An op's time is a roofline with efficiencies: the slower of its FLOPs at its class's sustained
rate and its bytes at the sustained memory bandwidth, plus a fixed launch overhead::

    compute_s = flops / (peak[dtype] * efficiency[class]) + compute_ramp_s   (compute classes)
    memory_s  = bytes_accessed / (memory_bytes_per_s * memory_efficiency)
    time_s    = max(compute_s, memory_s) + op_overhead_s

On a CPU a matmul that adds a bias (``addmm``) writes the bias into its output first: its
``compute_s`` adds a pass over the output at the memory bandwidth.

``class`` is the op's class (``memfit.data.op_classes``: matmul, batched matmul, convolution,
attention, rnn,
else memory). A memory-bound op of an element family (transcendental, random, batch_norm,
layer_norm, softmax, ...) also takes at least ``elements / element_rates[family]``: on a CPU core a ``tanh``,
a dropout mask or a batch norm's per-channel statistics compute longer than they move their
bytes. An op that allocates nothing (a view) costs ``view_overhead_s``, its dispatcher call.
In a step an eager op (a kernel or a view) right after one that streamed its bytes through the
cache also pays ``overhead_after_s``: its dispatch runs from memory, not from the cache.
This prices each op as eager runs it; inductor's fused kernels
are priced from these op by op (``memfit.model.kernels``), each paying ``kernel_overhead_s``
instead of ``op_overhead_s``. ``compute_ramp_s`` makes small kernels reach a lower fraction of the peak: an op
of ``x`` FLOPs runs at ``efficiency * x / (x + x_half)`` of the peak, with
``x_half = peak * efficiency * compute_ramp_s``, a saturating curve in the op's size. The
peaks are dense (no sparsity) tensor-core rates per dtype; a float32 matmul runs at the
``"tfloat32"`` rate when ``tf32_matmuls`` (PyTorch's ``torch.backends.cuda.matmul.allow_tf32``,
off by default), a float32 convolution or RNN when ``tf32_cudnn`` (``torch.backends.cudnn
.allow_tf32``, on by default), else at the ``"float32"`` rate, without tensor cores.

The built-in profiles' figures and their sources (datasheets, published measurements, and
which figures are estimates): ``docs/planning-ahead.md``, "The built-in profiles and their
sources".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from memfit.data.files import write_text
from memfit.data.hardware_json import FORMAT, FORMAT_VERSION, hardware_fields
from memfit.data.op_classes import (
    BIAS_FIRST,
    COMPUTE_CLASSES,
    DTYPE_BYTES,
    EAGER_FAMILIES,
    ELEMENT_FAMILIES,
    FALLBACK_CLASS,
    FALLBACK_FAMILY,
    MEMORY,
    TRANSCENDENTALS_PER_ELEMENT,
    element_family,
    op_class,
)

GB = 10**9
GIB = 2**30
TFLOPS = 10**12
TENSOR_FLOAT32 = "tfloat32"  # the flops_per_s key of float32 math on tensor cores
_CUDNN_CLASSES = ("convolution", "rnn")  # the classes torch.backends.cudnn.allow_tf32 covers


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its link to host memory.

    Args:
        name: profile name, e.g. ``"h100-pcie"``.
        flops_per_s: dense peak FLOP/s by dtype name (``"bfloat16"``, ``"float32"``,
            ``"tfloat32"``, ...).
        memory_bytes_per_s: device memory bandwidth (peak), for memory-bound ops.
        d2h_bytes_per_s: device-to-host copy bandwidth into pinned memory.
        h2d_bytes_per_s: host-to-device copy bandwidth from pinned memory.
        duplex: whether both copy directions run at full speed at the same time.
        async_copies: whether copies run on their own engines beside compute; ``False`` on a CPU,
            where a "copy" is a memcpy on the compute thread.
        device_bytes: usable device memory.
        op_overhead_s: fixed time per op as eager runs it (dispatcher, kernel launch): what
            ``aot_eager`` pays for every aten op of the step.
        kernel_overhead_s: fixed time per kernel a compiler generates (``inductor``'s fused
            kernels, a launch without the dispatcher; ``memfit.model.kernels``).
        view_overhead_s: fixed time of an eager op that allocates nothing (a view, ``t``,
            ``expand``, ``detach``): the dispatcher's call that makes the alias, which
            ``aot_eager`` pays for each such op and inductor's generated code does not. 0 on
            the GPU profiles, whose host dispatches ahead of the device.
        cold_overhead_s: the fixed time an eager op (a kernel or a view) takes beyond
            ``op_overhead_s`` or ``view_overhead_s`` right after an op that moved
            ``cache_bytes`` or more: the interpreter's and the dispatcher's code and data are
            fetched from memory again; after a smaller op, the fraction of the cache it moved
            (``overhead_after_s``). 0 on the GPU profiles.
        cache_bytes: a core's cache that an op's bytes stream through (its L2 on a CPU).
        copy_latency_s: fixed time per copy.
        compute_efficiency: the fraction of the peak a large op of each compute class
            sustains (``"matmul"``, ``"batched_matmul"``, ``"convolution"``, ``"attention"``,
            ``"rnn"``); a class not given runs at its ``FALLBACK_CLASS``'s fraction, else at
            1.0, the peak.
        memory_efficiency: the fraction of ``memory_bytes_per_s`` memory-bound ops sustain.
        element_rates: elements per second a memory-bound op of each element family
            (``memfit.data.op_classes.ELEMENT_FAMILIES``: ``"transcendental"``, ``"random"``,
            ``"batch_norm"``, ``"layer_norm"``, and eager kernels' ``"softmax"``,
            ``"safe_softmax"``, ``"dropout"`` and ``"dropout_backward"``, and the kernel inductor
            generates for a softmax, ``"compiled_softmax"``) computes, where that takes longer
            than its bytes (a CPU core); a family not given is priced by its bytes alone, as
            every op on a GPU profile.
        compute_ramp_s: time a compute op takes beyond its FLOPs at the sustained rate; 0 runs
            every size at the class's fraction (see the module docstring for the curve).
        tf32_matmuls: float32 matmuls and attention run on tensor cores at the ``"tfloat32"``
            rate (``torch.backends.cuda.matmul.allow_tf32``; PyTorch's default is off).
        tf32_cudnn: float32 convolutions and RNNs run at the ``"tfloat32"`` rate
            (``torch.backends.cudnn.allow_tf32``; PyTorch's default is on).
        d2h_pageable_bytes_per_s: device-to-host bandwidth into pageable memory; ``None``
            takes the pinned rate.
        h2d_pageable_bytes_per_s: host-to-device bandwidth from pageable memory; ``None``
            takes the pinned rate.
        collective_bytes_per_s: the bus bandwidth of a ring collective between the GPUs of one
            node (NVLink), as nccl-tests reports ``busbw``: an all-gather or reduce-scatter of
            ``N`` bytes over ``W`` ranks takes ``(W-1)/W * N / collective_bytes_per_s``
            (``collective_time_s``). ``None``: the device has no peer link (plans with
            ``world_size`` 1 only).
        network_bytes_per_s: the same between nodes, per GPU (InfiniBand); a collective over more
            than ``gpus_per_node`` ranks runs at this rate (its slowest link). ``None``: one node.
        gpus_per_node: GPUs that share the fast link (an HGX board: 8).
        collective_latency_s: fixed time per collective (NCCL launch and ring set-up).
        host_bytes: host memory that swapped tensors may take at once (what is swapped out and
            not yet freed, ``memfit.model.host_memory``): no plan swaps more. ``None`` (default
            of a hand-built profile): no limit. The built-in GPU profiles state a figure for a
            typical host of their class (see the module docstring), ``measure_hardware()``
            the machine's available RAM.
        device_type: the torch device type that runs the step (``"cuda"``, ``"cpu"``): a step
            captured on another device type is captured as this one runs it
            (``memfit.tracing.target``), e.g. CUDA's attention kernels and autocast policy for a
            GPU profile planned on a CPU.
        notes: where the numbers come from.
    """

    name: str
    flops_per_s: Mapping[str, float]
    memory_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    duplex: bool = True
    async_copies: bool = True
    device_bytes: int = 80 * GIB
    op_overhead_s: float = 5e-6
    kernel_overhead_s: float = 5e-6
    view_overhead_s: float = 0.0
    cold_overhead_s: float = 0.0
    cache_bytes: int = 2 * 2**20
    copy_latency_s: float = 10e-6
    compute_efficiency: Mapping[str, float] = field(default_factory=dict)
    memory_efficiency: float = 1.0
    element_rates: Mapping[str, float] = field(default_factory=dict)
    compute_ramp_s: float = 0.0
    tf32_matmuls: bool = False
    tf32_cudnn: bool = True
    d2h_pageable_bytes_per_s: float | None = None
    h2d_pageable_bytes_per_s: float | None = None
    host_bytes: int | None = None
    device_type: str = "cuda"
    collective_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None
    gpus_per_node: int = 8
    collective_latency_s: float = 20e-6
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for key in ("flops_per_s", "compute_efficiency", "element_rates"):
            object.__setattr__(self, key, MappingProxyType(dict(getattr(self, key))))
        positive = ["memory_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s", "cache_bytes"]
        positive += [key for key in ("d2h_pageable_bytes_per_s", "h2d_pageable_bytes_per_s",
                                     "collective_bytes_per_s", "network_bytes_per_s",
                                     "gpus_per_node")
                     if getattr(self, key) is not None]
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"Hardware.{key} must be positive, got {getattr(self, key)}")
        unknown = sorted(set(self.element_rates) - set(ELEMENT_FAMILIES))
        if unknown or any(rate <= 0 for rate in self.element_rates.values()):
            raise ValueError(f"Hardware.element_rates must map families of "
                             f"{sorted(ELEMENT_FAMILIES)} to positive rates, got "
                             f"{dict(self.element_rates)}")
        if not self.flops_per_s or min(self.flops_per_s.values()) <= 0:
            raise ValueError("Hardware.flops_per_s needs a positive rate for at least one dtype")
        self._check_efficiencies()
        if self.host_bytes is not None and self.host_bytes < 0:
            raise ValueError(f"Hardware.host_bytes must be 0 or more (None: no limit), got "
                             f"{self.host_bytes}")
        for key in ("op_overhead_s", "kernel_overhead_s", "view_overhead_s", "cold_overhead_s",
                    "copy_latency_s", "compute_ramp_s", "collective_latency_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"Hardware.{key} must be 0 or more, got {getattr(self, key)}")

    def _check_efficiencies(self) -> None:
        unknown = sorted(set(self.compute_efficiency) - set(COMPUTE_CLASSES))
        if unknown:
            raise ValueError(f"Hardware.compute_efficiency has unknown op classes {unknown}: "
                             f"use {sorted(COMPUTE_CLASSES)}")
        efficiencies = {f"compute_efficiency[{name!r}]": value
                        for name, value in self.compute_efficiency.items()}
        efficiencies["memory_efficiency"] = self.memory_efficiency
        for key, value in efficiencies.items():
            if not 0 < value <= 1:
                raise ValueError(f"Hardware.{key} must be a fraction in (0, 1], got {value}")

    def class_efficiency(self, kind_class: str) -> float:
        """The fraction of the peak ops of ``kind_class`` sustain: the profile's figure, else
        its ``FALLBACK_CLASS``'s, else 1.0."""
        while kind_class not in self.compute_efficiency and kind_class in FALLBACK_CLASS:
            kind_class = FALLBACK_CLASS[kind_class]
        return self.compute_efficiency.get(kind_class, 1.0)

    def flops_rate(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``, falling back to the float32 rate, then to the slowest known."""
        if dtype in self.flops_per_s:
            return self.flops_per_s[dtype]
        return self.flops_per_s.get("float32", min(self.flops_per_s.values()))

    def compute_dtype(self, dtype: str, kind_class: str) -> str:
        """The rate an op of ``kind_class`` in ``dtype`` runs at: float32 on tensor cores
        (``"tfloat32"``) where the profile has that rate and the TF32 switch for it is on."""
        if dtype != "float32" or TENSOR_FLOAT32 not in self.flops_per_s:
            return dtype
        tf32 = self.tf32_cudnn if kind_class in _CUDNN_CLASSES else self.tf32_matmuls
        return TENSOR_FLOAT32 if tf32 and kind_class != MEMORY else dtype

    def op_time_s(self, flops: float, bytes_accessed: float, dtype: str = "float32",
                  kind: str = "", elements: int = 0) -> float:
        """Roofline estimate with efficiencies (see the module docstring), plus the overhead.

        Args:
            kind: the op kind (``"aten.mm"``), which picks its class; ``""`` is memory-bound.
            elements: the op's output elements: a memory-bound op of an element family takes
                at least ``elements_time_s``.
        """
        kind_class = op_class(kind)
        memory_s = bytes_accessed / (self.memory_bytes_per_s * self.memory_efficiency)
        compute_s = self.elements_time_s(kind, elements) if kind_class == MEMORY else 0.0
        if flops > 0:
            rate = self.flops_rate(self.compute_dtype(dtype, kind_class))
            efficiency = self.class_efficiency(kind_class)
            ramp_s = self.compute_ramp_s if kind_class != MEMORY else 0.0
            compute_s = flops / (rate * efficiency) + ramp_s
        if kind in BIAS_FIRST and self.device_type == "cpu":
            compute_s += elements * DTYPE_BYTES.get(dtype, 4) / (
                self.memory_bytes_per_s * self.memory_efficiency)
        return max(compute_s, memory_s) + self.op_overhead_s

    def overhead_after_s(self, bytes_before: int) -> float:
        """The fixed time an eager op takes beyond its own overhead right after an op that moved
        ``bytes_before``: ``cold_overhead_s`` times the fraction of ``cache_bytes`` that op
        streamed through the cache, at most all of it."""
        return self.cold_overhead_s * min(1.0, bytes_before / self.cache_bytes)

    def view_time_s(self, kind: str) -> float:
        """The time of an eager op of ``kind`` that allocates nothing: ``view_overhead_s``, the
        dispatcher's call that makes an alias; Python's tuple indexing (``"getitem"``) calls no
        op and costs nothing."""
        return 0.0 if kind == "getitem" else self.view_overhead_s

    def elements_time_s(self, kind: str, elements: int, fused: bool = False) -> float:
        """The time a memory-bound op of ``kind`` computes ``elements`` elements, at its
        element family's rate (``element_rates``). An eager kernel's own family
        (``EAGER_FAMILIES``) inside a fused kernel, or one the profile has no rate for, is
        priced as its ``FALLBACK_FAMILY``; 0 where the chain ends without a rate. A
        transcendental op that evaluates several functions per element
        (``TRANSCENDENTALS_PER_ELEMENT``: GELU's backward) takes that many."""
        family = element_family(kind)
        while family in EAGER_FAMILIES and (fused or family not in self.element_rates):
            family = FALLBACK_FAMILY[family]
        rate = self.element_rates.get(family)
        if family == "transcendental":
            elements *= TRANSCENDENTALS_PER_ELEMENT.get(kind, 1)
        return elements / rate if rate else 0.0

    def d2h_time_s(self, size_bytes: int, pinned: bool = True) -> float:
        """Time to copy ``size_bytes`` to the host, into pinned (default) or pageable memory."""
        rate = self.d2h_bytes_per_s if pinned else self.d2h_pageable_bytes_per_s
        return self.copy_latency_s + size_bytes / (rate or self.d2h_bytes_per_s)

    def h2d_time_s(self, size_bytes: int, pinned: bool = True) -> float:
        """Time to copy ``size_bytes`` from the host, from pinned (default) or pageable memory."""
        rate = self.h2d_bytes_per_s if pinned else self.h2d_pageable_bytes_per_s
        return self.copy_latency_s + size_bytes / (rate or self.h2d_bytes_per_s)

    def collective_time_s(self, kind: str, size_bytes: int, world_size: int) -> float:
        """Time of one ring collective of ``size_bytes`` (the whole, unsharded tensor) over
        ``world_size`` ranks: ``"all_gather"`` and ``"reduce_scatter"`` move ``(W-1)/W * N``
        bytes per rank, ``"all_reduce"`` twice that (a reduce-scatter then an all-gather), at
        the bus bandwidth (nccl-tests' ``busbw`` is defined so that this holds, NVIDIA/nccl-tests
        doc/PERFORMANCE.md), plus ``collective_latency_s``. One rank moves nothing: 0.

        Raises:
            ValueError: for an unknown kind, or for ``world_size`` > 1 on a profile without
                ``collective_bytes_per_s`` (or past one node without ``network_bytes_per_s``).
        """
        if kind not in COLLECTIVE_PASSES:
            raise ValueError(f"unknown collective {kind!r}: use one of {sorted(COLLECTIVE_PASSES)}")
        if world_size <= 1:
            return 0.0
        rate = self.collective_bytes_per_s
        if world_size > self.gpus_per_node:
            rate = self.network_bytes_per_s
        if rate is None:
            raise ValueError(
                f"hardware profile {self.name!r} states no bandwidth between {world_size} ranks: "
                "set it with hardware.with_(collective_bytes_per_s=..., network_bytes_per_s=...) "
                "or plan for h100-sxm")
        moved = COLLECTIVE_PASSES[kind] * (world_size - 1) / world_size * size_bytes
        return self.collective_latency_s + moved / rate

    def with_(self, **changes) -> Hardware:
        """A copy with some fields changed, e.g. ``hardware.with_(device_bytes=16 * GIB)``."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Every field, as JSON types, under a ``format`` and ``version`` header."""
        data: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION}
        for item in fields(self):
            value = getattr(self, item.name)
            data[item.name] = dict(value) if isinstance(value, Mapping) else value
        return data

    @staticmethod
    def from_json(data: object, source: str = "the hardware profile") -> Hardware:
        """A ``Hardware`` from ``to_json``'s form (a hand-written one needs only the fields
        without defaults).

        Raises:
            ValueError: naming the field that is missing, unknown or of the wrong type, or for
                a file of another format; and every check ``Hardware`` makes of its numbers.
        """
        return Hardware(**hardware_fields(data, source, fields(Hardware)))

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, atomically (``memfit.data.files``)."""
        write_text(path, json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path: str | Path) -> Hardware:
        """Read a profile ``save`` wrote, e.g. one ``measure_hardware()`` made on the target.

        Raises:
            ValueError: as ``from_json``; OSError if the file cannot be read.
        """
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error}): save a profile with "
                             "hardware.save(path)") from None
        return Hardware.from_json(data, source=str(path))


def _gpu(name: str, peaks_tflops: Mapping[str, float], memory_gb_s: float, link_gb_s: float,
         device_gib: int, efficiency: Mapping[str, float], host_bytes: int,
         notes: str, peers_gb_s: tuple[float | None, float | None] = (None, None)) -> Hardware:
    """A GPU profile: dense peaks in TFLOPS, memory and (pinned) link rates in GB/s, the host
    memory swaps may take in bytes, and the collective bus bandwidth in GB/s inside a node and
    between nodes (``None``: no such link)."""
    inside_gb_s, between_gb_s = peers_gb_s
    return Hardware(
        collective_bytes_per_s=None if inside_gb_s is None else inside_gb_s * GB,
        network_bytes_per_s=None if between_gb_s is None else between_gb_s * GB,
        name=name,
        flops_per_s={dtype: tflops * TFLOPS for dtype, tflops in peaks_tflops.items()},
        memory_bytes_per_s=memory_gb_s * GB,
        d2h_bytes_per_s=link_gb_s * GB,
        h2d_bytes_per_s=link_gb_s * GB,
        d2h_pageable_bytes_per_s=link_gb_s * GB * PAGEABLE_FRACTION,
        h2d_pageable_bytes_per_s=link_gb_s * GB * PAGEABLE_FRACTION,
        device_bytes=device_gib * GIB,
        compute_efficiency=efficiency,
        memory_efficiency=MEMORY_EFFICIENCY,
        compute_ramp_s=COMPUTE_RAMP_S,
        host_bytes=host_bytes,
        notes=notes,
    )


PAGEABLE_FRACTION = 0.25  # of the pinned rate (DeepSpeed PR #5301: pinned was 4-6x faster)
MEMORY_EFFICIENCY = 0.8  # estimate: a large copy reaches ~0.9 of HBM peak, PyTorch's kernels less
COMPUTE_RAMP_S = 4e-6  # estimate: wave fill and drain of a small kernel
HOPPER = {"float64": 67, "float32": 67, "tfloat32": 494.7, "bfloat16": 989.4, "float16": 989.4,
          "float8_e4m3fn": 1979, "float8_e5m2": 1979}
HOPPER_PCIE = {"float64": 51, "float32": 51, "tfloat32": 378, "bfloat16": 756, "float16": 756,
               "float8_e4m3fn": 1513, "float8_e5m2": 1513}
AMPERE = {"float64": 19.5, "float32": 19.5, "tfloat32": 156, "bfloat16": 312, "float16": 312}
HOPPER_EFFICIENCY = {"matmul": 0.80, "attention": 0.35, "convolution": 0.5, "rnn": 0.3}
DGX_HOST_BYTES = 256 * GIB  # stated: a DGX's 2 TB of system memory shared by its 8 GPUs
PCIE_HOST_BYTES = 128 * GIB  # stated: a PCIe server's 1 TB shared by 8 GPUs
GRACE_HOST_BYTES = 480 * GB  # GH200: the Grace CPU's LPDDR5X beside one GPU
COLLECTIVE_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # ring passes of N
# Collective bus bandwidth (GB/s, nccl-tests busbw) inside an 8-GPU node and between nodes.
# NVLink 4 (H100/H200 SXM, NVSwitch): 900 GB/s total, 450 each way; an nccl-tests sweep on
# 8xH100 SXM5 reads 460-480 GB/s all_reduce busbw at large sizes (NVLink SHARP helps
# all-reduce; Alaya NeW, "NCCL-tests in practice", docs.alayanew.com, 2026-05-06); ring
# all-gather / reduce-scatter, which FSDP runs, take a stated 360 (0.8 of one direction). The
# same page reads 230-250 on 8xA100 SXM4 (NVLink 3) and 35-45 on 8xH100 PCIe without NVSwitch.
# Between nodes: InfiniBand NDR, 400 Gb/s (50 GB/s) per GPU on H100/H200 systems, HDR 200 Gb/s
# (25 GB/s) on DGX A100; taken at 0.9 of the line rate (an estimate).
NVLINK4_PEERS = (360.0, 45.0)
NVLINK3_PEERS = (230.0, 22.5)
PCIE_PEERS = (40.0, 45.0)

PROFILES: Mapping[str, Hardware] = MappingProxyType(
    {
        "h100-pcie": _gpu("h100-pcie", HOPPER_PCIE, 2000, 52, 80, HOPPER_EFFICIENCY,
                          PCIE_HOST_BYTES, "H100 PCIe 80GB, PCIe Gen5 host, 128 GiB host share",
                          PCIE_PEERS),
        "h100-sxm": _gpu("h100-sxm", HOPPER, 3350, 52, 80, HOPPER_EFFICIENCY, DGX_HOST_BYTES,
                         "H100 SXM5 80GB, PCIe Gen5 host, 256 GiB host share, NVLink 4, IB NDR",
                         NVLINK4_PEERS),
        "h200": _gpu("h200", HOPPER, 4800, 52, 141, HOPPER_EFFICIENCY, DGX_HOST_BYTES,
                     "H200 141GB, PCIe Gen5 host, 256 GiB host share, NVLink 4, IB NDR",
                     NVLINK4_PEERS),
        "a100": _gpu("a100", AMPERE, 2039, 25, 80,
                     {"matmul": 0.86, "attention": 0.6, "convolution": 0.6, "rnn": 0.3},
                     DGX_HOST_BYTES, "A100 SXM 80GB, PCIe Gen4 host, 256 GiB host share, NVLink 3",
                     NVLINK3_PEERS),
        "gh200": _gpu("gh200", HOPPER, 4000, 300, 96, {**HOPPER_EFFICIENCY, "matmul": 0.83},
                      GRACE_HOST_BYTES, "GH200 96GB, NVLink-C2C to 480 GB of Grace host memory"),
        "cpu": Hardware(
            name="cpu",
            flops_per_s={"float32": 50e9, "bfloat16": 20e9, "float16": 10e9},
            memory_bytes_per_s=10 * GB,
            d2h_bytes_per_s=5 * GB,
            h2d_bytes_per_s=5 * GB,
            duplex=False,
            async_copies=False,
            device_bytes=16 * GIB,
            op_overhead_s=20e-6,
            copy_latency_s=2e-6,
            device_type="cpu",
            notes="a 2-core CPU, its rates already sustained ones (efficiency 1): copies are "
                  "memcpys on the compute thread; no host_bytes limit (host and device are one "
                  "memory, which device_bytes already bounds)",
        ),
    }
)


def available_host_bytes() -> int | None:
    """The RAM this machine has available now: the default ``host_bytes`` of a profile measured
    here. Linux's ``SC_AVPHYS_PAGES`` pages (free, not counting reclaimable caches: a lower
    bound); ``None`` where the system does not say (no limit)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def get_hardware(hardware: str | Hardware) -> Hardware:
    """Resolve a profile name (or pass a ``Hardware`` through).

    Raises:
        ValueError: for an unknown name, listing the built-in profiles.
    """
    if isinstance(hardware, Hardware):
        return hardware
    try:
        return PROFILES[hardware]
    except KeyError:
        raise ValueError(
            f"unknown hardware profile {hardware!r}: use one of {sorted(PROFILES)}, "
            "a memfit.Hardware(...) you build, Hardware.load(path), or "
            "memfit.measure_hardware()"
        ) from None
