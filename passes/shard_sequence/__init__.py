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

Modules: this one (the pass: checks, mesh, installing the hooks and the attention function), ``_sp_hooks``
(per-rank state, root/block/gradient hooks), ``_sp_attention`` (all-to-alls, the attention and mask functions),
``_sp_ring`` (the ring fallback, feature-tested) and ``_sp_data`` (samplers, loaders, the ``Trainer`` adapter).
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
from effpass.facts import ShardsParameters
from effpass.graph import transformer_blocks

from .attention import kv_replication, sp_attention, sp_sdpa_mask
from .data import sequence_parallel_sampler, sequence_parallel_trainer, shard_batches_for_group
from .hooks import STATES, State, block_pre_hook, grad_hook, root_post_hook, root_pre_hook, state_of
from .ring import enable_ring, ring_note, ring_support

__all__ = ["ShardSequence", "build_sequence_mesh", "ring_support", "sequence_parallel_sampler",
           "sequence_parallel_trainer", "shard_batches_for_group", "state_of"]

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
        # NOTE: GPT-NeoX (Pythia) names it head_size; both call the interface with q/k/v as [B, heads, S, D]
        if eager is not None and (hasattr(mod, "head_dim") or hasattr(mod, "head_size")) and "Attention" in type(mod).__name__:
            out.append((name, mod, eager))
    return out


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
            reduce = ctx.fact(ShardsParameters) is None
        state = State(mesh, self.mesh_dim, reduce)
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
                    f"{why_not_ring or ring_note(mesh.device_type, impl, cfg)}")
            if self.uneven_heads == "ring":
                ring, kv_rep = True, 1
                enable_ring()
            else:
                pad = -heads % n
                kv_rep = heads // kv_heads          # key/value expanded to one per query head, then padded too
        else:
            kv_rep = kv_replication(heads, kv_heads, n)

        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = impl.removeprefix("effpass_sp_")
        name = f"effpass_sp_{base}"
        AttentionInterface.register(name, sp_attention)
        if base == "sdpa":
            # NOTE(memory): under Dynamo Hugging Face never skips the causal mask (it cannot rule out packing
            # there); a whole S x S mask per rank would not shrink with the group: skipped for plain calls
            AttentionMaskInterface.register(name, sp_sdpa_mask)
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
        model.register_forward_pre_hook(root_pre_hook(state), with_kwargs=True)
        model.register_forward_hook(root_post_hook(state))
        for _, block in blocks:
            block.register_forward_pre_hook(block_pre_hook(state), with_kwargs=True)
        grad_hooks = 0
        if reduce and dist.get_world_size() > 1:
            world_group = dist.group.WORLD if mesh.ndim == 1 or mesh.size() == dist.get_world_size() else None
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(grad_hook(world_group, state))
                    grad_hooks += 1
        model._effpass_sp = state
        for c in {id(c): c for c in (model.config, cfg)}.values():
            STATES[id(c)] = state
        return effpass.PassResult(changed=True, stats={
            "size": n, "rank": state.rank, "data_parallel": mesh.size() // n, "attention_modules": len(attns),
            "blocks": len(blocks), "kv_replication": kv_rep, "padded_heads": pad, "attn_implementation": name,
            "attention": "ring" if ring else "ulysses",
            "gradient_hooks": grad_hooks})
