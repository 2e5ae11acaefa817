"""Memory planning: predict a training step's peak memory (``estimate_memory``) and choose passes that fit
it under a byte budget (``plan_memory``; ``effpass.compile(model, memory_budget=...)``, ``effpass plan``)."""
from __future__ import annotations

from .estimate import MemoryEstimate, estimate_many, estimate_memory, fold_fsdp, format_bytes, parse_size, training_step
from .planner import Candidate, MaxSeqResult, MemoryBudgetError, MemoryPlan, plan_max_seq, plan_memory, techniques
from .sharding import fold_sharding, shard_model_states

__all__ = ["MemoryEstimate", "estimate_many", "estimate_memory", "fold_fsdp", "format_bytes", "parse_size", "training_step",
           "MemoryPlan", "Candidate", "MemoryBudgetError", "plan_memory", "plan_max_seq", "MaxSeqResult", "techniques", "fold_sharding",
           "shard_model_states"]
