"""memfit.runtime.resident under FSDP2 (one rank, gloo): while a block runs, what stays resident
is each parameter's shard, whatever the module has registered, and the all-gathered parameters
beside a region are the unsharded ones alive plus the block FSDP2 prefetches in backward
(tests/test_distributed.py runs two ranks)."""

from __future__ import annotations

import pytest
import torch

distributed = pytest.importorskip("torch.distributed")
if not distributed.is_available() or not distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_blocks() -> torch.nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_block_in_flight_counts_its_shards_and_the_gathered_bytes_beside_it(one_rank):
    from torch.distributed.tensor import DTensor

    from memfit.runtime.resident import fsdp_in_flight_bytes, resident_tensors

    model = _sharded_blocks()
    cpu = torch.device("cpu")
    first, second = _parameter_bytes(model[0]), _parameter_bytes(model[1])
    seen: dict = {}

    def inside_second(module, args):
        seen["registered"] = [type(p) for p in module.parameters()]
        seen["resident"] = [type(t) for t in resident_tensors(model, []) if t.dim()]
        seen["gathered"] = fsdp_in_flight_bytes(model, cpu)

    model[1].register_forward_pre_hook(inside_second)  # after FSDP2's own: block 1 unsharded
    model(torch.randn(4, 16)).sum().backward()
    assert DTensor not in seen["registered"]  # the module holds the unsharded parameters
    assert set(seen["resident"]) == {DTensor}  # memfit counts the shards
    assert seen["gathered"] == second + first  # block 1 unsharded, block 0 prefetched later
    assert fsdp_in_flight_bytes(model, cpu) == max(first, second)  # between steps: none alive
