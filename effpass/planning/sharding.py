"""The sharded-state (ZeRO / FSDP2) arithmetic, once: per-rank model states under each sharding mode, and
its fold onto a one-rank replay (``estimate_memory(world_size=N)``, the planner's sharding options).
``passes/fsdp_estimate.py`` (``effpass estimate``, the paper estimate) uses the same function.

=========  ===========================================  ===============================================
mode       per-rank model states                        what runs it
=========  ===========================================  ===============================================
none       P + G + O                                    plain data parallel (DDP), or one process
zero1      P + G + O/N                                  optimizer state sharded
zero2      P + (G + O)/N                                FSDP2 ``reshard_after_forward=False``
zero3      (P + G + O)/N + 2 gathered units             FSDP2 (reshard after forward); one unit
                                                        computing, the next prefetched
hsdp       (P + G + O)/S + 2 gathered units             S = N / R ranks per shard group
=========  ===========================================  ===============================================

Why not torch's ``FSDPMemTracker`` on a fake process group: it tracks a real FSDP2 module's step under
``FakeTensorMode`` and a ``FakeStore`` process group, which needs ``fully_shard`` applied to the (fake) model
and a distributed world initialised in the planner's process; the planner replays one rank's compiled step
and folds the sharding arithmetic onto its terms instead (the terms FSDP2 shards are exactly P, G, O).
"""
from __future__ import annotations

import dataclasses
import math

__all__ = ["MODES", "shard_model_states", "fold_sharding"]

MODES = ("none", "zero1", "zero2", "zero3", "hsdp")


def shard_model_states(params: int, grads: int, optimizer: int, world_size: int, mode: str = "zero3",
                       unit_bytes: int = 0, replicate: int = 1) -> dict[str, int]:
    """Bytes per rank ``{"params", "grads", "optimizer", "gathered"}`` of model states ``params``, ``grads``
    and ``optimizer`` (bytes on one rank) sharded by ``mode`` over ``world_size`` ranks (``replicate``
    groups for ``hsdp``); ``gathered``: the two all-gathered units (``unit_bytes`` each) of zero3/hsdp."""
    if mode not in MODES:
        raise ValueError(f"unknown sharding mode {mode!r}; choose from {list(MODES)}")
    N = world_size
    S = N // replicate if mode == "hsdp" else N
    shard = lambda b, n: math.ceil(b / n)  # noqa: E731
    if mode == "none":
        return dict(params=params, grads=grads, optimizer=optimizer, gathered=0)
    if mode == "zero1":
        return dict(params=params, grads=grads, optimizer=shard(optimizer, N), gathered=0)
    if mode == "zero2":
        return dict(params=params, grads=shard(grads, N), optimizer=shard(optimizer, N), gathered=0)
    return dict(params=shard(params, S), grads=shard(grads, S), optimizer=shard(optimizer, S),
                gathered=2 * unit_bytes if S > 1 else 0)


def fold_sharding(est, world_size: int, unit_bytes: int, mode: str = "zero3"):
    """Per-rank figures of a one-rank replay ``est`` (a ``MemoryEstimate``) under ``mode`` sharding.

    zero3 (FSDP2, ``wrap_fsdp``): parameters, optimizer states and gradients are sharded ``world_size``
    ways (FSDP2 keeps the sharded parameter in its own dtype); each rank holds two gathered units (the one
    computing and the one prefetched) and, in backward, one unit's unsharded gradients before the
    reduce-scatter. Activations do not shrink (each rank runs its own micro-batch).
    """
    if mode != "zero3":
        raise ValueError(f"fold_sharding: mode {mode!r} is not folded onto replays (only 'zero3', what "
                         f"wrap_fsdp runs)")
    N = world_size
    s = shard_model_states(est.parameters, est.gradients_at_peak, est.optimizer_states, N, mode, unit_bytes)
    g_peak = est.gradients_at_peak
    during = (est.step_peak_bytes - g_peak + s["grads"] + s["gathered"]
              + (unit_bytes if est.peak_phase != "forward" else 0))
    model_states = est.parameters + est.optimizer_states
    start = est.start_bytes - model_states + s["params"] + s["optimizer"]
    whole = shard_model_states(est.trainable_parameters, est.gradients, 0, N, mode)
    return dataclasses.replace(
        est, world_size=N, sharding=mode, start_bytes=start, step_peak_bytes=during, peak_bytes=start + during,
        parameters=s["params"], trainable_parameters=whole["params"], optimizer_states=s["optimizer"],
        gradients=whole["grads"], gradients_at_peak=s["grads"], notes=list(est.notes) + [
            f"FSDP over {N} ranks: model states sharded, + 2 gathered units ({unit_bytes * 2} bytes) and one "
            f"unit's unsharded gradients in backward (ZeRO-3 accounting on the replayed terms, not replayed)"])
