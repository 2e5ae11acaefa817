"""LoRA adapter modules and the helpers around them: inject, save/load in PEFT's format, merge/unmerge.

Used by the ``inject_lora`` pass (``passes/inject_lora/__init__.py``) and usable on its own::

    from effpass.passes import lora
    lora.save(model, "adapter/")            # adapter_config.json + adapter_model.safetensors (PEFT's format)
    lora.load(model, "adapter/")            # injects adapters described by the config and loads the weights
    lora.merge(model); lora.unmerge(model)  # fold adapters into the base weights for inference, and back

A :class:`LoRALinear` keeps the wrapped module as its child ``base_layer`` (as PEFT does) and adds two
``nn.Linear`` children ``lora_A`` (in -> r) and ``lora_B`` (r -> out), so parameter names map onto PEFT's:
``model.layers.0.self_attn.q_proj.lora_A.weight`` is PEFT's
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` in a saved adapter.

The modules behind it, one responsibility each: :mod:`._lora_linear` (the linear adapter, injection,
freezing, merging), :mod:`._lora_experts` (adapters on MoE expert parameters) with its grouped matmul
:mod:`._expert_mm` (custom ops), :mod:`._lora_peft` (PEFT's adapter format).
"""
from __future__ import annotations

from .expert_mm import expert_mm, expert_mm_grad_w  # noqa: F401
from .experts import (EXPERT_LAYOUTS, ExpertLoRA, expert_layout, expert_lora_modules,  # noqa: F401
                            expert_parameters, inject_experts)
from .linear import (AdapterLinear, LoRALinear, freeze_base, inject, is_linear_like, linear_shape,  # noqa: F401
                           lora_modules, merge, overrides_linear_forward, parameter_stats, unmerge)
from .peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, _peft_expert_keys, adapter_config, load, save  # noqa: F401

__all__ = ["LoRALinear", "ExpertLoRA", "is_linear_like", "overrides_linear_forward", "linear_shape", "lora_modules", "expert_lora_modules",
           "inject", "inject_experts", "expert_parameters", "expert_layout", "freeze_base",
           "parameter_stats", "save", "load", "merge", "unmerge", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]


def _register_namespace() -> None:
    """``effpass.lora`` is this module (save, load, merge, unmerge)."""
    import sys

    import effpass

    effpass.register_extension("lora", sys.modules[__name__])


_register_namespace()
