"""The checks of the family x pass matrix, shared by the hand-written family suite (tests/models/test_families.py,
tests/_families.py) and the sweep over every causal-LM type (tests/models/test_every_causal_lm.py,
tests/_auto_families.py). Each runs one column on one :class:`effpass.testing.ModelCase` and asserts its two oracles
(numerical and structural) that hold for every family; the callers add what they know of their own families
(exact site counts, refusals).

* ``autocast_bit_identical``: bf16 (or fp16) ``apply_autocast`` (module capture) gives logits, loss and every gradient
  bit-identical to eager ``torch.autocast`` on the unprepared model; matmuls in the low dtype, no fp32 islands.
* ``fuse_attention_equals_unfused``: forward and gradients equal the unfused eager model (1e-5); every site the pass
  left alone carries its reason, and so does every site rewritten where SDPA has no fused kernel (``unfused``).
* ``quantize_int8_equals_prepared``: the int8 forward equals the prepared eager model (1e-5); every ``nn.Linear`` is
  quantized or listed with its reason, and every MoE expert tensor too.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.nn as nn

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
