"""``shard_sequence``'s per-rank state and module hooks: the root's pre-hook (length check, labels shifted over the
whole sequence, this rank's share of them, the batch's token count) and post-hook (the group's loss), the
blocks' pre-hook (this rank's tokens of every per-token input; masks stay whole) and the gradient hook (the
mean over the mesh without ``wrap_fsdp``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["IGNORE_INDEX", "PLAIN_CALL_KWARGS", "STATES", "State", "block_pre_hook", "grad_hook", "root_post_hook",
           "root_pre_hook", "state_of"]

IGNORE_INDEX = -100


class State:
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


def state_of(model: nn.Module) -> State | None:
    """The sequence-parallel state :class:`ShardSequence` attached to ``model`` (None without the pass)."""
    return getattr(model, "_effpass_sp", None)


#: state of each prepared model, by id of its config (the mask interface gets the config, not the module)
STATES: dict[int, State] = {}
#: call arguments that leave the model's causal mask plain causal (any other argument, e.g. token_type_ids or
#: mm_token_type_ids, may add mask functions: the mask is then built as Hugging Face builds it)
PLAIN_CALL_KWARGS = frozenset({"input_ids", "inputs_embeds", "labels", "shift_labels", "num_items_in_batch",
                               "use_cache", "return_dict", "output_attentions", "output_hidden_states",
                               "logits_to_keep"})


def root_pre_hook(state: State):
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
        # padding, no packing, so its causal mask is plain causal (see _sp_attention.sp_sdpa_mask)
        state.plain_causal = len(args) <= 1 and all(k in PLAIN_CALL_KWARGS for k, v in kwargs.items()
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


def root_post_hook(state: State):
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


def _slice_tokens(value, state: State):
    if isinstance(value, torch.Tensor):
        if value.dim() in (2, 3) and value.shape[1] == state.full_len:
            return state.local(value, 1)
        return value
    if isinstance(value, tuple):
        return tuple(_slice_tokens(v, state) for v in value)
    return value


def block_pre_hook(state: State):
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


def grad_hook(group, state: State):
    def hook(param):
        if param.grad is not None and state.reduce_gradients:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG if _has_avg() else dist.ReduceOp.SUM, group=group)
            if not _has_avg():
                param.grad.div_(dist.get_world_size(group))
    return hook


def _has_avg() -> bool:
    # gloo has no ReduceOp.AVG (NCCL does)
    return dist.get_backend() == "nccl"
