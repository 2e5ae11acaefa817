"""effpass's built-in passes (installed as ``effpass.passes``).

Each module registers one pass with ``@effpass.register_pass``; optional dependencies (triton, flash-attn)
are imported where they are used, never at module import.
"""
from __future__ import annotations

import importlib

_BUILTINS = {
    "apply_autocast": ("ApplyAutocast",),
    "scale_loss": ("ScaleLoss",),
    "checkpoint_activations": ("CheckpointActivations",),
    "inject_lora": ("InjectLoRA",),
    "quantize_linear": ("QuantizeLinear",),
    "fuse_attention": ("FuseAttention",),
    "pack_sequences": ("PackSequences",),
    "wrap_fsdp": ("WrapFSDP",),
    "fuse_cross_entropy": ("FuseCrossEntropy",),
    "shard_sequence": ("ShardSequence",),
    "tile_sequence": ("TileSequence",),
    "step_in_backward": ("StepInBackward",),
    "compress_activations": ("CompressActivations",),
    "offload_activations": ("OffloadActivations",),
}

__all__ = []
for _mod, _names in _BUILTINS.items():
    # NOTE(failures): imported plainly: a built-in pass that cannot be imported is a bug, and the error
    # must reach the user (and fail the test suite) instead of a warning and skipped tests.
    _m = importlib.import_module(f"{__name__}.{_mod}")
    for _n in _names:
        globals()[_n] = getattr(_m, _n)
        __all__.append(_n)
importlib.import_module(f"{__name__}._optimizers")  # optimizers the memory planner may choose
