"""The checks of the family x pass matrix, shared by the hand-written family suite (tests/models/test_families.py,
tests/_families.py) and the sweep over every causal-LM type (tests/models/test_every_causal_lm.py,
tests/_auto_families.py). Each runs one column on one :class:`effpass.testing.ModelCase` and asserts its two oracles
(numerical and structural) that hold for every family; the callers add what they know of their own families
(exact site counts, refusals).

* ``autocast_bit_identical``: bf16 (or fp16) ``apply_autocast`` (module capture) gives logits, loss and every gradient
  bit-identical to eager ``torch.autocast`` on the unprepared model; matmuls in the low dtype, no fp32 islands.
* ``fuse_attention_equals_unfused``: forward and gradients equal the unfused eager model (1e-5); every site the pass
  left alone carries its reason, and so does every site rewritten where SDPA has no fused kernel (``unfused``).
* ``fuse_attention_with_autocast``: ``fuse_attention`` + ``apply_autocast`` (bf16) against eager ``torch.autocast`` on
  the same weights with SDPA attention: bit-identical, or (where the reference cannot call SDPA the same way) within
  a bound against the fp32 model; every site fused or left with its reason, captured under autocast, fp32 matmuls
  only where eager autocast has them.
* ``quantize_int8_equals_prepared``: the int8 forward equals the prepared eager model (1e-5); every ``nn.Linear`` is
  quantized or listed with its reason, and every MoE expert tensor too.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import effpass
from effpass.passes import ApplyAutocast, FuseAttention, QuantizeLinear
from effpass.testing import ModelCase, compile_and_compare, grads_of, loss_of

BF16 = torch.bfloat16


def autocast_bit_identical(case: ModelCase, dtype=BF16, seed: int = 0, **options) -> dict:
    """Compile ``case.model`` with ``ApplyAutocast(dtype, **options)`` and check one forward and backward against the
    unprepared model under eager ``torch.autocast``: logits, loss and every gradient bit-identical (numerical); module
    capture, at least one region, no fp32 island, matmuls in ``dtype`` (structural). Returns the pass's statistics."""
    reference = copy.deepcopy(case.model)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 without scale_loss warns (tested in test_apply_autocast.py)
        compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=dtype, **options)], lowering="eager")
    torch.manual_seed(seed)
    out = compiled(**case.inputs)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype):
        expected = reference(**case.inputs)
    loss_of(out).backward()
    loss_of(expected).backward()
    assert torch.equal(out.logits, expected.logits) and out.logits.dtype == expected.logits.dtype, \
        float((out.logits.float() - expected.logits.float()).abs().max())
    assert out.loss is None or torch.equal(out.loss, expected.loss), (float(out.loss), float(expected.loss))
    got, want = grads_of(case.model), grads_of(reference)
    assert got.keys() == want.keys() and got, sorted(set(got) ^ set(want))[:5]
    bad = {k: float((got[k].float() - want[k].float()).abs().max()) for k in want if not torch.equal(got[k], want[k])}
    assert not bad, f"gradients differ from eager torch.autocast: {dict(list(bad.items())[:5])}"
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["capture"] == "module" and st["regions"] >= 1 and st["fp32_islands"] == 0, st
    assert st["matmuls_by_dtype_after"].get(str(dtype).removeprefix("torch."), 0) > 0, st["matmuls_by_dtype_after"]
    return st


@dataclasses.dataclass
class FuseResult:
    stats: dict
    #: the sites the pass left alone: site -> reason
    skipped: dict
    #: the sites rewritten to SDPA where SDPA runs its unfused math op: site -> reason
    unfused: dict


def fuse_attention_equals_unfused(case: ModelCase, atol: float = 1e-5, rtol: float = 1e-5) -> FuseResult:
    """``FuseAttention()`` against the unfused eager model: forward and gradients within ``atol``/``rtol``
    (numerical, in ``compile_and_compare``); every site left alone has its reason, and so has every site rewritten to
    SDPA where SDPA runs its unfused math op (structural). The callers check the counts they know."""
    r = compile_and_compare(case, [FuseAttention()], atol=atol, rtol=rtol, step=False)
    st = r.report.stats("fuse_attention")
    skipped = [s for rec in r.report.records("fuse_attention") for s in rec.skipped]
    assert all(s.get("reason") for s in skipped), skipped
    unfused = {s["site"]: s["reason"] for s in skipped if s.get("unfused")}
    assert st["unfused"] == len(unfused), (st, skipped)   # a rewritten site without a fused kernel is listed, with why
    return FuseResult(st, {s["site"]: s["reason"] for s in skipped if not s.get("unfused")}, unfused)


@dataclasses.dataclass
class FuseAutocastResult:
    #: True: logits, loss and every gradient bit-identical to eager autocast with SDPA attention
    equal: bool
    #: max |error| against the fp32 model, of the compiled model and of eager autocast: logits, gradients
    errors: dict
    fuse: dict
    autocast: dict
    skipped: dict


class _MatmulDtypes(TorchFunctionMode):
    """Counts the matmul-like calls run under it by output dtype, at the level ``apply_autocast``'s statistics count
    them (the captured graph's torch functions: ``linear``, ``matmul``, SDPA as one call, transformers'
    ``grouped_mm`` fallback, which autocast does not cast), not the aten ops inside them (CPU's math SDPA upcasts
    bf16 to fp32 internally)."""

    _WORDS = ("linear", "matmul", "mm", "conv", "einsum", "scaled_dot_product")

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and any(w in getattr(func, "__name__", str(func)).lower() for w in self._WORDS):
            k = str(out.dtype).removeprefix("torch.")
            self.counts[k] = self.counts.get(k, 0) + 1
        return out


def fuse_attention_with_autocast(case: ModelCase, twin: nn.Module, dtype=BF16) -> FuseAutocastResult:
    """``FuseAttention()`` + ``ApplyAutocast(dtype, fp32_routers=False)`` on ``case.model`` (eager attention) against
    ``twin``, the same model with Hugging Face's SDPA attention (eager attention where it has none), under eager
    ``torch.autocast`` on the same weights (the fused kernel is SDPA, not eager's matmul + softmax).

    Numerical: logits, loss and every gradient bit-identical to the twin (``equal``), or else the compiled model's
    error against the fp32 model at most 2x eager autocast's + 1e-3, logits and gradients (the reference calls SDPA
    otherwise, e.g. with a boolean sliding-window mask, or has no SDPA path). Structural: every site fused or left
    alone with its reason (no site rewritten without a fused kernel unless listed), the module captured under
    autocast, matmuls in ``dtype`` and in fp32 only as many as eager autocast runs in fp32 (the model's own fp32
    requests). The caller asserts ``equal`` where it knows it holds."""
    twin.load_state_dict(case.model.state_dict())
    fp32, eager_ac = copy.deepcopy(case.model), copy.deepcopy(case.model)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention(), ApplyAutocast(dtype=dtype, fp32_routers=False)],
                               lowering="eager")
    torch.manual_seed(0)
    out = compiled(**case.inputs)
    with torch.autocast("cpu", dtype):
        torch.manual_seed(0)
        want = twin(**case.inputs)
        torch.manual_seed(0)
        with _MatmulDtypes() as eager_mm:                # the matmuls the model itself keeps in fp32 under autocast
            want_eager = eager_ac(**case.inputs)
    torch.manual_seed(0)
    ref = fp32(**case.inputs)
    for o in (out, want, want_eager, ref):
        loss_of(o).backward()
    got, g_want, g_eager, g_ref = (grads_of(m) for m in (case.model, twin, eager_ac, fp32))
    assert got.keys() == g_want.keys() == g_ref.keys() and got, sorted(set(got) ^ set(g_want))[:5]
    equal = (torch.equal(out.logits, want.logits) and (out.loss is None or torch.equal(out.loss, want.loss))
             and all(torch.equal(got[k], g_want[k]) for k in g_want))

    def err(a, b):
        return float((a.detach().float() - b.detach().float()).abs().max())

    errors = {"logits": err(out.logits, ref.logits), "logits_eager_autocast": err(want_eager.logits, ref.logits),
              "grads": max(err(got[k], g_ref[k]) for k in g_ref),
              "grads_eager_autocast": max(err(g_eager[k], g_ref[k]) for k in g_ref)}
    if not equal:
        assert errors["logits"] <= 2 * errors["logits_eager_autocast"] + 1e-3, errors
        assert errors["grads"] <= 2 * errors["grads_eager_autocast"] + 1e-3, errors
    rep = effpass.report(compiled)
    st, ac = rep.stats("fuse_attention"), rep.stats("apply_autocast")
    skipped = [s for rec in rep.records("fuse_attention") for s in rec.skipped]
    assert all(s.get("reason") for s in skipped), skipped
    assert st["unfused"] == sum(1 for s in skipped if s.get("unfused")), (st, skipped)
    assert ac["capture"] == "module" and ac["regions"] >= 1, ac          # captured under autocast, no graph edit
    low = str(dtype).removeprefix("torch.")
    # fp32 only where eager autocast keeps fp32 too (the model's own fp32 requests: rotary frequencies with autocast
    # off, routers cast to fp32), counted on the eager-attention model's forward
    after = ac["matmuls_by_dtype_after"]
    assert after.get("float32", 0) == eager_mm.counts.get("float32", 0) and after.get(low, 0) > 0, \
        (after, eager_mm.counts)
    return FuseAutocastResult(equal, errors, st, ac,
                              {s["site"]: s["reason"] for s in skipped if not s.get("unfused")})


def _expert_tensors(model) -> list[str]:
    """MoE expert weights kept as 3-D parameters (transformers 5: Mixtral, Qwen3-MoE)."""
    return [n for n, p in model.named_parameters() if p.dim() == 3 and "expert" in n]


@dataclasses.dataclass
class QuantResult:
    stats: dict
    linears: list
    #: linears whose weight is the input embedding's (a tied head)
    tied: list
    #: site -> reason, for every candidate the pass left alone
    skipped: dict


def quantize_int8_equals_prepared(case: ModelCase) -> QuantResult:
    """``QuantizeLinear(scheme="int8")``: the compiled forward equals the prepared (quantized) eager model's, 1e-5
    (numerical); every ``nn.Linear`` is quantized or listed with its reason, a head tied to the embedding among the
    listed ones, and every MoE expert tensor is quantized or listed (structural)."""
    model = case.model
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    emb = model.get_input_embeddings().weight
    tied = [n for n in linears if model.get_submodule(n).weight is emb]
    experts = _expert_tensors(model)
    r = compile_and_compare(case, [QuantizeLinear(scheme="int8")], atol=1e-5, rtol=1e-5, backward=False)
    st = r.report.stats("quantize_linear")
    skipped = [s for rec in r.report.records("quantize_linear") for s in rec.skipped]
    assert all(s.get("reason") for s in skipped), skipped
    left = {s["site"]: s["reason"] for s in skipped}
    done = {n for n, rec in st["modules"].items() if rec.get("status") == "quantized"}
    missing = [n for n in linears if n not in done and n not in left]
    assert not missing, (missing, left)
    assert set(tied) <= {n for n, why in left.items() if "tied" in why}, (tied, left)
    listed = set(left) | set(st["modules"])
    assert all(any(e.startswith(site) or site.startswith(e.rsplit(".", 1)[0]) for site in listed)
               for e in experts), (experts, listed)
    return QuantResult(st, linears, tied, left)
