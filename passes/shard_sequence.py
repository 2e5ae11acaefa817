"""``shard_sequence``: Ulysses sequence parallelism for unmodified Hugging Face models, on torch.distributed.

Phase: module only (``prepare_module``), on the eager model before compile; everything it installs is
plain eager code (module hooks and an attention function), so the eager model computes what the
compiled one does (reference semantics) and Dynamo traces it into the graphs like model code.

What it does
    Every rank of a sequence-parallel group of ``size`` ranks calls the model with the same whole batch
    (the group is the ``sequence`` dimension of a ``DeviceMesh`` ``(data, sequence)``; with ``size`` equal
    to the world size, the whole world). Then:

    1. A forward pre-hook on the root (the ``...ForCausalLM``) checks the length ``S`` (divisible by
       ``size``), shifts the labels over the *whole* sequence (``labels[..., 1:]``, ``-100`` appended) and
       keeps this rank's slice of them as ``shift_labels``, and passes ``num_items_in_batch`` = the number
       of counted tokens of the whole batch, so Hugging Face's loss is ``sum over my tokens / all tokens``.
       The embedding, positions (rotary tables) and masks are computed by the model itself over the whole
       sequence, so they are exactly those of the unsplit model (packed boundaries from ``position_ids``
       included).
    2. A forward pre-hook on every transformer block keeps this rank's ``S/size`` tokens of every per-token
       input (hidden states, ``position_ids``, the rotary ``cos``/``sin``); masks stay whole. From the
       first block on, each rank holds 1/size of the tokens of every sequence.
    3. Every attention goes through a registered Hugging Face attention function (``effpass_sp_<impl>``,
       wrapping the model's own ``eager``/``sdpa``/... implementation): an all-to-all turns
       ``(B, H, S/n, D)`` query/key/value into ``(B, H/n, S, D)`` (whole sequences for a subset of heads),
       the original attention runs with the whole mask and positions, and the inverse all-to-all returns
       ``(B, S/n, H, D)``. With fewer key/value heads than ranks (or a count ``size`` does not divide),
       key/value heads are replicated (``repeat_interleave``) until they split evenly. The all-to-all is
       ``torch.distributed._functional_collectives.all_to_all_single`` (differentiable, traceable by
       Dynamo), so the attention between the two all-to-alls is ordinary model code for the graph passes
       (``fuse_attention`` turns hand-written attention there into SDPA).
    4. A forward hook on the root replaces ``loss`` by the group's sum (the unsplit loss), with gradient
       ``size`` towards the local loss, and (without ``wrap_fsdp``) each parameter's gradient is averaged
       over the whole mesh after it is accumulated. The gradient of the sum over ranks of the local
       losses is the sum over ranks of the local gradients; times ``size`` then averaged over ``data x
       sequence`` ranks it is the data-parallel mean of the sequence groups' gradients, which is also what
       FSDP2's reduce-scatter over all ranks computes, so ``wrap_fsdp`` composes unchanged.

Ordering: after ``quantize_linear``/``inject_lora`` (which swap modules) and before ``wrap_fsdp``
(declared there), which compiles per block after this pass's hooks are installed.

Invariants and limits
    * ``torch.distributed`` is initialised; every rank of a group passes the same batch.
    * Causal-LM losses (``...ForCausalLM`` whose ``forward`` hands ``**kwargs`` to ``self.loss_function``);
      other heads are refused when called with labels.
    * The returned ``logits`` are this rank's tokens only ``(B, S/n, V)``.
    * Heads the group does not split: torch's ring ``context_parallel`` (its DTensor SDPA handlers) where the
      installed torch serves the attention (feature-tested: CUDA SDPA kernels, ``sdpa``, plain causal calls;
      keys and values rotate, no all-to-all); else an error naming why and the valid sizes, or
      ``uneven_heads="pad"``.
    * Models with sequence mixers other than attention (convolutions or recurrences over the sequence:
      Mamba, linear attention, gated DeltaNet) are refused: an all-to-all around attention cannot serve them.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import effpass
from effpass.graph import transformer_blocks

__all__ = ["ShardSequence", "build_sequence_mesh", "sequence_parallel_sampler", "sequence_parallel_trainer",
           "shard_batches_for_group", "state_of"]

IGNORE_INDEX = -100
#: sequence mixers an all-to-all around attention cannot serve
_MIXER_NAMES = re.compile(r"Mamba|GatedDeltaNet|DeltaNet|LinearAttention|ShortConv|RWKV|Recurrent|"
                          r"(?<![A-Za-z])(RNN|LSTM|GRU)(?![a-z])|SSM|Hyena|xLSTM")
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global",
                          "local", "sliding_window"}


def build_sequence_mesh(size: int, device_type: str | None = None, mesh_dim: str = "sequence"):
    """A 2-D ``(data, sequence)`` mesh over all ranks: sequence groups of ``size`` consecutive ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"shard_sequence: size={size} must divide the world size {world}; valid sizes: "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    return init_device_mesh(device_type, (world // size, size), mesh_dim_names=("data", mesh_dim))


class _State:
    """What the hooks share: the group, this rank's place in it, and the current call's whole length."""

    def __init__(self, mesh, mesh_dim: str, reduce_gradients: bool):
        self.mesh, self.mesh_dim = mesh, mesh_dim
        self.group = mesh.get_group(mesh_dim)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.reduce_gradients = reduce_gradients
        self.full_len: int | None = None
        #: the current call has no attention_mask and no position_ids: one unpadded, unpacked sequence per row
        self.plain_causal = False

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        s = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * s, s)


def state_of(model: nn.Module) -> _State | None:
    """The sequence-parallel state :class:`ShardSequence` attached to ``model`` (None without the pass)."""
    return getattr(model, "_effpass_sp", None)


# -- the all-to-alls ---------------------------------------------------------------------------------
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


def _sp_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: all-to-all, the model's own attention, inverse all-to-all."""
    sp = getattr(module, "_effpass_sp_attn", None)
    if sp is None:
        raise RuntimeError(f"shard_sequence: attention module {type(module).__name__} was not prepared by the pass")
    state, inner, kv_rep, pad = sp
    if inner is None:                     # ring fallback (heads the group cannot split)
        return _ring_attention(module, query, key, value, attention_mask, **kwargs)
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


# -- the causal mask --------------------------------------------------------------------------------------
#: state of each prepared model, by id of its config (the mask interface gets the config, not the module)
_STATES: dict[int, _State] = {}
#: call arguments that leave the model's causal mask plain causal (any other argument, e.g. token_type_ids or
#: mm_token_type_ids, may add mask functions: the mask is then built as Hugging Face builds it)
_PLAIN_CALL_KWARGS = frozenset({"input_ids", "inputs_embeds", "labels", "shift_labels", "num_items_in_batch",
                                "use_cache", "return_dict", "output_attentions", "output_hidden_states",
                                "logits_to_keep"})


def _sp_sdpa_mask(*args, **kwargs):
    """Hugging Face's ``sdpa_mask``, except for calls that are plain causal: then no mask (SDPA's ``is_causal``).

    Under Dynamo Hugging Face cannot rule out packing (it reads ``position_ids`` values), so it never skips the
    causal mask and builds a whole ``S x S`` one, which sequence parallelism cannot shrink (attention sees
    whole sequences). The root pre-hook knows the call had no ``attention_mask`` and no ``position_ids``
    (positions are the model's own ``arange``: nothing packed, nothing padded) and nothing else that could
    add to the mask (:data:`_PLAIN_CALL_KWARGS`). Mask calls that add anything (sliding or chunked windows
    pass ``local_size``, extra or/and mask functions set ``use_vmap``, bidirectional masks pass
    ``allow_is_bidirectional_skip``) build the mask as Hugging Face does."""
    from transformers.masking_utils import sdpa_mask

    cfg = kwargs.get("config")
    state = _STATES.get(id(cfg)) if cfg is not None else None
    if (state is not None and state.plain_causal and not args and kwargs.get("attention_mask") is None
            and kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("q_offset")
            and not kwargs.get("kv_offset") and kwargs.get("local_size") is None and not kwargs.get("use_vmap")
            and "allow_is_bidirectional_skip" not in kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


# -- the hooks -----------------------------------------------------------------------------------------
def _root_pre_hook(state: _State):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None or ids.dim() < 2:
            raise ValueError("shard_sequence: the model must be called with input_ids or inputs_embeds "
                             "(batch, sequence, ...)")
        length = ids.shape[1]
        if length % state.size:
            pad = -length % state.size
            raise ValueError(
                f"shard_sequence: sequence length {length} is not divisible by the sequence-parallel size "
                f"{state.size}; pad it to {length + pad} (a multiple of {state.size}: e.g. the collator's "
                f"pad_to_multiple_of={state.size}, with labels -100 and attention_mask 0 on the padding)")
        state.full_len = length
        # NOTE(memory): without attention_mask and position_ids the model makes arange positions itself: no
        # padding, no packing, so its causal mask is plain causal (see _sp_sdpa_mask)
        state.plain_causal = len(args) <= 1 and all(k in _PLAIN_CALL_KWARGS for k, v in kwargs.items()
                                                     if v is not None)
        labels = kwargs.get("labels")
        if labels is not None:
            if kwargs.get("shift_labels") is None:
                shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
            else:
                shifted = kwargs["shift_labels"]
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
            mine = state.local(shifted, -1).contiguous()
            kwargs["labels"] = mine
            kwargs["shift_labels"] = mine
        return args, kwargs
    return hook


def _root_post_hook(state: _State):
    def hook(module, args, output):
        loss = getattr(output, "loss", None)
        if loss is None:
            return output
        from torch.distributed import _functional_collectives as funcol

        total = funcol.all_reduce(loss.detach(), "sum", state.group)
        if hasattr(funcol, "wait_tensor"):
            total = funcol.wait_tensor(total)
        n = state.size
        # NOTE(gradients): value = the group's sum (the unsplit loss); d/d(local loss) = n, so the mean of
        # the gradients over data x sequence ranks is the data-parallel mean of each group's full gradient.
        output["loss"] = n * loss + (total - n * loss.detach())
        return output
    return hook


def _slice_tokens(value, state: _State):
    if isinstance(value, torch.Tensor):
        if value.dim() in (2, 3) and value.shape[1] == state.full_len:
            return state.local(value, 1)
        return value
    if isinstance(value, tuple):
        return tuple(_slice_tokens(v, state) for v in value)
    return value


def _block_pre_hook(state: _State):
    def hook(module, args, kwargs):
        if state.full_len is None or state.size == 1:
            return args, kwargs
        new_args = tuple(_slice_tokens(a, state) for a in args)
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[1] == state.full_len:
            # NOTE(memory): a copy, so the whole embedding output is not kept alive by a view of it
            new_args = (state.local(args[0], 1).clone(),) + new_args[1:]
        new_kwargs = {}
        for key, value in kwargs.items():
            if key == "attention_mask":           # masks stay whole: attention sees whole sequences
                new_kwargs[key] = value
            elif key == "hidden_states" and isinstance(value, torch.Tensor) and value.shape[1] == state.full_len:
                new_kwargs[key] = state.local(value, 1).clone()
            else:
                new_kwargs[key] = _slice_tokens(value, state)
        return new_args, new_kwargs
    return hook


def _grad_hook(group, state: _State):
    def hook(param):
        if param.grad is not None and state.reduce_gradients:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG if _has_avg() else dist.ReduceOp.SUM, group=group)
            if not _has_avg():
                param.grad.div_(dist.get_world_size(group))
    return hook


def _has_avg() -> bool:
    # gloo has no ReduceOp.AVG (NCCL does)
    return dist.get_backend() == "nccl"


# -- checks ---------------------------------------------------------------------------------------------
def _text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _other_mixers(model: nn.Module) -> list[str]:
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.RNNBase)) or _MIXER_NAMES.search(type(mod).__name__):
            found.append(f"{name} ({type(mod).__name__})")
    cfg = _text_config(model)
    for i, kind in enumerate(getattr(cfg, "layer_types", None) or []):
        if isinstance(kind, str) and kind not in _ATTENTION_LAYER_TYPES:
            found.append(f"layer {i} (layer_types: {kind!r})")
    return found


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """Modules whose code calls Hugging Face's attention interface (their module defines
    ``eager_attention_forward``), with that eager function."""
    out = []
    for name, mod in model.named_modules():
        src = sys.modules.get(type(mod).__module__)
        eager = getattr(src, "eager_attention_forward", None)
        if eager is not None and hasattr(mod, "head_dim") and "Attention" in type(mod).__name__:
            out.append((name, mod, eager))
    return out


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


def _ring_note(device_type: str, impl: str, cfg) -> str:
    why = ring_support(device_type, impl, cfg)
    return why or "torch's context_parallel (ring) could serve it: ShardSequence(uneven_heads='ring')"


def _enable_ring() -> None:
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


def _ring_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
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


def _kv_replication(heads: int, kv_heads: int, n: int) -> int:
    """The smallest factor r (dividing heads/kv_heads) with kv_heads * r divisible by n."""
    groups = heads // kv_heads
    for r in range(1, groups + 1):
        if groups % r == 0 and (kv_heads * r) % n == 0:
            return r
    raise AssertionError("unreachable when heads % n == 0")


@effpass.register_pass("shard_sequence", run_after=("inject_lora", "quantize_linear", "pack_sequences"))
@dataclass(frozen=True, kw_only=True)
class ShardSequence(effpass.Pass):
    """Split every sequence over a group of ranks (Ulysses: all-to-all tokens <-> heads around attention).

    Before (each rank)::

        embed(ids[B, S]) -> blocks(h[B, S, H]) -> head -> loss over S tokens

    After (rank r of n)::

        embed(ids[B, S]) -> pre-hook: h[:, r*S/n:(r+1)*S/n] -> blocks(h[B, S/n, H])
            attention: q,k,v[B, heads, S/n, D] -all-to-all-> [B, heads/n, S, D] -> attention(whole mask)
                       -> out[B, S, heads/n, D] -all-to-all-> [B, S/n, heads, D]
        -> head -> loss over my S/n tokens / all counted tokens -> sum over the group
    """

    size: int = field(default=0, metadata={
        "doc": "ranks per sequence-parallel group (0: the whole world, or the mesh dimension's size)"})
    mesh_dim: str = field(default="sequence", metadata={
        "doc": "name of the sequence dimension of the device mesh"})
    mesh: Any = field(default=None, metadata={
        "doc": "a DeviceMesh holding mesh_dim (default: a (data, sequence) mesh over all ranks)"})
    reduce_gradients: bool | None = field(default=None, metadata={
        "doc": "average each gradient over the mesh after backward (default: unless wrap_fsdp is in the "
               "pipeline, whose reduce-scatter over all ranks does it)"})

    uneven_heads: str = field(default="ring", metadata={
        "doc": "heads the group size does not divide: 'ring' (torch's ring context_parallel where the installed "
               "torch serves the attention: CUDA SDPA, plain causal; else an error naming why and the valid sizes), "
               "'error' (names the valid sizes) or 'pad' (zero heads up to a multiple of the group; exact, more "
               "attention compute)"})

    summary = "Ulysses sequence parallelism: each rank keeps 1/n of the tokens, all-to-all around attention"

    def validate(self) -> None:
        if self.uneven_heads not in ("ring", "error", "pad"):
            raise ValueError(f"shard_sequence: uneven_heads={self.uneven_heads!r}; valid: 'ring', 'error', 'pad'")
        if self.size < 0:
            raise ValueError(f"shard_sequence: size must be >= 1 (or 0 for the whole world), got {self.size}")

    @classmethod
    def default_note(cls) -> str:
        return "off (needs torch.distributed; add ShardSequence(size=N) under torchrun)"

    def _mesh(self):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("shard_sequence needs torch.distributed: call torch.distributed.init_process_group() "
                               "first (under torchrun; 'nccl' on GPUs, 'gloo' on CPU)")
        if self.mesh is None:
            return build_sequence_mesh(self.size or dist.get_world_size(), mesh_dim=self.mesh_dim)
        names = tuple(self.mesh.mesh_dim_names or ())
        if self.mesh_dim not in names:
            raise ValueError(f"shard_sequence: the device mesh has no dimension {self.mesh_dim!r}; its dimensions "
                             f"are {list(names)} (name one with mesh_dim=, or build the mesh with "
                             f"mesh_dim_names=(..., {self.mesh_dim!r}))")
        got = self.mesh.size(names.index(self.mesh_dim))
        if self.size and self.size != got:
            raise ValueError(f"shard_sequence: size={self.size} but the mesh dimension {self.mesh_dim!r} has {got} ranks")
        return self.mesh

    def prepare_module(self, model: nn.Module, ctx) -> effpass.PassResult:
        mixers = _other_mixers(model)
        if mixers:
            raise ValueError(
                f"shard_sequence: the model mixes tokens outside attention ({', '.join(mixers[:4])}"
                f"{', ...' if len(mixers) > 4 else ''}); an all-to-all around attention cannot serve convolutions "
                "or recurrences over the sequence. Sequence parallelism works for attention-only models "
                "(Llama, Qwen, Mistral, Gemma, ...); for this model use data parallelism (wrap_fsdp) and "
                "activation checkpointing instead")
        cfg = _text_config(model)
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        attns = _attention_modules(model)
        if cfg is None or impl is None or not attns:
            raise ValueError(
                f"shard_sequence: {type(model).__name__} does not call its attention through transformers' "
                "AttentionInterface (no attention module with an eager_attention_forward and a config "
                "attn_implementation); supported: Hugging Face models of transformers >= 5 (Llama, Qwen, "
                "Mistral, Gemma, Phi, ...)")
        mesh = self._mesh()
        reduce = self.reduce_gradients
        if reduce is None:
            reduce = ctx.find_pass("wrap_fsdp") is None
        state = _State(mesh, self.mesh_dim, reduce)
        n = state.size
        heads = getattr(cfg, "num_attention_heads", None)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads is None:
            raise ValueError(f"shard_sequence: the config {type(cfg).__name__} has no num_attention_heads")
        if heads % kv_heads:
            raise ValueError(f"shard_sequence: {heads} heads are not a multiple of {kv_heads} key/value heads")
        pad, ring = 0, False
        if heads % n:
            why_not_ring = ring_support(mesh.device_type, impl, cfg) if self.uneven_heads == "ring" else None
            if self.uneven_heads == "error" or (self.uneven_heads == "ring" and why_not_ring):
                raise ValueError(
                    f"shard_sequence: {heads} attention heads ({kv_heads} key/value heads) cannot be split over {n} "
                    f"ranks; valid sequence-parallel sizes for this model: "
                    f"{[d for d in range(1, heads + 1) if heads % d == 0]}, or ShardSequence(uneven_heads='pad') "
                    f"(zero heads up to {-(-heads // n) * n}: exact, {(-(-heads // n) * n) / heads:.2f}x the attention "
                    f"compute). Ring fallback (uneven_heads='ring'): "
                    f"{why_not_ring or _ring_note(mesh.device_type, impl, cfg)}")
            if self.uneven_heads == "ring":
                ring, kv_rep = True, 1
                _enable_ring()
            else:
                pad = -heads % n
                kv_rep = heads // kv_heads          # key/value expanded to one per query head, then padded too
        else:
            kv_rep = _kv_replication(heads, kv_heads, n)

        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = impl.removeprefix("effpass_sp_")
        name = f"effpass_sp_{base}"
        AttentionInterface.register(name, _sp_attention)
        if base == "sdpa":
            # NOTE(memory): under Dynamo Hugging Face never skips the causal mask (it cannot rule out packing
            # there); a whole S x S mask per rank would not shrink with the group: skipped for plain calls
            AttentionMaskInterface.register(name, _sp_sdpa_mask)
        elif base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])
        for _, mod, eager in attns:
            inner = None if ring else eager if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
            mod._effpass_sp_attn = (state, inner, kv_rep, pad)
            if kv_rep > 1 and hasattr(mod, "num_key_value_groups"):
                mod.num_key_value_groups = mod.num_key_value_groups // kv_rep
        for c in {id(c): c for c in (model.config, cfg)}.values():
            c._attn_implementation = name

        blocks = transformer_blocks(model)
        if not blocks:
            raise ValueError("shard_sequence: found no transformer blocks (a ModuleList of identical layers)")
        model.register_forward_pre_hook(_root_pre_hook(state), with_kwargs=True)
        model.register_forward_hook(_root_post_hook(state))
        for _, block in blocks:
            block.register_forward_pre_hook(_block_pre_hook(state), with_kwargs=True)
        grad_hooks = 0
        if reduce and dist.get_world_size() > 1:
            world_group = dist.group.WORLD if mesh.ndim == 1 or mesh.size() == dist.get_world_size() else None
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_grad_hook(world_group, state))
                    grad_hooks += 1
        model._effpass_sp = state
        for c in {id(c): c for c in (model.config, cfg)}.values():
            _STATES[id(c)] = state
        return effpass.PassResult(changed=True, stats={
            "size": n, "rank": state.rank, "data_parallel": mesh.size() // n, "attention_modules": len(attns),
            "blocks": len(blocks), "kv_replication": kv_rep, "padded_heads": pad, "attn_implementation": name,
            "attention": "ring" if ring else "ulysses",
            "gradient_hooks": grad_hooks})


def _data_rank(model_or_mesh, mesh_dim: str, who: str) -> tuple[int, int]:
    """(this rank's index over the mesh's dimensions other than ``mesh_dim``, their number)."""
    state = state_of(model_or_mesh) if isinstance(model_or_mesh, nn.Module) else None
    mesh = state.mesh if state is not None else model_or_mesh
    if mesh is None or isinstance(mesh, nn.Module):
        raise ValueError(f"{who}: pass the model prepared by shard_sequence (ShardSequence in its passes) or its "
                         "DeviceMesh")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim not in names:
        raise ValueError(f"{who}: the mesh has no dimension {mesh_dim!r}; it has {list(names)}")
    coord, shape = mesh.get_coordinate(), mesh.shape
    dim = names.index(mesh_dim)
    index, replicas = 0, 1
    for i, (c, s) in enumerate(zip(coord, shape)):   # the rank's index over the mesh's other dimensions
        if i != dim:
            index, replicas = index * s + c, replicas * s
    return index, replicas


def sequence_parallel_sampler(dataset, model_or_mesh=None, *, mesh_dim: str = "sequence", shuffle: bool = True,
                              seed: int = 0, drop_last: bool = False):
    """A ``DistributedSampler`` over the *data* ranks only: every rank of a sequence-parallel group draws the
    same examples (what ``shard_sequence`` expects), different groups draw different ones."""
    from torch.utils.data.distributed import DistributedSampler

    index, replicas = _data_rank(model_or_mesh, mesh_dim, "sequence_parallel_sampler")
    return DistributedSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def shard_batches_for_group(dataloader, model_or_mesh, *, mesh_dim: str = "sequence"):
    """Re-shard a data loader that splits batches over *all* ranks so that it splits them over the data ranks
    only: every rank of a sequence-parallel group then gets the same batches (what ``shard_sequence`` needs).

    Serves accelerate's prepared loaders (what ``Trainer`` and ``accelerator.prepare`` return: the
    ``BatchSamplerShard`` or ``IterableDatasetShard`` inside) and torch loaders with a ``DistributedSampler``;
    changed in place and returned. Accelerate's shuffling is seeded the same on every rank, so the ranks of a
    group draw the same batches in the same order."""
    index, replicas = _data_rank(model_or_mesh, mesh_dim, "shard_batches_for_group")
    from torch.utils.data.distributed import DistributedSampler

    if type(dataloader).__name__ == "DataLoaderDispatcher":
        raise ValueError("shard_batches_for_group: accelerate's dispatch_batches loader (rank 0 reads and scatters "
                         "slices) cannot give a group the same batch; use dispatch_batches=False "
                         "(TrainingArguments(accelerator_config={'dispatch_batches': False}))")
    done = False
    for obj in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if obj is not None and hasattr(obj, "num_processes") and hasattr(obj, "process_index"):
            if getattr(obj, "split_batches", False):
                raise ValueError("shard_batches_for_group: split_batches=True splits every batch over all ranks; "
                                 "use split_batches=False with shard_sequence")
            obj.num_processes, obj.process_index = replicas, index
            done = True
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.num_replicas, sampler.rank = replicas, index
        n = len(sampler.dataset)
        sampler.num_samples = (n // replicas if sampler.drop_last and n % replicas
                               else -(-n // replicas))
        sampler.total_size = sampler.num_samples * replicas
        done = True
    if not done:
        raise ValueError(f"shard_batches_for_group: {type(dataloader).__name__} does not shard by rank through "
                         "accelerate (BatchSamplerShard / IterableDatasetShard) or a DistributedSampler; build it "
                         "with sequence_parallel_sampler(dataset, model) instead")
    return dataloader


def sequence_parallel_trainer(trainer):
    """Make a Hugging Face ``Trainer`` train a model prepared by ``shard_sequence``; returns the trainer.

    * its train and eval loaders give every rank of a sequence-parallel group the same batches
      (:func:`shard_batches_for_group`: accelerate otherwise gives every rank different ones);
    * the pass stops averaging gradients itself: the Trainer's DDP (or FSDP) averages them over all ranks.

    The Trainer's own loss accounting then holds: with ``average_tokens_across_devices`` it counts every
    group's tokens once per rank (``size`` times) and scales the loss by the number of processes, and the
    pass's loss carries gradient ``size`` towards each rank's share, so the averaged gradient is the
    gradient of the whole global batch's loss (``tests/test_shard_sequence.py`` compares it with one process)."""
    model = trainer.model
    state = state_of(getattr(model, "module", model))
    if state is None:
        raise ValueError("sequence_parallel_trainer: the Trainer's model was not prepared by shard_sequence; "
                         "compile it with effpass.compile(model, passes=[ShardSequence(size=N), ...]) before "
                         "building the Trainer")
    args = trainer.args
    if getattr(getattr(trainer.accelerator, "parallelism_config", None), "sp_enabled", False) or \
            getattr(getattr(trainer.accelerator, "parallelism_config", None), "cp_enabled", False):
        raise ValueError("sequence_parallel_trainer: TrainingArguments(parallelism_config=...) already splits "
                         "sequences (sp_size/cp_size); use either it or shard_sequence, not both")
    if getattr(args, "world_size", 1) != dist.get_world_size():
        raise ValueError(f"sequence_parallel_trainer: the Trainer sees {args.world_size} processes but "
                         f"torch.distributed has {dist.get_world_size()}; launch with torchrun")
    state.reduce_gradients = False
    train_loader, eval_loader = trainer.get_train_dataloader, trainer.get_eval_dataloader

    def get_train_dataloader():
        return shard_batches_for_group(train_loader(), state.mesh, mesh_dim=state.mesh_dim)

    def get_eval_dataloader(eval_dataset=None):
        return shard_batches_for_group(eval_loader(eval_dataset), state.mesh, mesh_dim=state.mesh_dim)

    trainer.get_train_dataloader = get_train_dataloader
    trainer.get_eval_dataloader = get_eval_dataloader
    return trainer
