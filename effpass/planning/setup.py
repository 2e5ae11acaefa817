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

__all__ = ["PlanSetup", "prepare"]


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

    def step_seconds(self, flops: int) -> float | None:
        """A compute-bound estimate of a step's time on ``gpu``: its FLOPs at the matmul ceiling (bf16/fp16) or
        the fp32 rate; memory traffic and launches are not counted (``effpass cost`` has the full roofline)."""
        if self.gpu is None:
            return None
        low = self.compute_dtype in (torch.bfloat16, torch.float16)
        return flops / (self.gpu.matmul_flops if low else self.gpu.fp32_flops)

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
        """A one-rank replay's estimate as per-rank figures of ``c`` over ``world_size`` ranks."""
        if self.world_size <= 1:
            return est
        sharding = next((o.sharding for o in c.options if o.sharding), None) or (
            self.base_sharding.sharding if self.base_sharding else None)
        if sharding:
            return fold_sharding(est, self.world_size, self.unit_bytes, sharding)
        return dataclasses.replace(est, world_size=self.world_size)


def prepare(model, memory_budget, allow, passes, optimizer, world_size: int, *, device=None,
            graph_only: bool = False, rows: int | None = None, answer: str = "plan",
            gpu_name: str | None = None) -> PlanSetup:
    """The set-up of a plan search; raises ``ValueError`` for an unreadable budget, an ``allow`` entry that
    names no technique, or a budget below the parameters' own bytes (no ``answer`` can fit it). ``rows``:
    tokens in the step's batch (options meant for other batch sizes are left out); ``graph_only``: only
    options that act on graphs (planning on the first call, after the optimizer exists)."""
    from effpass.config import _build_passes, default_pipeline
    from effpass.memory_options import declared_memory_options

    budget = parse_size(memory_budget, "memory_budget")
    allow_t = check_allow(allow, world_size)
    dev = target_device(model, device)
    base = _build_passes(passes) if passes is not None else default_pipeline(dev)
    base_names = {p.name for p in base}
    notes: list[str] = []
    rdev = replay_device(dev)
    if rdev != dev:
        # a CUDA target replayed on CPU fake tensors: host memory is the replay's own device there, so options
        # that trade device memory for host memory (offload_activations) cannot be predicted: left out, said
        notes.append(f"predicted for {dev.type} on {rdev.type} fake tensors (no {dev.type} here): CUDA's caching "
                     f"allocator is modelled; options that move tensors to host memory (offload_activations) "
                     f"need a {dev.type} replay and are not considered")
    groups = usable_options(model, base_names, allow_t, optimizer, world_size, notes, graph_only=graph_only,
                            device=rdev if rdev != dev else dev, rows=rows)
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
                       "`effpass cost` gives the roofline of one step)")
    return PlanSetup(model=model, budget=budget, allow=allow_t, optimizer=optimizer, world_size=world_size,
                     device=dev, base=base, groups=groups, notes=notes, base_sharding=base_sharding,
                     unit_bytes=largest_unit_bytes(model) if world_size > 1 else 0, gpu=gpu,
                     compute_dtype=compute_dtype)
