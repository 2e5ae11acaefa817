"""effpass's built-in passes (installed as ``effpass.passes``).

One package per pass: ``passes/<name>/`` is the pass registered as ``<name>`` (docs page
``docs/passes/<name>.md``, tests ``tests/passes/<name>/``). Its ``__init__.py`` holds the pass class and its
public names; the package's other modules are private to it. Packages never import each other: what two passes
share is a contract in the core (``tests/core/test_architecture.py``). Optional dependencies (triton, flash-attn) are
imported where they are used, never at package import.
"""
from __future__ import annotations

import importlib
import sys

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

# Import paths users already have, kept: ``effpass.passes.lora`` (LoRA's save/load/merge helpers) and
# ``effpass.passes.fsdp_estimate`` (the FSDP memory table) now live inside their passes' packages.
_ALIASES = {"lora": "inject_lora.lora", "fsdp_estimate": "wrap_fsdp.sizing"}
for _alias, _target in _ALIASES.items():
    globals()[_alias] = sys.modules[f"{__name__}.{_alias}"] = importlib.import_module(f"{__name__}.{_target}")
importlib.import_module("effpass.planning.optimizers")  # optimizers the memory planner may choose
