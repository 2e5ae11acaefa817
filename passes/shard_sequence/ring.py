"""``shard_sequence``'s ring fallback for heads the group cannot split: torch's ring ``context_parallel`` (its DTensor
SDPA handlers), feature-tested on the installed torch (:func:`ring_support` says why it cannot serve a case),
and the attention function that runs it.
"""
from __future__ import annotations

import torch

__all__ = ["enable_ring", "ring_attention", "ring_note", "ring_support"]


#: modules of torch's ring attention (context parallelism), newest first; feature-tested, not version-tested
_RING_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention")
#: the SDPA kernels torch's ring handlers must serve for a device type (forward and backward)
_RING_KERNELS = {"cuda": (("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
                          ("_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_efficient_attention_backward"),
                          ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")),
                 "cpu": (("_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_flash_attention_for_cpu_backward"),)}


def _ring_machinery():
    """torch's ring attention dispatcher, if this torch has one: ``(module, served aten op names)`` or
    ``(None, why not)``. What is tested is what the pass uses: the DTensor SDPA handlers (``custom_ops``), the
    switch that installs them (``_enable_context_parallel_dispatcher``) and the load-balance option."""
    import importlib

    for name in _RING_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        handlers = getattr(mod, "custom_ops", None)
        opts = getattr(mod, "_cp_options", None)
        if (isinstance(handlers, dict) and callable(getattr(mod, "_enable_context_parallel_dispatcher", None))
                and hasattr(opts, "enable_load_balance")):
            return mod, {str(getattr(op, "__name__", op)).split(".")[0] for op in handlers}
    return None, ("this torch has no ring-attention dispatcher (torch.distributed.tensor.experimental context "
                  "parallelism with DTensor SDPA handlers)")


def ring_support(device_type: str, attn_implementation: str, config=None) -> str | None:
    """Why torch's ring ``context_parallel`` cannot serve this attention here, or None when it can.

    Feature-tested on the installed torch: its DTensor SDPA handlers must cover the SDPA kernels of
    ``device_type`` (forward and backward); the attention must be torch's ``scaled_dot_product_attention``
    (``attn_implementation="sdpa"``: flash_attention_2 and eager attention never reach those handlers), and
    plain causal (ring attention shards keys and values by position: no sliding windows, no chunked layers)."""
    mod, served = _ring_machinery()
    if mod is None:
        return served
    kernels = _RING_KERNELS.get(device_type, ())
    if not any(all(k in served for k in pair) for pair in kernels):
        have = sorted(k for k in served if not k.endswith("_backward"))
        return (f"torch's context_parallel (ring) serves SDPA only through the kernels {have}; the sequence group is "
                f"on {device_type!r}, whose SDPA kernel ({', '.join(p[0] for p in kernels) or 'none known'}) it has "
                f"no handler for" + (" (on CPU it raises NotImplementedError: no sharding strategy for "
                                     "aten._scaled_dot_product_flash_attention_for_cpu)" if device_type == "cpu" else ""))
    base = attn_implementation.removeprefix("effpass_sp_")
    if base != "sdpa":
        return (f"torch's context_parallel (ring) intercepts torch's scaled_dot_product_attention only; the model's "
                f"attn_implementation is {base!r} (load it with attn_implementation='sdpa')")
    if config is not None:
        kinds = {k for k in (getattr(config, "layer_types", None) or []) if isinstance(k, str)}
        window = getattr(config, "sliding_window", None)
        if kinds - {"full_attention"} or (not kinds and window and getattr(config, "use_sliding_window", True)):
            return (f"torch's context_parallel (ring) serves plain causal attention only; this model has "
                    f"{'layer types ' + str(sorted(kinds)) if kinds - {'full_attention'} else f'sliding_window={window}'}")
    return None


def ring_note(device_type: str, impl: str, cfg) -> str:
    why = ring_support(device_type, impl, cfg)
    return why or "torch's context_parallel (ring) could serve it: ShardSequence(uneven_heads='ring')"


def enable_ring() -> None:
    """Install torch's ring SDPA handlers for DTensors (what its context_parallel module-wrapper mode does),
    with load balancing off: the pass keeps contiguous token chunks (rank r holds tokens r*S/n .. (r+1)*S/n)."""
    mod, _ = _ring_machinery()
    mod._enable_context_parallel_dispatcher()
    mod._cp_options.enable_load_balance = False


#: keyword arguments of the attention call the ring fallback cannot honour when not None/False
_RING_REFUSED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


@torch.compiler.disable
def _ring_sdpa(query, key, value, mesh, dropout: float, scale):
    """torch's ring attention over the sequence group: q/k/v are this rank's contiguous token chunk
    ``(B, H, S/n, D)``, wrapped as DTensors sharded on the sequence; SDPA on them dispatches to torch's ring
    handlers (forward, and backward through autograd). Runs eagerly (a graph break under Dynamo): tracing
    DTensor's context-parallel handlers is not verified here."""
    from torch.distributed.tensor import DTensor, Shard

    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    return out.to_local()


def ring_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function in ring mode: no all-to-all; each rank keeps its tokens and all heads,
    torch's ring attention rotates keys and values around the group."""
    state = module._effpass_sp_attn[0]
    if attention_mask is not None or not state.plain_causal:
        raise ValueError(
            "shard_sequence (ring fallback for heads the group cannot split): torch's context_parallel serves plain "
            "causal attention only, and this call has "
            + ("an attention mask" if attention_mask is not None else "attention_mask or position_ids (padding or "
               "packing)") + "; call the model with input_ids and labels only, or use a group size that divides "
            "the heads, or ShardSequence(uneven_heads='pad')")
    bad = [k for k in _RING_REFUSED_KWARGS if kwargs.get(k) not in (None, False)]
    if bad:
        raise ValueError(f"shard_sequence (ring fallback): the attention call passes {bad}, which torch's "
                         "context_parallel SDPA does not serve")
    if key.shape[1] != query.shape[1]:          # GQA: one key/value head per query head (no enable_gqa in the ring)
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = _ring_sdpa(query, key, value, state.mesh[state.mesh_dim], dropout, scaling)
    return out.transpose(1, 2).contiguous(), None
