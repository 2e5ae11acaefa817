"""Extrapolation over depth: identical blocks make every byte count affine in the number of blocks, so a
model of many identical blocks is replayed at its first 2, 3 and 4 blocks (:func:`first_blocks`) and the
counts extrapolated to its depth (:func:`combine_depths`, checked affine at three depths; screened from two)."""
from __future__ import annotations

import contextlib
import dataclasses
import re

import torch

from .result import MemoryEstimate

__all__ = ["DEPTHS", "AUTO_MIN_BLOCKS", "AFFINE", "block_list", "first_blocks", "combine_depths", "Unconfirmed"]


#: block counts replayed for an extrapolation (three, so that affinity is checked, not assumed)
DEPTHS = (2, 3, 4)


#: with extrapolate=None (auto), models with at least this many identical blocks are extrapolated
AUTO_MIN_BLOCKS = 12


#: MemoryEstimate fields that are byte or FLOP counts (extrapolated, and checked to be affine)
AFFINE = ("peak_bytes", "start_bytes", "step_peak_bytes", "parameters", "trainable_parameters", "buffers",
           "inputs", "gradients", "optimizer_states", "activations", "largest_transient", "gradients_at_peak",
           "non_gradient_peak", "gradients_at_non_gradient_peak",
           "flops", "largest_unit_bytes",
           # host memory (planning/host_memory.py): each block adds its offloaded checkpoints
           "host_bytes", "offload_d2h_bytes", "offload_h2d_bytes", "prefetch_window", "forward_flops",
           # an optimizer on the host that the replay runs (effpass.HostOffloadAdamW): each block's gradients out
           "optimizer_d2h_bytes", "optimizer_h2d_bytes")


def block_list(model: torch.nn.Module):
    """The one ``ModuleList`` of identical blocks (same classes, parameter and buffer names, shapes, dtypes
    and requires_grad in every entry), or None."""
    lists = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 and len({type(m) for m in mod}) == 1:
            if not any(name.startswith(n + ".") for n in lists):
                lists[name] = mod
    if len(lists) != 1:
        return None
    (blocks,) = lists.values()

    def sig(m):
        return (tuple((n, type(x)) for n, x in m.named_modules()),
                tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters()),
                tuple((n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()))

    first = sig(blocks[0])
    return blocks if all(sig(b) == first for b in blocks) else None


@contextlib.contextmanager
def first_blocks(blocks: torch.nn.ModuleList, k: int):
    """``blocks`` holds only its first ``k`` entries while active (the replay deep-copies the model)."""
    saved = blocks._modules
    blocks._modules = type(saved)(list(saved.items())[:k])
    try:
        yield
    finally:
        blocks._modules = saved


def combine_depths(ests, L: int) -> MemoryEstimate | None:
    """The estimate of ``L`` identical blocks from the replays of the first 2, 3 and 4 (``DEPTHS``), or None
    when they are not affine in depth.

    Every byte count of a stack of identical blocks is affine in the number of blocks (each block adds
    its parameters, gradients, states and saved activations; the peak stays at the same place, e.g. the
    loss's backward or the first block's recompute). The three replays check it: when a count's second
    difference is not zero (the peak moves with depth), or another phase's peak extrapolates above the step's
    (the peak would move there beyond the replayed depths), this returns None and the full model is replayed.
    Cost: 9 blocks replayed instead of all (Llama-3-8B: 32).

    Given the first two replays only (a screen, :func:`estimate_many`), the estimate is the affine prediction
    through them, marked ``provisional`` (with the two replays, for :func:`confirm_many`), if the peak is at
    the same place in both; else None.
    """
    b, c = ests[-2], ests[-1]
    depths = DEPTHS[:len(ests)]
    # the same place in each: phase, graph and node (FX numbers repeated nodes: _softmax_backward_data_3)
    where = {(e.peak_phase, e.peak_graph, re.sub(r"_\d+$", "", e.peak_node.split(" ")[0]),
              e.peak_node.partition(" ")[2]) for e in ests}
    if len(where) != 1:
        return None
    if len(ests) == 3 and any(getattr(b, f) - getattr(ests[0], f) != getattr(c, f) - getattr(b, f) for f in AFFINE):
        return None
    n = L - depths[-1]
    step = lambda f: getattr(c, f) + n * (getattr(c, f) - getattr(b, f))  # noqa: E731
    phase_peaks = {p: c.phase_peaks[p] + n * (c.phase_peaks[p] - b.phase_peaks.get(p, 0)) for p in c.phase_peaks}
    if phase_peaks and max(phase_peaks.values()) > step("step_peak_bytes"):
        # NOTE(crossing): the peak is at the same place at the replayed depths, but another phase's peak grows faster
        # with depth and overtakes it before the full depth (offload's stream variant keeps one checkpoint per block
        # on the device until the forward ends: Llama-3.1-8B QLoRA at 344,064 tokens extrapolated a backward peak of
        # 37.2 GiB above the start where its forward's reached 100.1 GiB). Where, and at which node, is not known
        # from these depths: the whole model is replayed
        return None
    # each op's local peak extrapolated as the phases' are (read by planning/tiles.py; not a reason to replay here)
    op_peaks = {k: c.op_peaks[k] + n * (c.op_peaks[k] - b.op_peaks.get(k, 0)) for k in c.op_peaks}
    from collections import Counter

    per_block = Counter(c.trainable_numels) - Counter(b.trainable_numels)
    numels = list(c.trainable_numels) + [x for x, m in per_block.items() for _ in range(m * n)]
    per_block_s = Counter(map(tuple, c.trainable_shapes)) - Counter(map(tuple, b.trainable_shapes))
    shapes = [tuple(x) for x in c.trainable_shapes] + [x for x, m in per_block_s.items() for _ in range(m * n)]
    stats = {}
    for name, st in c.pass_stats.items():
        stats[name] = {k: (v + n * (v - b.pass_stats.get(name, {}).get(k, v))
                           if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in st.items()}
    if len(ests) == 3:
        note = (f"extrapolated from replays of the first {', '.join(map(str, depths))} of {L} identical blocks "
                f"(every count affine in depth, checked); the peak node is named in the {depths[-1]}-block replay")
    else:
        note = (f"provisional: predicted from replays of the first {depths[0]} and {depths[1]} of {L} identical "
                f"blocks (the peak at the same node in both); affinity in depth not yet checked at {DEPTHS[2]} "
                f"blocks")
    # CUDA's reserved bytes (allocator segments) step with depth but not exactly affinely (segment granularity):
    # extrapolated through the last two depths, never a reason to replay the full model
    reserved = (step("reserved_peak_bytes") if all(e.reserved_peak_bytes is not None for e in (b, c)) else None)
    expandable = (step("reserved_expandable_bytes") if all(e.reserved_expandable_bytes is not None for e in (b, c))
                  else None)
    out = dataclasses.replace(c, **{f: step(f) for f in AFFINE}, reserved_peak_bytes=reserved,
                              reserved_expandable_bytes=expandable,
                              phase_peaks=phase_peaks, op_peaks=op_peaks, trainable_numels=numels,
                              trainable_shapes=shapes, pass_stats=stats, depths=list(depths),
                              provisional=len(ests) < 3, notes=list(c.notes) + [note])
    if out.provisional:
        out.depth_replays = list(ests)
    if all(getattr(e, "places", None) is not None for e in ests):  # planning/places.py: each depth's places
        out.depth_places, out.depth_target = [e.places for e in ests], L
    return out


class Unconfirmed:
    """The replays at the first two depths of a pipeline whose peak moved between them (no prediction)."""

    def __init__(self, replays):
        self.depth_replays = replays
