"""Hardware: the numbers the cost model needs, as plain data, with built-in profiles.

``measure_hardware()`` (in ``memfit.runtime.probe``) fills one in on the machine at hand; the
profiles below let a CPU laptop plan for a GPU it does not have.

Note:
    The host-link numbers are what pinned ``copy_(non_blocking=True)`` achieves, not the PCIe
    spec: about 52 GB/s each way on an H100 PCIe Gen5 host (the issue's figure), about 25 GB/s on
    Gen4 (A100), and a few hundred GB/s over NVLink-C2C (GH200). The FLOP rates are dense
    tensor-core peaks per dtype; float32 matmuls use TF32 tensor cores, as PyTorch does with
    ``torch.backends.cuda.matmul.allow_tf32`` (off by default, so plan conservatively with the
    ``"float32"`` entry, the non-tensor-core rate, unless told otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

GB = 10**9
GIB = 2**30
TFLOPS = 10**12


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its link to host memory.

    Args:
        name: profile name, e.g. ``"h100-pcie"``.
        flops_per_s: peak FLOP/s by dtype name (``"bfloat16"``, ``"float32"``, ...).
        memory_bytes_per_s: device memory bandwidth, for memory-bound ops.
        d2h_bytes_per_s: device-to-host copy bandwidth (pinned).
        h2d_bytes_per_s: host-to-device copy bandwidth (pinned).
        duplex: whether both copy directions run at full speed at the same time.
        async_copies: whether copies run on their own engines beside compute; ``False`` on a CPU,
            where a "copy" is a memcpy on the compute thread.
        device_bytes: usable device memory.
        op_overhead_s: fixed time per op (kernel launch, dispatcher).
        copy_latency_s: fixed time per copy.
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
    copy_latency_s: float = 10e-6
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops_per_s", MappingProxyType(dict(self.flops_per_s)))
        for key in ("memory_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"Hardware.{key} must be positive, got {getattr(self, key)}")
        if not self.flops_per_s or min(self.flops_per_s.values()) <= 0:
            raise ValueError("Hardware.flops_per_s needs a positive rate for at least one dtype")

    def flops_rate(self, dtype: str) -> float:
        """FLOP/s for ``dtype``, falling back to the float32 rate, then to the slowest known."""
        if dtype in self.flops_per_s:
            return self.flops_per_s[dtype]
        return self.flops_per_s.get("float32", min(self.flops_per_s.values()))

    def op_time_s(self, flops: float, bytes_accessed: float, dtype: str = "float32") -> float:
        """Roofline estimate: the slower of compute and memory traffic, plus the fixed overhead."""
        compute_s = flops / self.flops_rate(dtype)
        memory_s = bytes_accessed / self.memory_bytes_per_s
        return max(compute_s, memory_s) + self.op_overhead_s

    def d2h_time_s(self, size_bytes: int) -> float:
        return self.copy_latency_s + size_bytes / self.d2h_bytes_per_s

    def h2d_time_s(self, size_bytes: int) -> float:
        return self.copy_latency_s + size_bytes / self.h2d_bytes_per_s

    def with_(self, **changes) -> Hardware:
        """A copy with some fields changed, e.g. ``hardware.with_(device_bytes=16 * GIB)``."""
        return replace(self, **changes)


def _gpu(name: str, bf16_tflops: float, fp32_tflops: float, memory_gb_s: float, link_gb_s: float,
         device_gib: int, notes: str) -> Hardware:
    return Hardware(
        name=name,
        flops_per_s={
            "bfloat16": bf16_tflops * TFLOPS,
            "float16": bf16_tflops * TFLOPS,
            "float32": fp32_tflops * TFLOPS,
        },
        memory_bytes_per_s=memory_gb_s * GB,
        d2h_bytes_per_s=link_gb_s * GB,
        h2d_bytes_per_s=link_gb_s * GB,
        device_bytes=device_gib * GIB,
        notes=notes,
    )


PROFILES: Mapping[str, Hardware] = MappingProxyType(
    {
        "h100-pcie": _gpu("h100-pcie", 756, 51, 2000, 52, 80, "H100 PCIe 80GB, PCIe Gen5 host"),
        "h100-sxm": _gpu("h100-sxm", 989, 67, 3350, 52, 80, "H100 SXM5 80GB, PCIe Gen5 host"),
        "h200": _gpu("h200", 989, 67, 4800, 52, 141, "H200 141GB, PCIe Gen5 host"),
        "a100": _gpu("a100", 312, 19.5, 2039, 25, 80, "A100 SXM 80GB, PCIe Gen4 host"),
        "gh200": _gpu("gh200", 989, 67, 4000, 300, 96, "GH200, NVLink-C2C to Grace memory"),
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
            notes="a 2-core CPU: copies are memcpys on the compute thread",
        ),
    }
)


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
            "a memfit.Hardware(...) you build, or memfit.measure_hardware()"
        ) from None
