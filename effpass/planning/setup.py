"""The set-up :func:`~effpass.planning.plan_memory` and :func:`~effpass.planning.plan_max_seq` share: the budget
read, the pipeline as given, the options the planner may add, and how a candidate's replay becomes its
per-rank figures (sharding folded)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .candidates import Candidate, check_allow, is_sharding, parameter_floor, pipeline_with, usable_options
from .replay import largest_unit_bytes, replay_device, target_device
from .result import MemoryEstimate, format_bytes, parse_size
from .sharding import fold_sharding

__all__ = ["PlanSetup", "prepare", "ALLOCATORS"]

#: the CUDA caching allocator's modes a plan may be for (the reserved bytes fitted to the budget)
ALLOCATORS = ("default", "expandable")


@dataclass
class PlanSetup:
    """What a plan search starts from (:func:`prepare`)."""

    model: torch.nn.Module
    budget: int                      # bytes (per rank when world_size > 1)
    allow: tuple                     # the lossy techniques allowed
    optimizer: str | None            # the optimizer asked for
    world_size: int
    device: torch.device
    base: list                       # the pipeline as given (the user's passes or the default pipeline)
    groups: dict                     # group -> the declared options the planner may add, in preference order
    notes: list = field(default_factory=list)
    base_sharding: Any = None        # the sharding option of a sharding pass in the pipeline as given
    unit_bytes: int = 0              # parameters of the largest block (FSDP unit), when world_size > 1
    gpu: Any = None                  # CUDA plans: the GPU (effpass.devices) each candidate's step time is estimated on
    compute_dtype: Any = None        # the dtype of the model's largest floating parameter (its matmuls' operands)
    host_budget: int | None = None   # bytes of host memory a plan may hold (None: unbounded)
    allocator: str = "default"       # CUDA plans: the caching allocator's mode the reserved bytes are for

    def step_seconds(self, flops: int) -> float | None:
        """A compute-bound estimate of a step's time on ``gpu``: its FLOPs at the matmul ceiling (bf16/fp16) or
        the fp32 rate; memory traffic and launches are not counted (``effpass cost`` has the full roofline)."""
        if self.gpu is None:
            return None
        low = self.compute_dtype in (torch.bfloat16, torch.float16)
        return flops / (self.gpu.matmul_flops if low else self.gpu.fp32_flops)

    def step_time(self, est: MemoryEstimate) -> tuple[float | None, bool]:
        """(the estimated step time on ``gpu``, transfer-bound): :meth:`step_seconds` with the host link's transfers
        (offloaded activations, optimizer states on the host) overlapped or added
        (:func:`effpass.planning.host_memory.step_time`); (None, False) without a GPU."""
        if self.gpu is None:
            return None, False
        from .host_memory import step_time

        seconds, bound, _ = step_time(est, self.gpu, self.compute_dtype in (torch.bfloat16, torch.float16))
        return seconds, bound

    @property
    def base_names(self) -> set:
        return {p.name for p in self.base}

    def pipeline_of(self, c: Candidate) -> list:
        """The pipeline a candidate's replay runs: the pipeline as given plus its passes, less sharding passes
        (sharding is folded onto the one-rank replay, :meth:`fold`)."""
        model, ws = self.model, self.world_size
        pipeline = pipeline_with([p for p in self.base if not is_sharding(p.name, model, ws)], c)
        return [p for p in pipeline if not is_sharding(p.name, model, ws)]

    def fold(self, c: Candidate, est: MemoryEstimate) -> MemoryEstimate:
        """A one-rank replay's estimate as per-rank figures of ``c`` over ``world_size`` ranks (for the allocator
        mode the plan is for)."""
        if est.allocator != self.allocator:
            est = dataclasses.replace(est, allocator=self.allocator)
        if self.world_size <= 1:
            self.check_host(est)
            return est
        sharding = next((o.sharding for o in c.options if o.sharding), None) or (
            self.base_sharding.sharding if self.base_sharding else None)
        if sharding:
            est = fold_sharding(est, self.world_size, self.unit_bytes, sharding)
        else:
            est = dataclasses.replace(est, world_size=self.world_size)
        self.check_host(est)
        return est

    def check_host(self, est: MemoryEstimate) -> None:
        """Raise :class:`~effpass.planning.host_memory.HostBudgetError` when ``est`` holds more host memory than
        ``host_budget`` (such a plan is not a candidate)."""
        if self.host_budget is not None and est.host_bytes > self.host_budget:
            from .host_memory import HostBudgetError

            raise HostBudgetError(f"over the host budget: holds {format_bytes(est.host_bytes)} of host memory "
                                  f"({est.host_bytes} bytes) > host_budget {format_bytes(self.host_budget)} "
                                  f"(device peak {format_bytes(est.device_peak_bytes)})")


def prepare(model, memory_budget, allow, passes, optimizer, world_size: int, *, device=None,
            graph_only: bool = False, rows: int | None = None, answer: str = "plan",
            gpu_name: str | None = None, host_budget=None, allocator: str = "default") -> PlanSetup:
    """The set-up of a plan search; raises ``ValueError`` for an unreadable budget, an ``allow`` entry that
    names no technique, or a budget below the parameters' own bytes (no ``answer`` can fit it). ``rows``:
    tokens in the step's batch (options meant for other batch sizes are left out); ``graph_only``: only
    options that act on graphs (planning on the first call, after the optimizer exists); ``host_budget``: host
    memory a plan may hold (``"512GiB"``, bytes; None: unbounded); ``allocator``: ``"default"`` or ``"expandable"``
    (CUDA plans: the reserved bytes of the caching allocator with ``expandable_segments:True``)."""
    from effpass.config import _build_passes, default_pipeline
    from effpass.memory_options import declared_memory_options

    budget = parse_size(memory_budget, "memory_budget")
    allow_t = check_allow(allow, world_size)
    dev = target_device(model, device)
    base = _build_passes(passes) if passes is not None else default_pipeline(dev)
    base_names = {p.name for p in base}
    notes: list[str] = []
    rdev = replay_device(dev)
    hb = parse_size(host_budget, "host_budget") if host_budget is not None else None
    if allocator not in ALLOCATORS:
        raise ValueError(f"effpass: allocator {allocator!r} is not valid; choose one of {list(ALLOCATORS)}")
    if allocator != "default" and dev.type != "cuda":
        raise ValueError(f"effpass: allocator {allocator!r} is a CUDA caching-allocator mode; the plan is for "
                         f"device {dev.type!r} (use device='cuda', or allocator='default')")
    if allocator == "expandable":
        notes.append("allocator: expandable segments (each pool's live bytes in 2 MiB pages, "
                     "effpass.planning.cuda_allocator): train with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    if rdev != dev:
        # a CUDA target replayed on CPU fake tensors: offload_activations runs as torch's synchronous rewrite and
        # its copies are counted as CUDA holds them (planning/host_memory.py)
        notes.append(f"predicted for {dev.type} on {rdev.type} fake tensors (no {dev.type} here): CUDA's caching "
                     f"allocator is modelled; offloaded activations are replayed as torch's synchronous rewrite "
                     f"and their copies counted as pinned host memory (effpass.planning.host_memory)")
    groups = usable_options(model, base_names, allow_t, optimizer, world_size, notes, graph_only=graph_only,
                            device=dev, rows=rows)
    from .host_memory import is_host_option

    if dev.type == "cuda" and any(is_host_option(o) for g in groups.values() for o in g):
        notes.append(f"host memory: {'bounded by host_budget ' + format_bytes(hb) if hb is not None else 'unbounded'}"
                     f" (plans that offload activations or optimizer states hold host memory"
                     + ("; --host-budget bounds it" if hb is None else "; a plan over it is not a candidate")
                     + ")")
    p_bytes, floor = parameter_floor(model, groups, world_size)
    if budget < floor:
        raise ValueError(f"memory_budget {memory_budget!r} ({format_bytes(budget)}) is below the parameters' own "
                         f"bytes ({format_bytes(p_bytes)}"
                         + (f" / {world_size} ranks" if world_size > 1 else "")
                         + (", quantized as allowed" if floor < p_bytes / max(world_size, 1) else "")
                         + f"); no {answer} can fit it")
    # a sharding pass the user put in the pipeline is folded on every candidate
    base_sharding = next((o for o in declared_memory_options(model, world_size=world_size)
                          if o.sharding and o.pass_name in base_names), None) if world_size > 1 else None
    gpu = None
    floats = [p for p in model.parameters() if p.is_floating_point()]
    compute_dtype = max(floats, key=lambda p: p.numel()).dtype if floats else torch.float32
    if dev.type == "cuda":
        from effpass.devices import get_device

        gpu = get_device(gpu_name or "h100")
        notes.append(f"est. step: each plan's FLOPs at the {gpu.name}'s "
                     + (f"bf16 matmul ceiling ({gpu.matmul_flops / 1e12:.0f} TFLOP/s)"
                        if compute_dtype in (torch.bfloat16, torch.float16)
                        else f"fp32 rate ({gpu.fp32_flops / 1e12:.0f} TFLOP/s; {compute_dtype} parameters)")
                     + ": a compute-bound estimate (memory traffic, launches and communication not counted; "
                       "`effpass cost` gives the roofline of one step); plans that use host memory add their "
                       f"transfers at {gpu.host_bytes_per_s / 1e9:.0f} GB/s per direction ({gpu.host_link}), "
                       "overlapped with the compute of their phase or added to it; 'transfer-bound' when a "
                       "phase's transfers outlast its compute")
    return PlanSetup(model=model, budget=budget, allow=allow_t, optimizer=optimizer, world_size=world_size,
                     device=dev, base=base, groups=groups, notes=notes, base_sharding=base_sharding,
                     unit_bytes=largest_unit_bytes(model) if world_size > 1 else 0, gpu=gpu,
                     compute_dtype=compute_dtype, host_budget=hb, allocator=allocator)
