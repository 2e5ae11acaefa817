"""TRL's fused LM head (``add_fused_lm_head``) on effpass's fused ops: ``DPOTrainer``, ``KTOTrainer``,
``GRPOTrainer``, ``RLOOTrainer`` (and every other TRL trainer that scores tokens through it) without TRL's kernel.

TRL 1.16's preference and RL trainers never take ``outputs.logits``: they patch the policy (and a separate
reference model) with ``trl.trainer.utils.add_fused_lm_head`` and call ``model(..., labels=labels,
fused_lm_head=True)``, whose forward runs the backbone and hands the hidden states and ``lm_head.weight`` to TRL's
chunked kernel (``ChunkedLogProbFunction``: tiles of 4,096 tokens x 32,768 vocabulary entries, sized for a GPU,
whatever the machine). The trainers' losses and metrics are then functions of the kernel's per-token outputs:
``log_probs`` (of the next-token label), ``entropy``, ``mean_logits``, ``is_top1`` and ``log_sum_sq_probs`` of the
temperature-scaled (soft-capped, scaled) next-token distribution, the mean negative log-likelihood ``loss`` and
the MoE load-balancing ``aux_loss``. The reference model is the same call under ``torch.no_grad`` (on a separate
model, or on the policy with its PEFT adapter disabled).

For a model compiled by effpass whose pipeline fuses the loss (``fuse_cross_entropy``), :func:`install` replaces
TRL's fused forward (on that instance) with :func:`_routed_forward`'s, which computes the same outputs as plain
graph code on the head's logits (the head called as a module, so a LoRA or quantized head counts, where TRL's
kernel reads ``lm_head.weight`` alone): ``log_softmax(z).gather(labels)``, ``-(p * log p).sum(-1)``,
``logsumexp(2 log p)``, ``z.mean(-1)``, ``z.gather(labels) >= z.amax(-1)``. In the compiled graph
``fuse_cross_entropy`` turns these into its chunked log-prob and row-wise ops, so the logits never exist; the
policy's step and the reference's (compiled by effpass too) hold no vocabulary-sized tensor. The trainers' own
methods are unchanged: they receive TRL's ``FusedCausalLMOutput`` with the same fields.

Installed (``install``) when TRL's head is added to an effpass-compiled model (:func:`route` wraps
``add_fused_lm_head``), when ``effpass.compile`` finds TRL's head already on the model, or at the model's first call.
``SFTTrainer``'s head is left to TRL's kernel (run as effpass's custom op, ``_trl_kernels``), as before.
Left to TRL's kernel, with the reason in the model's report (``notes["trl_fused_head"]``): a pipeline without
``fuse_cross_entropy``, a model without an output head, a TRL head this module does not know (its closure is
read by name, feature-tested), an output it does not know. Models effpass did not compile: no note.

Differences from TRL's kernel: summation order only (fp32: within 1e-5, tested), except ``is_top1`` on an exact
tie of the label's logit with an *earlier* token's maximum (TRL: not top-1, as ``argmax`` returns the first; here:
top-1). In bf16 (autocast) both project in bf16 and take the softmax in fp32.
"""
from __future__ import annotations

import functools
import sys
import types

import torch

from . import _trl_common as _common

__all__ = ["route", "routed", "install", "install_in", "check_reference", "is_trl_fused_forward", "OUTPUTS"]

#: the per-token outputs TRL's fused head can be asked for (``add_fused_lm_head(outputs=...)``)
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: the code name of TRL's fused forward (``functools.wraps`` gives it the model's ``forward``'s qualified name)
_CODE_NAME = "_fused_forward"
#: the names of TRL's fused forward's closure this module reads
_CELLS = ("original_forward", "text_config", "temperature", "cast_lm_head_to_fp32", "outputs",
          "final_logit_softcapping", "logit_scale", "backbone_attr")
_KEY = "trl_fused_head"
#: the TRL modules whose fused head is left to TRL's kernel (run as effpass's custom op, ``_trl_kernels``):
#: SFTTrainer's (no reference model; its kernel path is the one tested bit for bit, padding-free included)
_LEFT_TO_TRL = frozenset({"trl.trainer.sft_trainer"})
_COUNTERS = ("routed_models", "unrouted_models")
_STATE: dict = {"original": None}


def routed() -> bool:
    return _STATE["original"] is not None


def route() -> bool:
    """Wrap ``trl.trainer.utils.add_fused_lm_head`` (once, and the name in the TRL modules that imported it) so that
    the head it adds to an effpass-compiled model is routed; returns whether it is. Nothing is imported here."""
    utils = sys.modules.get("trl.trainer.utils")
    fn = getattr(utils, "add_fused_lm_head", None)
    if fn is None or not callable(fn):
        return False
    if _STATE["original"] is None:
        if getattr(fn, "_effpass_routed", False):
            return True
        _STATE["original"] = fn

        @functools.wraps(fn)
        def add_fused_lm_head(model, *args, **kwargs):
            out = fn(model, *args, **kwargs)
            if sys._getframe(1).f_globals.get("__name__") in _LEFT_TO_TRL:
                model._effpass_fused_head_seen = model.__dict__.get("forward")  # never routed later either
            else:
                install(model)
            return out

        add_fused_lm_head._effpass_routed = True
        _STATE["wrapper"] = add_fused_lm_head
    original, wrapper = _STATE["original"], _STATE["wrapper"]
    for name, mod in list(sys.modules.items()):
        if (name == "trl" or name.startswith("trl.")) and getattr(mod, "add_fused_lm_head", None) is original:
            mod.add_fused_lm_head = wrapper
    return True


def is_trl_fused_forward(model) -> bool:
    """Whether ``model.forward`` is TRL's fused forward (this instance's, not yet routed)."""
    fwd = getattr(model, "__dict__", {}).get("forward")
    code = getattr(getattr(fwd, "__func__", None), "__code__", None)
    return (getattr(code, "co_name", None) == _CODE_NAME and "original_forward" in code.co_freevars
            and getattr(fwd, "__self__", None) is model)


def _cells(fwd) -> dict:
    func = fwd.__func__
    names, cells = func.__code__.co_freevars, func.__closure__ or ()
    out = {}
    for n, c in zip(names, cells):
        try:
            out[n] = c.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def install(model) -> bool:
    """Route the TRL fused head on ``model`` (see the module doc); returns whether it is routed. A model effpass did
    not compile (nor a model holding it) keeps TRL's head with no note."""
    if getattr(model, "_effpass_fused_head", False):
        return True
    if not is_trl_fused_forward(model):
        return False
    why, be = _common.fused_backend(model, containing=True)
    if be is None:
        return False
    fwd = model.__dict__["forward"]
    if getattr(model, "_effpass_fused_head_seen", None) is fwd:
        return False  # this head was left to TRL (and counted) already
    model._effpass_fused_head_seen = fwd
    cells = _cells(fwd)
    missing = [c for c in _CELLS if c not in cells]
    if why is None and missing:
        why = f"TRL's fused LM head is not the one effpass knows (no {', '.join(missing)} in its closure)"
    if why is None and not set(cells["outputs"]) <= set(OUTPUTS):
        why = f"TRL's fused LM head was asked for outputs effpass does not know: {sorted(set(cells['outputs']) - set(OUTPUTS))}"
    if why is None and model.get_output_embeddings() is None:
        why = "the model has no output embeddings (get_output_embeddings() is None)"
    if why is not None:
        _common.note(be, _KEY, "unrouted_models", why, _COUNTERS)
        return False
    model.forward = types.MethodType(_routed_forward(model, fwd, cells), model)
    model._effpass_fused_head = True
    _common.note(be, _KEY, "routed_models", None, _COUNTERS)
    notes = be.report.module.notes[_KEY]
    notes.setdefault("outputs", [])
    for o in cells["outputs"]:
        if o not in notes["outputs"]:
            notes["outputs"].append(o)
    return True


def install_in(trainer, model) -> None:
    """At a model's first call inside ``trainer``: route its TRL head if that was added before :func:`route` could
    wrap ``add_fused_lm_head`` (TRL's trainer module imported after ``effpass.compile``), unless the trainer's
    heads are left to TRL; then check the reference (:func:`check_reference`)."""
    model = _common.unwrap(trainer, model)  # TRL patches the model inside accelerate's and PEFT's wrappers
    if type(trainer).__module__ in _LEFT_TO_TRL or any(c.__module__ in _LEFT_TO_TRL for c in type(trainer).__mro__):
        model._effpass_fused_head_seen = getattr(model, "__dict__", {}).get("forward")
        return
    install(model)
    check_reference(trainer, model)


def check_reference(trainer, model) -> None:
    """At the policy's first call inside a trainer: a routed policy whose trainer scores a separate reference model
    that effpass did not compile says so in its report (TRL's kernel computes the reference's log-probs then)."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None or not getattr(model, "_effpass_fused_head", False):
        return
    inner = _common.unwrap(trainer, ref)
    if _common.backend_of(ref, inner) is None and is_trl_fused_forward(inner):
        _common.note(_common.backend_of(model, containing=True), _KEY, "unrouted_models",
                     "the trainer's reference model is not compiled by effpass: TRL's kernel computes its log-probs "
                     "(compile it with effpass.compile(ref_model) before building the trainer)", _COUNTERS)


def _load_balancing(model, text_config):
    """TRL's MoE load-balancing loss (Mixtral's, as TRL's fused head computes it) and its expert counts."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = getattr(text_config, "num_experts", None)
    if experts is None or text_config.model_type == "gpt_oss":  # TRL reads gpt_oss's from the model (its #5754)
        experts = getattr(model, "num_experts", experts)
    per_tok = getattr(text_config, "num_experts_per_tok", None)
    return load_balancing_loss_func, experts, per_tok


def _routed_forward(model, trl_forward, c: dict):
    text_config, outputs = c["text_config"], tuple(c["outputs"])
    temperature, softcap, scale = float(c["temperature"]), c["final_logit_softcapping"], float(c["logit_scale"])
    backbone_attr, cast_fp32 = c["backbone_attr"], bool(c["cast_lm_head_to_fp32"])
    result_cls = sys.modules["trl.trainer.utils"].FusedCausalLMOutput
    router = bool(getattr(text_config, "output_router_logits", False))
    # resolved here, not in the traced forward: Dynamo would trace the import and the config lookups
    balance = _load_balancing(model, text_config) if hasattr(text_config, "output_router_logits") else None
    want = set(outputs)

    @functools.wraps(trl_forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)
        kwargs["use_cache"] = False
        if router:
            kwargs.setdefault("output_router_logits", True)
        body = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = body.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = body.last_hidden_state, shift_labels
        head = self.get_output_embeddings()
        mask = labels != -100
        if cast_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                logits = head(hidden.float())
        else:
            logits = head(hidden)
        # TRL's transform of the logits (its kernel's ``_torch_transform``): scale, soft-cap, temperature, in fp32
        z = logits.float()
        if scale != 1.0:
            z = z * scale
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        if temperature != 1.0:
            z = z / temperature
        idx = labels.clamp(min=0).unsqueeze(-1)
        ls = z.log_softmax(-1)
        zero = ~mask
        log_probs = ls.gather(-1, idx).squeeze(-1).masked_fill(zero, 0.0)
        entropy = log_sum_sq = mean_logits = is_top1 = None
        if "entropy" in want:
            entropy = (-(ls.exp() * ls).sum(-1)).masked_fill(zero, 0.0)
        if "log_sum_sq_probs" in want:
            log_sum_sq = torch.logsumexp(ls.detach() * 2, -1).masked_fill(zero, 0.0)
        if "mean_logits" in want:
            mean_logits = z.detach().mean(-1).masked_fill(zero, 0.0)
        if "is_top1" in want:
            zd = z.detach()
            is_top1 = (zd.gather(-1, idx).squeeze(-1) >= zd.amax(-1)) & mask
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            lb, experts, per_tok = balance
            aux_loss = lb(body.router_logits, experts, per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return result_cls(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq,
                          mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=aux_loss)

    return forward
