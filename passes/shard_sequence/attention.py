"""``shard_sequence``'s attention: the all-to-alls between tokens and heads, the registered Hugging Face attention
function around the model's own (Ulysses), the causal-mask function that skips the whole ``S x S`` mask for
plain causal calls, and the key/value head replication the group needs.
"""
from __future__ import annotations

import torch

from .hooks import STATES
from .ring import ring_attention

__all__ = ["heads_from_tokens", "kv_replication", "sp_attention", "sp_sdpa_mask", "tokens_from_heads"]


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if hasattr(funcol, "wait_tensor") else out


def heads_from_tokens(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """``(B, H, S/n, D)`` local tokens, all heads -> ``(B, H/n, S, D)`` all tokens, this rank's heads."""
    b, h, s, d = x.shape
    x = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)          # (n: head chunk, B, H/n, s, D)
    x = _a2a(x, group)                                                  # (n: source rank = token chunk, ...)
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def tokens_from_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """``(B, S, H/n, D)`` (Hugging Face's attention output layout) -> ``(B, S/n, H, D)``."""
    b, s, h, d = x.shape
    x = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4)          # (n: token chunk, B, S/n, H/n, D)
    x = _a2a(x, group)                                                  # (n: source rank = head chunk, ...)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def sp_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: all-to-all, the model's own attention, inverse all-to-all."""
    sp = getattr(module, "_effpass_sp_attn", None)
    if sp is None:
        raise RuntimeError(f"shard_sequence: attention module {type(module).__name__} was not prepared by the pass")
    state, inner, kv_rep, pad = sp
    if inner is None:                     # ring fallback (heads the group cannot split)
        return ring_attention(module, query, key, value, attention_mask, **kwargs)
    n, group = state.size, state.group
    if kv_rep > 1:
        key, value = key.repeat_interleave(kv_rep, dim=1), value.repeat_interleave(kv_rep, dim=1)
    heads = query.shape[1]
    if pad:   # uneven_heads="pad": zero heads up to a multiple of n; their outputs are dropped below
        zeros = (0, 0, 0, 0, 0, pad)
        query, key, value = (torch.nn.functional.pad(t, zeros) for t in (query, key, value))
    q = heads_from_tokens(query, n, group)
    k = heads_from_tokens(key, n, group)
    v = heads_from_tokens(value, n, group)
    out, weights = inner(module, q, k, v, attention_mask, **kwargs)
    out = tokens_from_heads(out, n, group)
    return (out[:, :, :heads] if pad else out), None


def sp_sdpa_mask(*args, **kwargs):
    """Hugging Face's ``sdpa_mask``, except for calls that are plain causal: then no mask (SDPA's ``is_causal``).

    Under Dynamo Hugging Face cannot rule out packing (it reads ``position_ids`` values), so it never skips the
    causal mask and builds a whole ``S x S`` one, which sequence parallelism cannot shrink (attention sees
    whole sequences). The root pre-hook knows the call had no ``attention_mask`` and no ``position_ids``
    (positions are the model's own ``arange``: nothing packed, nothing padded) and nothing else that could
    add to the mask (:data:`PLAIN_CALL_KWARGS`). Mask calls that add anything (sliding or chunked windows
    pass ``local_size``, extra or/and mask functions set ``use_vmap``, bidirectional masks pass
    ``allow_is_bidirectional_skip``) build the mask as Hugging Face does."""
    from transformers.masking_utils import sdpa_mask

    cfg = kwargs.get("config")
    state = STATES.get(id(cfg)) if cfg is not None else None
    if (state is not None and state.plain_causal and not args and kwargs.get("attention_mask") is None
            and kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("q_offset")
            and not kwargs.get("kv_offset") and kwargs.get("local_size") is None and not kwargs.get("use_vmap")
            and "allow_is_bidirectional_skip" not in kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def kv_replication(heads: int, kv_heads: int, n: int) -> int:
    """The smallest factor r (dividing heads/kv_heads) with kv_heads * r divisible by n."""
    groups = heads // kv_heads
    for r in range(1, groups + 1):
        if groups % r == 0 and (kv_heads * r) % n == 0:
            return r
    raise AssertionError("unreachable when heads % n == 0")
