"""The sharded-state (ZeRO / FSDP2) arithmetic, once: per-rank model states under each sharding mode, and
its fold onto a one-rank replay (``estimate_memory(world_size=N)``, the planner's sharding options).
``passes/wrap_fsdp/sizing.py`` (``effpass estimate``, the paper estimate) uses the same function.

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

from .result import both_reserved_after

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
    reduce-scatter. Activations do not shrink (each rank runs its own micro-batch). The gradients live at
    the one-rank peak are those the replay saw made in the backward and kept past it (inside a compiled
    backward graph too, before ``p.grad`` is set); earlier versions counted only ``p.grad`` there, 0 for a
    whole-model backward graph, and predicted the unsharded gradients on every rank.
    """
    if mode != "zero3":
        raise ValueError(f"fold_sharding: mode {mode!r} is not folded onto replays (only 'zero3', what "
                         f"wrap_fsdp runs)")
    N = world_size
    s = shard_model_states(est.parameters, est.gradients_at_peak, est.optimizer_states, N, mode, unit_bytes)
    shard = lambda b: math.ceil(b / N)  # noqa: E731
    g_peak = est.gradients_at_peak
    # NOTE(which moment): sharding shrinks the gradients, so the one-rank peak (often the end of the backward,
    # all gradients live) need not stay the peak; two moments of the forward/backward are folded, the one-rank
    # peak and the peak of everything but gradients (often the start of the backward, all saved activations
    # live), each with its live gradients sharded (between them activations fall as gradients grow, block by
    # block: the sum is about linear, its maximum at an end). The optimizer runs on shards: its whole phase
    # (gradients and its step transients) is divided.
    at_peak = est.step_peak_bytes - g_peak + shard(g_peak) if est.peak_phase != "optimizer" else 0
    at_activations = est.non_gradient_peak + shard(est.gradients_at_non_gradient_peak)
    optimizer = shard(est.phase_peaks.get("optimizer", 0)) if est.phase_peaks else 0
    if est.peak_phase == "optimizer" and not est.phase_peaks:
        optimizer = shard(est.step_peak_bytes)
    during = max(max(at_peak, at_activations) + s["gathered"] + unit_bytes, optimizer)
    model_states = est.parameters + est.optimizer_states
    start = est.start_bytes - model_states + s["params"] + s["optimizer"]
    whole = shard_model_states(est.trainable_parameters, est.gradients, 0, N, mode)
    return dataclasses.replace(
        est, world_size=N, sharding=mode, start_bytes=start, step_peak_bytes=during, peak_bytes=start + during,
        **both_reserved_after(est, start + during),
        parameters=s["params"], trainable_parameters=whole["params"], optimizer_states=s["optimizer"],
        gradients=whole["grads"], gradients_at_peak=s["grads"], notes=list(est.notes) + [
            f"FSDP over {N} ranks: model states sharded, + 2 gathered units ({unit_bytes * 2} bytes) and one "
            f"unit's unsharded gradients in backward (ZeRO-3 accounting on the replayed terms, not replayed)"])


# ------------------------------------------------------------------------------------------------------
# sequence parallelism (shard_sequence, Ulysses): what one rank of a group of ``sp`` holds
# ------------------------------------------------------------------------------------------------------
#: the attention registered for the replay of one sequence-parallel rank: the pass's all-to-alls (emulated) and
#: SDPA with no mask (the pass gives plain causal calls SDPA's ``is_causal``): no ``S x S`` mask is counted
_SP_ATTENTION = "effpass_sp_replay"
_SP_PLAIN_INPUTS = frozenset({"input_ids", "labels", "use_cache"})


def _emulated_a2a(x, n: int, heads_to_tokens: bool):
    """One rank's all-to-all around attention, as ``shard_sequence`` allocates it (the input made contiguous in
    the exchange layout, the received buffer, the layout back), with the exchange itself a copy: the replay
    of one rank sees the pass's buffers and attention's shapes (``heads / n`` heads over all ``n x`` tokens)
    without a process group. Values are meaningless (fake tensors): only bytes and shapes matter."""
    if heads_to_tokens:        # (B, H, S/n, D) -> (B, H/n, S, D)
        b, h, s, d = x.shape
        x = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous().clone()
        return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
    b, s, h, d = x.shape       # (B, S, H/n, D) -> (B, S/n, H, D)
    x = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous().clone()
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _replay_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA as one rank of a ``shard_sequence`` group runs it (emulated all-to-alls, no mask: plain causal)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = getattr(module, "config", None)
    n = getattr(cfg, "_effpass_sp_replay_size", 1)
    heads, kv = query.shape[1], key.shape[1]
    if n > 1 and heads % n == 0:
        rep = next(r for r in range(1, heads // kv + 1) if (heads // kv) % r == 0 and (kv * r) % n == 0)
        if rep > 1:   # key/value heads replicated until they split over the group, as the pass does
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        query, key, value = (_emulated_a2a(t, n, True) for t in (query, key, value))
        groups = getattr(module, "num_key_value_groups", 1)
        if rep > 1 and hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = groups // rep
        try:
            out, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)
        finally:
            if rep > 1 and hasattr(module, "num_key_value_groups"):
                module.num_key_value_groups = groups
        return _emulated_a2a(out, n, False), weights
    # heads the group cannot split (ring attention or padding): local tokens, all heads (keys/values rotate)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)


def _register_sp_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_SP_ATTENTION, _replay_attention)
    AttentionMaskInterface.register(_SP_ATTENTION, lambda *a, **k: None)


def sequence_parallel_terms(config, batch: int, seq: int, sp: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes one rank of a ``shard_sequence`` group of ``sp`` holds beyond a one-process step on ``seq / sp``
    tokens (what the planner replays for it): the terms the pass keeps for the whole sequence, and its
    all-to-all buffers. ``dtype_bytes``: bytes per element of the hidden states (2 for bf16).

    * the embedding output, made whole by the model before the first block keeps its slice (freed when the
      forward returns), or its gradient, made whole when the backward reaches the embedding (never both at
      once): ``batch x seq x hidden``, less the local share the replay already counts;
    * the rotary ``cos``/``sin`` tables, computed whole by the model and sliced per block (views: the whole
      tables stay alive while a block saves its slice): ``2 x batch x seq x head_dim``, less the local share;
    * the labels shifted over the whole sequence (int64) during the step, and the whole ``input_ids`` and
      ``labels`` inputs (counted at the start: ``inputs``).
    The all-to-all buffers are not a term: the replay runs them (:func:`_replay_attention`, emulated).
    Attention itself (all tokens for ``heads / sp`` heads) is replayed as the rank runs it."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    other = (sp - 1) / sp
    return {
        "embedding output or its gradient (whole sequence)": int(batch * seq * hidden * dtype_bytes * other),
        "rotary cos/sin (whole sequence)": int(2 * batch * seq * head_dim * dtype_bytes * other),
        "shifted labels (whole sequence, int64)": batch * seq * 8,
        "input_ids and labels (whole sequence, int64; at the start)": int(2 * batch * seq * 8 * other),
    }


def sequence_parallel_replay(model, example_inputs, sp: int):
    """``(local inputs, restore, terms)`` for predicting one rank of a ``shard_sequence`` group of ``sp``: the
    example inputs cut to their first ``seq / sp`` tokens, the model switched to mask-less causal SDPA until
    ``restore()`` is called, and :func:`sequence_parallel_terms`. Checks what the pass checks (the length
    divisible by ``sp``; heads split evenly or by padding/ring: noted, not refused) and what the prediction
    covers (plain causal batches: ``input_ids`` and ``labels``; SDPA attention)."""
    import torch

    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sequence_parallel must be an int >= 1, got {sp!r}")
    if not isinstance(example_inputs, dict):
        raise ValueError("sequence-parallel predictions need keyword inputs (input_ids=..., labels=...)")
    extra = sorted(k for k, v in example_inputs.items() if v is not None and k not in _SP_PLAIN_INPUTS)
    if extra:
        raise ValueError(f"sequence-parallel predictions cover plain causal batches (input_ids, labels); got "
                         f"{extra} (masks and packed positions stay whole on every rank: not modelled)")
    ids = example_inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("sequence-parallel predictions need input_ids of shape (batch, seq)")
    batch, seq = ids.shape
    if seq % sp:
        raise ValueError(f"sequence length {seq} is not divisible by sequence_parallel={sp} (shard_sequence "
                         f"needs a multiple: pad to {seq + (-seq % sp)})")
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    base = impl.removeprefix("effpass_sp_")
    if base not in ("sdpa", "replay", "flash_attention_2"):
        raise ValueError(f"sequence-parallel predictions are made for SDPA attention; the model has "
                         f"attn_implementation={impl!r} (eager attention under the pass builds (heads/sp) x seq x seq "
                         f"scores per rank: load the model with attn_implementation='sdpa')")
    local = {k: (v[:, : seq // sp] if isinstance(v, torch.Tensor) and v.dim() == 2 else v)
             for k, v in example_inputs.items()}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    terms = sequence_parallel_terms(cfg, batch, seq, sp, torch.empty((), dtype=dtype).element_size())
    _register_sp_attention()
    configs = {id(c): c for c in (cfg, cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c in configs:
        c._attn_implementation = _SP_ATTENTION
        c._effpass_sp_replay_size = sp

    def restore():
        for c, v in saved:
            c._attn_implementation = v
            c._effpass_sp_replay_size = 1
    return local, restore, terms


def fold_sequence_parallel(est, sp: int, terms: dict[str, int]):
    """Per-rank figures of one rank of a ``shard_sequence`` group of ``sp`` from the replay of ``seq / sp``
    tokens (``est``, already folded by :func:`fold_sharding` when FSDP shards over all ranks) plus
    :func:`sequence_parallel_terms` (whole-sequence tensors at the peak: counted whole, a bound)."""
    if sp <= 1:
        return est
    add = sum(terms.values())
    inputs_whole = terms.get("input_ids and labels (whole sequence, int64; at the start)", 0)
    return dataclasses.replace(
        est, peak_bytes=est.peak_bytes + add, start_bytes=est.start_bytes + inputs_whole,
        **both_reserved_after(est, est.peak_bytes + add),
        step_peak_bytes=est.step_peak_bytes + add - inputs_whole, inputs=est.inputs + inputs_whole,
        notes=list(est.notes) + [
            f"sequence parallel ({sp} ranks per sequence, shard_sequence): replayed on seq/{sp} tokens with "
            f"mask-less causal SDPA, + " + ", ".join(f"{k} {v} bytes" for k, v in terms.items())])
