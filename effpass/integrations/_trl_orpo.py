"""TRL's ``ORPOTrainer`` without logits: its forward routed through TRL's own fused LM head.

``ORPOTrainer.concatenated_forward`` (``trl.experimental.orpo``) is trainer code, not the model's forward: it
calls ``model(...)``, takes ``outputs.logits`` (the full ``(2B, S, V)`` logits, a compiled graph's output, so
materialised whatever the graph passes do), then computes from them

* ``chosen_nll_loss``: ``nn.CrossEntropyLoss`` over the chosen half, every attended token (labels are the
  input ids where ``attention_mask == 1``, shifted);
* ``all_logps``: the average log-probability of the answer tokens per row (``concatenated_labels``, the
  prompt masked to ``-100``, shifted), through ``selective_log_softmax``;
* ``chosen_logits`` / ``rejected_logits``: the logits themselves, which the trainer only reads as two metrics
  (``.detach().mean()``).

Each of these is a per-token function of the log-probability of the next input token or of the mean logit at
that token. TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, the kernel its DPO, KTO and GRPO
trainers use, which effpass runs as an opaque custom op) computes exactly these per token in tiles, without the
logits. :func:`route` replaces ``ORPOTrainer.concatenated_forward`` by :func:`concatenated_forward`, which, for a
model compiled by effpass whose pipeline fuses the loss (``fuse_cross_entropy``), asks the model for them
(``labels=input_ids``: every position scored, as the unfused logits are) and rebuilds the same five results:

* ``chosen_nll_loss = -sum(logp * attended) / sum(attended)`` over the chosen rows (what ``CrossEntropyLoss``
  with ``ignore_index=-100`` computes);
* ``all_logps = sum(logp * answer) / sum(answer)`` per row; this needs the labels to equal the input ids on
  the answer tokens (ORPO's tokenizer builds them so), checked on every batch;
* the two metrics as 0-d tensors: the mean over rows and positions of the per-token mean logit (every token
  has ``V`` logits, so the mean of the means is the mean).

In fp32 the results equal the unfused ones up to summation order (tested within 1e-5); in bf16 the kernel works
in fp32 where the unfused loss rounds the logits to bf16. Anything else runs TRL's own method unchanged, and
every batch that does says why in the model's report (``module.notes["trl_orpo"]``): an encoder-decoder model,
a model not compiled by effpass or compiled without ``fuse_cross_entropy`` (the opt-out), labels that differ
from the input ids on an answer token, a LoRA adapter on the output head, or TRL without ``add_fused_lm_head``.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["route", "routed", "concatenated_forward", "note"]

_MODULE = "trl.experimental.orpo.orpo_trainer"
_HEAD_OUTPUTS = ("log_probs", "mean_logits")
_STATE: dict[str, Any] = {"original": None, "cls": None}


def routed() -> bool:
    return _STATE["cls"] is not None


def route() -> bool:
    """Replace ``ORPOTrainer.concatenated_forward`` (once) when TRL's ORPO module is imported; returns whether
    it is routed. Nothing is imported here: a script that imports ``ORPOTrainer`` has loaded the module."""
    if _STATE["cls"] is not None:
        return True
    mod = sys.modules.get(_MODULE)
    cls = getattr(mod, "ORPOTrainer", None) if mod is not None else None
    original = getattr(cls, "concatenated_forward", None) if cls is not None else None
    if original is None or not callable(original):
        return False
    _STATE["original"], _STATE["cls"] = original, cls
    cls.concatenated_forward = concatenated_forward
    return True


def _backend(model):
    """The effpass backend that compiled ``model`` in place (None for a model effpass did not compile)."""
    from ..backend import MODEL_BACKENDS, _CompiledCall

    if not isinstance(getattr(model, "_compiled_call_impl", None), _CompiledCall):
        return None
    return MODEL_BACKENDS.get(model)


def _unwrap(trainer, model):
    """The Hugging Face model under accelerate's and PEFT's wrappers (where TRL patches its fused head)."""
    acc = getattr(trainer, "accelerator", None)
    inner = acc.unwrap_model(model) if acc is not None else model
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(inner, "peft_config") else inner


def _why_not(trainer, model) -> tuple[str | None, Any]:
    """Why this call cannot be routed (None when it can), and the model to patch."""
    if getattr(trainer, "is_encoder_decoder", False):
        return "encoder-decoder model (the fused head is for causal LMs)", None
    inner = _unwrap(trainer, model)
    be = next((b for b in map(_backend, (inner, model)) if b is not None), None)
    if be is None:
        return "the model is not compiled by effpass", None
    if "fuse_cross_entropy" not in [p.name for p in be.manager.active] + [p.name for p in be.extra_passes]:
        return "the model's effpass pipeline has no fuse_cross_entropy (the logits are kept on request)", None
    from ._trl_kernels import head_has_adapter

    if head_has_adapter(inner):
        return "a LoRA adapter on the output head (TRL's fused head reads lm_head.weight: it would not be trained)", None
    utils = sys.modules.get("trl.trainer.utils")
    if getattr(utils, "add_fused_lm_head", None) is None:
        return "this TRL has no trl.trainer.utils.add_fused_lm_head", None
    return None, inner


def note(trainer, model, key: str, why: str | None = None) -> None:
    """Count a routed (``fused_calls``) or unrouted (``unfused_calls``, with its reason) call in the report of
    the effpass-compiled model among ``model`` and what it wraps (nothing for a model effpass did not compile)."""
    for m in (model, _unwrap(trainer, model)):
        be = _backend(m)
        if be is not None:
            notes = be.report.module.notes.setdefault("trl_orpo", {"fused_calls": 0, "unfused_calls": 0,
                                                                  "reasons": []})
            notes[key] += 1
            if why and why not in notes["reasons"]:
                notes["reasons"].append(why)
            return


def concatenated_forward(self, model, batch):
    """``ORPOTrainer.concatenated_forward`` with the same results, from TRL's fused LM head (module doc)."""
    why, inner = _why_not(self, model)
    if why is None:
        batch_in = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.padding_value,
                                            device=self.accelerator.device)
        ids = batch_in["concatenated_input_ids"]
        attn = batch_in["concatenated_attention_mask"]
        labels = batch_in["concatenated_labels"]
        answer = labels[:, 1:] != -100
        if labels.shape != ids.shape or not torch.equal(labels[:, 1:][answer], ids[:, 1:][answer]):
            why = "the labels differ from the input ids on an answer token (one projection cannot score both)"
    if why is not None:
        note(self, model, "unfused_calls", why)
        return _STATE["original"](self, model, batch)

    if not getattr(inner, "_effpass_orpo_head", False):
        # TRL's own head (what its DPO/KTO/GRPO trainers add), asked for the two per-token fields ORPO needs
        sys.modules["trl.trainer.utils"].add_fused_lm_head(inner, outputs=_HEAD_OUTPUTS)
        inner._effpass_orpo_head = True
    kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
    # labels = the input ids everywhere: every position is scored, as the unfused logits are (the masks below
    # choose which positions count for each result)
    out = model(ids, attention_mask=attn, use_cache=False, labels=ids, fused_lm_head=True, **kwargs)
    logp, mean_logits = out.log_probs, out.mean_logits
    len_chosen = batch["chosen_labels"].shape[0]
    attended = (attn[:, 1:] == 1).to(logp.dtype)
    chosen_nll_loss = -(logp[:len_chosen] * attended[:len_chosen]).sum() / attended[:len_chosen].sum()
    ans = answer.to(logp.dtype)
    all_logps = (logp * ans).sum(-1) / ans.sum(-1)
    with torch.no_grad():
        chosen_logits = mean_logits[:len_chosen].mean()
        rejected_logits = mean_logits[len_chosen:].mean()
    note(self, model, "fused_calls")
    res = (all_logps[:len_chosen], all_logps[len_chosen:], chosen_logits, rejected_logits, chosen_nll_loss)
    return res + (out.aux_loss,) if self.aux_loss_enabled else res
