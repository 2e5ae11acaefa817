"""Memory per rank on paper for data-parallel training with and without sharding (ZeRO / FSDP2).

For a prediction of the whole step from the model's own graphs (activations, transients, where the peak
is), use ``effpass.estimate_memory(model, inputs, world_size=N)``: it replays the step on fake tensors and
applies the same ``zero3`` accounting to the replayed terms (both use ``effpass.planning.sharding``). This
module stays the quick paper estimate for every sharding mode from a module, a preset or a bare count
(``effpass estimate``).

The accounting is the seeds' (ZeRO paper, section 3.1): mixed-precision Adam keeps, per trainable
parameter, a 16-bit parameter (2 bytes), a 16-bit gradient (2) and fp32 optimizer states: master copy,
momentum and variance (4 + 4 + 4 = 12), 16 bytes in all. Frozen parameters (a LoRA base) keep only the
parameter. Full fp32 training keeps 4 + 4 + 8. The sharding modes divide these terms as ZeRO does:

=========  ===========================================  ===============================================
mode       per-rank model states                        what runs it
=========  ===========================================  ===============================================
none       P + G + O                                    plain data parallel (DDP), or one process
zero1      P + G + O/N                                  optimizer state sharded
zero2      P + (G + O)/N                                ``WrapFSDP(reshard_after_forward=False)``: the
                                                        gathered parameters live from forward to backward
zero3      (P + G + O)/N + 2 gathered units             ``WrapFSDP()`` (reshard after forward); one unit
                                                        computing, the next prefetched
hsdp       (P + G + O)/S + 2 gathered units             ``WrapFSDP(replicate=R)``: S = N / R ranks per
                                                        shard group (one node), replicated R times
=========  ===========================================  ===============================================

NOTE: FSDP2 stores the sharded parameter in its original dtype (fp32) and gathers it in ``param_dtype``:
that sharded fp32 parameter *is* the master copy, so its 4 bytes land in "params" where the seeds put
2 in "params" and 4 of the 12 in "optimizer"; the per-rank total is the same.

Activations (per rank, micro-batch ``batch`` per rank) follow Korthikanti et al. 2022: a transformer
layer saves about ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits; fused attention (SDPA/flash) drops the
``5*a*s/h`` score term; per-block checkpointing keeps the block input (``2*s*b*h``) per layer plus one
layer's full set during recomputation. Logits for the loss add ``b*s*V*4`` (fp32). Activations do
not shrink with sharding (each rank runs its own micro-batch).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import torch
import torch.nn as nn

import effpass
from effpass.graph import transformer_blocks
from effpass.planning.sharding import MODES, shard_model_states

__all__ = ["estimate", "estimate_table", "max_model_params", "MODES", "PRESETS", "model_shape"]

_GIB = 1024 ** 3


def model_shape(model: nn.Module) -> dict[str, int]:
    """layers, hidden, heads, vocab and the largest unit's parameter count, read from the module tree
    (and ``model.config`` when it is a Hugging Face model)."""

    cfg = getattr(model, "config", None)

    def pick(*names, default=None):
        for n in names:
            v = getattr(cfg, n, None) if cfg is not None else None
            if isinstance(v, int):
                return v
        return default

    units = transformer_blocks(model)
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    hidden = pick("hidden_size", "n_embd", "dim", default=embeds[0].embedding_dim if embeds else 0)
    vocab = pick("vocab_size", default=max((e.num_embeddings for e in embeds), default=0))
    layers = pick("num_hidden_layers", "n_layer", "n_layers", default=len(units))
    heads = pick("num_attention_heads", "n_head", "n_heads", default=max(1, hidden // 64))
    unit_params = max((sum(p.numel() for p in u.parameters()) for _, u in units), default=0)
    return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "unit_params": unit_params}


#: Llama-3-family shapes (hidden, ffn, layers, heads, kv heads, vocab) usable by name, e.g. ``"llama-8b"``.
PRESETS = {
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-3b": (3072, 8192, 28, 24, 8, 128256),
    "llama-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama-70b": (8192, 28672, 80, 64, 8, 128256),
    "llama-405b": (16384, 53248, 126, 128, 8, 128256),
}


def _preset_counts(name: str) -> tuple[int, dict[str, int]]:
    h, f, L, a, kv, V = PRESETS[name]
    d = h // a
    per_layer = h * (a * d) * 2 + h * (kv * d) * 2 + 3 * h * f + 2 * h
    n = L * per_layer + V * h * (1 if name in ("llama-1b", "llama-3b") else 2) + h
    return n, {"layers": L, "hidden": h, "heads": a, "vocab": V, "unit_params": per_layer}


def _counts(model, params: float | None, trainable_only: bool) -> tuple[int, int, dict[str, int], str]:
    """(all params, trainable params, shape, description) of a module, a preset name or a bare count."""
    if isinstance(model, nn.Module):
        n_all = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
        return n_all, n_train, model_shape(model), type(model).__name__
    if isinstance(model, str):
        key = model.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}; choose one of {sorted(PRESETS)} or pass an nn.Module")
        n, shape = _preset_counts(key)
        return n, n, shape, key
    if model is None and params:
        # NOTE: only a count: take the layer shapes of the Llama preset closest in size for activations.
        name = min(PRESETS, key=lambda k: abs(math.log(_preset_counts(k)[0] / float(params))))
        _, shape = _preset_counts(name)
        scale = float(params) / _preset_counts(name)[0]
        shape = dict(shape, unit_params=int(shape["unit_params"] * scale))
        return int(params), int(params), shape, f"a bare count (activations shaped like {name})"
    raise TypeError(f"estimate needs an nn.Module, a preset name ({sorted(PRESETS)}) or params=<count>, "
                    f"got {type(model).__name__}")


def _activation_bytes(shape: dict[str, int], batch: int, seq: int, act_bytes: int, fused_attention: bool,
                      checkpointing: bool) -> int:
    s, b, h, a, L, V = seq, batch, shape["hidden"], shape["heads"], shape["layers"], shape["vocab"]
    per_layer_16bit = s * b * h * 34 + (0 if fused_attention else 5 * a * s * s * b)
    per_layer = per_layer_16bit * act_bytes // 2
    if checkpointing:
        layers_bytes = L * s * b * h * act_bytes + per_layer
    else:
        layers_bytes = L * per_layer
    return int(layers_bytes + b * s * V * 4)


def estimate(model: nn.Module | str | None = None, batch: int = 1, seq: int = 4096, world_size: int = 8, *,
             params: float | None = None, replicate: int = 1,
             mixed_precision: bool = True, optimizer_states: int = 2, trainable_only: bool = True,
             fused_attention: bool = True, checkpointing: bool = False,
             modes: Sequence[str] = MODES) -> dict[str, dict[str, int]]:
    """Bytes per rank ``{mode: {"params", "grads", "optimizer", "gathered", "activations", "total"}}``.

    ``model``: an ``nn.Module``, a preset name (``"llama-8b"``, see ``PRESETS``) or ``None`` with
    ``params=8e9`` (a bare count; activations then use the closest Llama preset's layer shapes). A module
    may live on the meta device (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
    so a 70B model can be estimated without memory. ``batch`` is the micro-batch per rank.
    ``mixed_precision``: the seeds' 2 + 2 + 12 bytes per trainable parameter (else fp32: 4 + 4 + 4*states).
    ``optimizer_states``: 2 for Adam/AdamW (momentum, variance), 1 for SGD with momentum, 0 for SGD.
    ``trainable_only``: frozen parameters (LoRA base) get no gradient or optimizer state.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"replicate={replicate} must be >= 1 and divide world_size={world_size}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown sharding mode(s) {bad}; choose from {list(MODES)}")
    n_all, n_train, shape, _ = _counts(model, params, trainable_only)
    pb = 2 if mixed_precision else 4
    P = n_all * pb
    G = n_train * pb
    O = n_train * ((4 if mixed_precision else 0) + 4 * optimizer_states)
    A = _activation_bytes(shape, batch, seq, pb, fused_attention, checkpointing)
    gathered = 2 * shape["unit_params"] * pb
    out: dict[str, dict[str, int]] = {}
    for mode in modes:  # the one sharding arithmetic (core), also folded onto replays by the planner
        row = shard_model_states(P, G, O, world_size, mode, gathered // 2, replicate)
        row["activations"] = A
        row["total"] = sum(row.values())
        out[mode] = row
    return out


def estimate_table(model: nn.Module | str | None = None, batch: int = 1, seq: int = 4096, world_size: int = 8, *,
                   params: float | None = None, replicate: int = 1, file=None, **kwargs: Any) -> str:
    """:func:`estimate` as a table in GiB per rank (printed to ``file`` when given, e.g. ``sys.stdout``)
    and returned. Every argument has a default, so ``estimate_table(params=8e9, world_size=64)`` works
    (the ``effpass estimate`` command calls it so). Extra keyword arguments go to :func:`estimate`."""
    est = estimate(model, batch, seq, world_size, params=params, replicate=replicate, **kwargs)
    n_all, n_train, _, what = _counts(model, params, kwargs.get("trainable_only", True))
    mixed, states = kwargs.get("mixed_precision", True), kwargs.get("optimizer_states", 2)
    optim = {2: "AdamW (2 fp32 states)", 1: "SGD with momentum (1 fp32 state)", 0: "SGD (no state)"}.get(
        states, f"{states} fp32 optimizer states")
    assumes = (f"assumes: {'bf16 parameters and gradients, fp32 master weights' if mixed else 'fp32 parameters and gradients'}"
               f"; optimizer {optim} per trainable parameter; "
               f"{'only trainable parameters get gradients and states' if kwargs.get('trainable_only', True) else 'every parameter trains'}; "
               f"activations for micro-batch {batch} x seq {seq} with {'fused' if kwargs.get('fused_attention', True) else 'unfused'} "
               f"attention, {'with' if kwargs.get('checkpointing', False) else 'no'} activation checkpointing; "
               "GiB = 2^30 bytes")
    cols = ("params", "grads", "optimizer", "gathered", "activations", "total")
    lines = [f"memory per rank (GiB): {what}: {n_all / 1e9:.3g}B params ({n_train / 1e9:.3g}B trainable), "
             f"micro-batch {batch} x seq {seq} per rank, world size {world_size}"
             + (f", {replicate} replica groups" if replicate > 1 else ""),
             f"{'mode':<6}" + "".join(f"{c:>12}" for c in cols)]
    import textwrap

    lines[:1] = textwrap.wrap(lines[0], 100, subsequent_indent="  ", break_on_hyphens=False) + textwrap.wrap(
        assumes, 100, subsequent_indent="  ", break_on_hyphens=False)
    for mode, row in est.items():
        lines.append(f"{mode:<6}" + "".join(f"{row[c] / _GIB:>12.3f}" for c in cols))
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text


def max_model_params(world_size: int, gpu_bytes: float = 80e9, *, mode: str = "zero3",
                     bytes_per_param: int = 16, reserve_bytes: float = 0.0) -> int:
    """The largest parameter count whose model states fit ``gpu_bytes - reserve_bytes`` per rank
    (activations, gathered units and allocator slack go into ``reserve_bytes``)."""
    budget = gpu_bytes - reserve_bytes
    if mode == "none":
        per_param = bytes_per_param
    elif mode == "zero1":
        per_param = 4 + (bytes_per_param - 4) / world_size
    elif mode == "zero2":
        per_param = 2 + (bytes_per_param - 2) / world_size
    elif mode in ("zero3", "hsdp"):
        per_param = bytes_per_param / world_size
    else:
        raise ValueError(f"unknown sharding mode {mode!r}; choose from {list(MODES)}")
    return int(budget / per_param)


def _add_arguments(parser) -> None:
    parser.add_argument("--params", type=float, help="parameter count, e.g. 8e9")
    parser.add_argument("--world-size", dest="world_size", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)


def _run(args) -> int:
    print(estimate_table(**{k: getattr(args, k) for k in ("params", "world_size", "batch", "seq")
                            if getattr(args, k, None) is not None}))
    return 0


effpass.register_command("estimate", help="per-rank memory on paper under each sharding mode (wrap_fsdp); "
                                     "effpass plan / effpass.estimate_memory replay the step",
                         add_arguments=_add_arguments, run=_run)


if __name__ == "__main__":  # pragma: no cover - quick look: python -m effpass.passes.wrap_fsdp.sizing
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        m = tf.LlamaForCausalLM(cfg)
    estimate_table(m, 1, 2048, 8, file=sys.stdout)
