"""PEFT interop for effpass's LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's
format (:func:`save`), and loading such an adapter into a model (:func:`load`)."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from .experts import ExpertLoRA, expert_lora_modules, expert_parameters, inject_experts
from .linear import freeze_base, inject, is_linear_like, lora_modules

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_config", "save", "load"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def _peft_expert_keys(model: nn.Module) -> dict[str, tuple[str, ExpertLoRA]]:
    """PEFT key stem (``<module>.base_layer....``) -> (full parameter name, adapter).

    PEFT nests one ``ParamWrapper`` per targeted parameter of a module, in the module's parameter order:
    the first is innermost, so it gets one ``base_layer.`` per wrapper outside it."""
    out = {}
    for mn, m in model.named_modules():
        if not getattr(type(m), "__effpass_lora_experts__", None):
            continue
        order = [pn for pn, _ in m.named_parameters(recurse=False) if pn in m.lora_experts]
        for i, pn in enumerate(order):
            stem = (f"{mn}." if mn else "") + "base_layer." * (len(order) - 1 - i)
            out[stem.rstrip(".")] = (f"{mn}.{pn}" if mn else pn, m.lora_experts[pn])
    return out


def _most_common(values: list) -> Any:
    return Counter(values).most_common(1)[0][0]


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The ``adapter_config.json`` contents (PEFT's ``LoraConfig``) describing ``model``'s adapters.

    Expert adapters go to ``target_parameters`` (full parameter names), as PEFT's ``ParamWrapper``."""
    mods = lora_modules(model)
    experts = expert_lora_modules(model)
    if not mods and not experts:
        raise ValueError("the model has no LoRA adapters (apply the inject_lora pass or lora.load first)")
    every = {**mods, **experts}
    r = _most_common([m.rank for m in every.values()])
    alpha = _most_common([m.alpha for m in every.values()])
    dropouts = {m.dropout_p for m in mods.values()} | ({0.0} if not mods else set())
    rslora = {m.use_rslora for m in every.values()}
    fifo = {m.fan_in_fan_out for m in mods.values()} | ({False} if not mods else set())
    if len(dropouts) > 1 or len(rslora) > 1 or len(fifo) > 1:
        raise ValueError(f"PEFT's format needs one dropout / use_rslora / fan_in_fan_out for all adapters; "
                         f"this model has dropout {sorted(dropouts)}, use_rslora {sorted(rslora)}, "
                         f"fan_in_fan_out {sorted(fifo)}")
    if experts and (dropouts != {0.0} or fifo != {False}):
        raise ValueError("PEFT's target_parameters LoRA takes no lora_dropout and no fan_in_fan_out; this model "
                         f"has expert adapters with dropout {sorted(dropouts)} / fan_in_fan_out {sorted(fifo)}")
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    cfg = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_name, "inference_mode": True,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropouts.pop(), "use_rslora": rslora.pop(),
        "fan_in_fan_out": fifo.pop(), "bias": "none", "init_lora_weights": True,
        "target_modules": sorted(mods) if mods else None,
        "rank_pattern": {n: m.rank for n, m in every.items() if m.rank != r},
        "alpha_pattern": {n: m.alpha for n, m in every.items() if m.alpha != alpha},
        "modules_to_save": None,
    }
    if experts:
        cfg["target_parameters"] = sorted(experts)
    return cfg


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
    loads into the same base model. Only the adapters are written; expert adapters in PEFT's
    ``ParamWrapper`` layout (``<experts>[.base_layer].lora_A.weight`` (E*r, in), ``lora_B.weight`` (out, r*E))."""
    from safetensors.torch import save_file

    model = getattr(model, "_orig_mod", model)
    config = adapter_config(model)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, m in lora_modules(model).items():
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous().cpu()
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().contiguous().cpu()
    for stem, (_, ad) in _peft_expert_keys(model).items():
        a, b = ad.peft_tensors()
        tensors[f"{_PEFT_PREFIX}{stem}.lora_A.weight"] = a.cpu()
        tensors[f"{_PEFT_PREFIX}{stem}.lora_B.weight"] = b.cpu()
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _target_matcher(target_modules) -> Any:
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return lambda name: rx.fullmatch(name) is not None
    targets = list(target_modules or [])
    return lambda name: any(name == t or name.endswith("." + t) for t in targets)


def _pattern_lookup(patterns: dict, default):
    def lookup(name: str):
        for pat, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({pat})$", name):
                return value
        return default
    return lookup


def load(model: nn.Module, path: str | os.PathLike, *, trainable: bool = False) -> list[str]:
    """Load a PEFT LoRA adapter (or one :func:`save` wrote) into ``model`` in place.

    Adapters are injected where the config's ``target_modules`` point (unless already there), the weights
    are copied in, and base weights are frozen. ``trainable`` makes the adapters trainable (PEFT's
    ``is_trainable``). Returns the names of the adapted modules.
    """
    from safetensors.torch import load_file

    model = getattr(model, "_orig_mod", model)
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported; only 'LORA' is")
    for key, ok in (("bias", ("none", None)), ("modules_to_save", (None, [])), ("use_dora", (False, None))):
        if cfg.get(key) not in ok:
            raise ValueError(f"{path}: {key}={cfg.get(key)!r} is not supported by effpass's LoRA; supported: {list(ok)}")
    weights_file = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.exists(weights_file):
        state = load_file(weights_file)
    else:
        state = torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu", weights_only=True)
    match = _target_matcher(cfg.get("target_modules"))
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    existing = lora_modules(model)
    names = [n for n, m in model.named_modules()
             if n and is_linear_like(m) and match(n) and ".lora_" not in n and not n.endswith(".base_layer")]
    if not names and not any(match(n) for n in existing) and not cfg.get("target_parameters"):
        linear = [n for n, m in model.named_modules() if n and is_linear_like(m) and ".lora_" not in n]
        raise ValueError(f"{path}: the adapter's target_modules {cfg.get('target_modules')!r} match no linear "
                         f"module of this {type(model).__name__}; its linear modules include "
                         f"{linear[:8]}{' ...' if len(linear) > 8 else ''}")
    inject(model, names, rank=r, alpha=alpha, dropout=float(cfg.get("lora_dropout", 0.0)),
           use_rslora=bool(cfg.get("use_rslora", False)),
           rank_of=_pattern_lookup(cfg.get("rank_pattern"), r), alpha_of=_pattern_lookup(cfg.get("alpha_pattern"), alpha))
    targets_p = list(cfg.get("target_parameters") or [])
    if targets_p:
        params = expert_parameters(model)
        have = expert_lora_modules(model)
        wanted = [n for n in params if n not in have and any(n == t or n.endswith("." + t) for t in targets_p)]
        if not wanted and not have:
            raise ValueError(f"{path}: the adapter's target_parameters {targets_p!r} match no expert parameter of "
                             f"this {type(model).__name__}; expert parameters: {sorted(params)[:8]}")
        inject_experts(model, wanted, rank=r, alpha=alpha, use_rslora=bool(cfg.get("use_rslora", False)),
                       rank_of=_pattern_lookup(cfg.get("rank_pattern"), r),
                       alpha_of=_pattern_lookup(cfg.get("alpha_pattern"), alpha))
    expert_stems = _peft_expert_keys(model)
    expert_parts: dict[str, dict[str, torch.Tensor]] = {}
    mods = lora_modules(model)
    loaded = set()
    for key, value in state.items():
        k = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        m = re.fullmatch(r"(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", k)
        if m is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} in the adapter (only lora_A/lora_B weights are supported)")
        name, which = m.group(1), m.group(2)
        if name in expert_stems and name not in mods:
            expert_parts.setdefault(name, {})[which] = value
            continue
        if name not in mods:
            raise ValueError(f"{path}: adapter tensor {key!r} names module {name!r}, which has no LoRA adapter "
                             f"in this model; adapted modules: {sorted(mods)[:8]}")
        param = getattr(mods[name], which).weight
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"{path}: {key!r} has shape {tuple(value.shape)}, the model's adapter expects "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        loaded.add((name, which))
    for stem, (full, ad) in expert_stems.items():
        part = expert_parts.get(stem, {})
        if set(part) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: no weights for the expert adapter of {full!r} (PEFT key "
                             f"{_PEFT_PREFIX}{stem}.lora_A/lora_B.weight)")
        a, b = part["lora_A"], part["lora_B"]
        want_a, want_b = ad.peft_tensors()
        if a.shape != want_a.shape or b.shape != want_b.shape:
            raise ValueError(f"{path}: expert adapter of {full!r} has shapes {tuple(a.shape)}, {tuple(b.shape)}; the "
                             f"model expects {tuple(want_a.shape)}, {tuple(want_b.shape)}")
        ad.load_peft_tensors(a, b)
    missing = [n for n in mods if n not in existing and not {(n, "lora_A"), (n, "lora_B")} <= loaded]
    if missing:
        raise ValueError(f"{path}: no weights for the adapters of {missing[:8]}")
    freeze_base(model, trainable_adapters=trainable)
    return sorted(mods) + sorted(v[0] for v in expert_stems.values())
