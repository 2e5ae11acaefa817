"""effpass's built-in passes (installed as ``effpass.passes``).

Each module registers one pass with ``@effpass.register_pass``. A module that fails to import (a missing
optional dependency) is skipped with a warning, so the other passes stay usable.
"""
from __future__ import annotations

import importlib
import warnings

_BUILTINS = {
    "apply_autocast": ("ApplyAutocast",),
    "scale_loss": ("ScaleLoss",),
    "checkpoint_activations": ("CheckpointActivations",),
    "inject_lora": ("InjectLoRA",),
    "quantize_linear": ("QuantizeLinear",),
    "fuse_attention": ("FuseAttention",),
    "wrap_fsdp": ("WrapFSDP",),
}

__all__ = []
for _mod, _names in _BUILTINS.items():
    try:
        _m = importlib.import_module(f"{__name__}.{_mod}")
    except Exception as _e:  # noqa: BLE001 - one broken pass must not take the others down
        if isinstance(_e, ModuleNotFoundError) and _e.name == f"{__name__}.{_mod}":
            continue  # not installed in this build
        warnings.warn(f"effpass: built-in pass module {_mod!r} could not be imported: {_e}", RuntimeWarning)
        continue
    for _n in _names:
        if hasattr(_m, _n):
            globals()[_n] = getattr(_m, _n)
            __all__.append(_n)
