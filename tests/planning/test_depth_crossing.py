"""Depth extrapolation when another phase's peak overtakes the step's beyond the replayed depths (issue 39.3).

The offload stream variant keeps one checkpoint per block on the device until the forward ends: the forward's peak
grows by a checkpoint per block while the backward's (one block's recompute) barely does. At 2, 3 and 4 blocks the
backward's is the larger, at 32 the forward's; the extrapolated step peak was the backward's, 63 GiB low for
Llama-3.1-8B QLoRA at 344,064 tokens. Synthetic estimates (no replay), so every byte is known."""
from __future__ import annotations

from effpass.planning import MemoryEstimate
from effpass.planning.depth import combine_depths

GIB = 1 << 30


def _at(k: int, fwd_per_block: int, bwd: int, start: int = 5 * GIB) -> MemoryEstimate:
    """``k`` blocks: forward peak ``k * fwd_per_block`` above the start, backward peak ``bwd + k`` (the step's)."""
    fwd, back = k * fwd_per_block, bwd + k
    step = max(fwd, back)
    return MemoryEstimate(peak_bytes=start + step, start_bytes=start, step_peak_bytes=step, parameters=start,
                          trainable_parameters=0, buffers=0, inputs=0, gradients=0, optimizer_states=0,
                          activations=fwd, largest_transient=0, largest_transient_op="-",
                          peak_phase="backward" if back >= fwd else "forward", peak_graph="backward graph 1",
                          peak_node="sdpa_backward_1", flops=0,
                          phase_peaks={"forward": fwd, "backward": back})


def test_a_phase_overtaking_the_peak_beyond_the_replayed_depths_is_not_extrapolated():
    # 2.7 GiB kept per block; the backward's peak 30 GiB: the larger at 2, 3 and 4 blocks, not at 32
    ests = [_at(k, 27 * GIB // 10, 30 * GIB) for k in (2, 3, 4)]
    assert {e.peak_phase for e in ests} == {"backward"}  # the same place at every replayed depth
    assert combine_depths(ests, 32) is None  # the full model is replayed instead
    assert combine_depths(ests[:2], 32) is None  # nor screened from two depths (the third depth then decides)


def test_without_a_crossing_the_extrapolation_is_exact():
    # 0.5 GiB per block: the backward's peak stays the larger up to 32 blocks
    ests = [_at(k, GIB // 2, 30 * GIB) for k in (2, 3, 4)]
    out = combine_depths(ests, 32)
    assert out is not None and out.peak_phase == "backward" and out.depths == [2, 3, 4]
    assert out.step_peak_bytes == 30 * GIB + 32 and out.peak_bytes == 5 * GIB + 30 * GIB + 32
    assert out.phase_peaks == {"forward": 16 * GIB, "backward": 30 * GIB + 32}
