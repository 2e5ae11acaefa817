"""TRL's ``ORPOTrainer`` without logits: its trainer-side forward routed to log-probs that effpass fuses.

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
that token. :func:`route` replaces ``ORPOTrainer.concatenated_forward`` by :func:`concatenated_forward`, which, for a
model compiled by effpass whose pipeline fuses the loss (``fuse_cross_entropy``), calls the model with
``effpass_token_logprobs=input_ids``: the model's ``forward`` (wrapped once per instance, :func:`_install`) then
returns, instead of the logits, ``log_softmax(logits[:, :-1]).gather(next ids)`` and ``logits[:, :-1].mean(-1)``
(detached), computed in the compiled graph, where ``fuse_cross_entropy`` turns them into its chunked log-prob and
row-wise ops (the logits never exist, whatever the head: tied, soft-capped, LoRA, quantized). The routed method
rebuilds the same five results with the trainer's masks:

* ``chosen_nll_loss = -sum(logp * attended) / sum(attended)`` over the chosen rows (what ``CrossEntropyLoss``
  with ``ignore_index=-100`` computes);
* ``all_logps = sum(logp * answer) / sum(answer)`` per row; this needs the labels to equal the input ids on
  the answer tokens (ORPO's tokenizer builds them so), checked on every batch;
* the two metrics as 0-d tensors: the mean over rows and positions of the per-token mean logit (every token
  has ``V`` logits, so the mean of the means is the mean).

In fp32 the results equal TRL's method up to summation order (tested within 1e-5); in bf16 the log-probs are
taken in fp32 where TRL's method rounds the logits to bf16 first. Anything else runs TRL's own method unchanged,
and every batch that does says why in the model's report (``module.notes["trl_orpo"]``): an encoder-decoder
model, a model not compiled by effpass or compiled without ``fuse_cross_entropy`` (the opt-out: the logits are
kept), or labels that differ from the input ids on an answer token. Whether the graph's sites were fused is the
pass's own statistics (``logprob_sites``, ``rowwise_sites``), as for any loss.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

from . import _trl_common as _common
from ._trl_common import backend_of, fused_backend, unwrap

__all__ = ["route", "routed", "concatenated_forward", "note"]

_MODULE = "trl.experimental.orpo.orpo_trainer"
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


def _why_not(trainer, model) -> tuple[str | None, Any]:
    """Why this call cannot be routed (None when it can), and the model to patch."""
    if getattr(trainer, "is_encoder_decoder", False):
        return "an encoder-decoder model (its labels are the decoder's; only causal LMs are routed)", None
    inner = unwrap(trainer, model)
    why, _ = fused_backend(inner, model)
    return why, (inner if why is None else None)


def _install(model) -> None:
    """Wrap ``model.forward`` (this instance) so that ``effpass_token_logprobs=ids`` returns ``(log-probs of the
    next ids, mean logit per position (detached), aux_loss or None)`` instead of the output; without it the
    forward is the original one."""
    if getattr(model, "_effpass_token_logprobs", False):
        return
    original = model.forward
    # NOTE(self): the original is called as a function of this method's ``self``, so Dynamo reaches the modules as
    # ``self.<path>`` (a bound method held in a closure would give them other paths, and the pass could not find
    # the head's module, e.g. a LoRA head's adapter)
    func = getattr(original, "__func__", None) if getattr(original, "__self__", None) is model else None

    @functools.wraps(type(model).forward)
    def forward(self, *args, effpass_token_logprobs=None, **kwargs):
        out = func(self, *args, **kwargs) if func is not None else original(*args, **kwargs)
        if effpass_token_logprobs is None:
            return out
        logits = out.logits[:, :-1, :].float()
        nxt = effpass_token_logprobs[:, 1:].unsqueeze(-1)
        logp = logits.log_softmax(-1).gather(-1, nxt).squeeze(-1)
        return logp, logits.detach().mean(-1), getattr(out, "aux_loss", None)

    model.forward = types.MethodType(forward, model)
    model._effpass_token_logprobs = True


def note(trainer, model, key: str, why: str | None = None) -> None:
    """Count a routed (``routed_calls``) or unrouted (``unrouted_calls``, with its reason) call in the report of
    the effpass-compiled model among ``model`` and what it wraps (nothing for a model effpass did not compile)."""
    _common.note(backend_of(model, unwrap(trainer, model)), "trl_orpo", key, why,
                 counters=("routed_calls", "unrouted_calls"))


def concatenated_forward(self, model, batch):
    """``ORPOTrainer.concatenated_forward`` with the same results, without the logits (module doc)."""
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
        note(self, model, "unrouted_calls", why)
        return _STATE["original"](self, model, batch)

    _install(inner)
    kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
    logp, mean_logits, aux_loss = model(ids, attention_mask=attn, use_cache=False, effpass_token_logprobs=ids, **kwargs)
    len_chosen = batch["chosen_labels"].shape[0]
    attended = (attn[:, 1:] == 1).to(logp.dtype)
    chosen_nll_loss = -(logp[:len_chosen] * attended[:len_chosen]).sum() / attended[:len_chosen].sum()
    ans = answer.to(logp.dtype)
    all_logps = (logp * ans).sum(-1) / ans.sum(-1)
    with torch.no_grad():
        chosen_logits = mean_logits[:len_chosen].mean()
        rejected_logits = mean_logits[len_chosen:].mean()
    note(self, model, "routed_calls")
    res = (all_logps[:len_chosen], all_logps[len_chosen:], chosen_logits, rejected_logits, chosen_nll_loss)
    return res + (aux_loss,) if self.aux_loss_enabled else res
