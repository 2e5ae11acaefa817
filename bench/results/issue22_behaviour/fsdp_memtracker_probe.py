"""Probe (issue 22.4, helper arch): torch's FSDPMemTracker on a fake process group, per-rank bytes by category of an
FSDP2 (zero3) step on CPU under FakeTensorMode, against effpass.planning.sharding's zero3 arithmetic."""
# Probe: can torch's FSDPMemTracker on a fake process group give the per-rank sharded model states?
import torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.fsdp import fully_shard
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch._subclasses.fake_tensor import FakeTensorMode
N = 4
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (N,))  # outside FakeTensorMode (the mesh reads a real tensor)
with FakeTensorMode():
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024)
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs((x,))
    with tracker:
        for _ in range(2):
            model(x).sum().backward(); optim.step(); optim.zero_grad()
    snap = tracker.get_tracker_snapshot("peak")
dev = next(iter(k for k in snap if k != "Total"))
P = sum(p.numel() * 4 for p in model.parameters())  # DTensor numel: the global (unsharded) size
print("unsharded param bytes", P, "| zero3 per rank: P/N =", P // N, ", Adam O/N =", 2 * P // N, ", one unit =", P // 4)
print({k: v for k, v in snap[dev].items()})
dist.destroy_process_group()
