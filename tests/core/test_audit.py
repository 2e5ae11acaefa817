"""Audit regressions: cases where a built-in pass once gave a result silently different from the eager
prepared model (the one failure effpass must never have). Each test is named for the case it covers;
each compares compiled with eager (outputs and gradients) and checks the pass's own statistics."""
import copy
import warnings

import pytest
import torch

import effpass
from effpass.passes import ApplyAutocast, FuseAttention, InjectLoRA, QuantizeLinear
from effpass.passes import inject_lora as il
from effpass.testing import assert_close_tree, compile_and_compare, grads_of, loss_of, model_case


def _left_padded(case, pad: int = 5):
    mask = torch.ones_like(case.inputs["input_ids"])
    mask[1, :pad] = 0  # sequence 1 is left-padded: its first query rows attend to no key at all
    # padding is never a target, nor is the first real token (it would be predicted from the last pad), as
    # trainers mask padding; a loss over every position is tested in tests/passes/fuse_attention/
    labels = case.inputs["input_ids"].masked_fill(mask == 0, -100)
    labels[1, pad] = -100
    return dict(case.inputs, attention_mask=mask, labels=labels)


def _compare(compiled, eager, inputs, *, atol=1e-5, backward=True):
    torch.manual_seed(0)
    e = eager(**inputs)
    torch.manual_seed(0)
    c = compiled(**inputs)
    assert_close_tree(c.logits if hasattr(c, "logits") else c[1], e.logits if hasattr(e, "logits") else e[1],
                      atol=atol, rtol=atol, what="output")
    if backward:
        loss_of(e).backward()
        loss_of(c).backward()
        model = getattr(compiled, "_orig_mod", compiled)
        assert_close_tree(grads_of(model), grads_of(eager), atol=atol, rtol=atol, what="grad")


# ------------------------------------------------------------------------------------------------------
# fuse_attention
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fuse_attention_left_padding_gradients_match_eager(name):
    """Left padding leaves query rows with every key masked by HF's finite ``finfo.min``: torch's fused
    CPU SDPA kernel gets the forward right but the backward wrong there (v_proj grads off by 5x their
    size). The pass now gives such rows every key and a zero-valued query (masked_sdpa): the fused kernel runs,
    every output (padded rows included) equals eager and so do the gradients."""
    case = model_case(name, layers=1)
    inputs = _left_padded(case)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention()], lowering="eager", strict=True)
    eager = copy.deepcopy(case.model)
    _compare(compiled, eager, inputs)
    stats = effpass.report(compiled).stats("fuse_attention")
    assert stats["fused"] == 1 and stats["attn_mask"] == 1 and stats["empty_row_guard"] == 1, stats
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(compiled(**inputs)).backward()
    ran = {e.name for e in prof.events() if "attention" in e.name}
    assert any("flash_attention" in n for n in ran) and not any("math" in n for n in ran), ran


@pytest.mark.inductor
def test_fuse_attention_left_padding_gradients_match_eager_inductor():
    """The empty-row guard of a left-padded Llama site lowers through Inductor too, gradients exact."""
    case = model_case("llama", layers=1)
    inputs = _left_padded(case)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention()], lowering="inductor", strict=True)
    eager = copy.deepcopy(case.model)
    _compare(compiled, eager, inputs, atol=1e-4)
    assert effpass.report(compiled).stats("fuse_attention")["empty_row_guard"] == 1


def test_fuse_attention_left_padding_inference_keeps_fused_kernel():
    """No gradient flows in an inference graph: the fused kernel's forward is right, so it is kept."""
    case = model_case("llama", layers=1)
    inputs = _left_padded(case)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention()], lowering="eager", strict=True)
    eager = copy.deepcopy(case.model)
    with torch.no_grad():
        _compare(compiled, eager, inputs, backward=False)
    stats = effpass.report(compiled).stats("fuse_attention")
    assert stats["fused"] == 1 and stats["empty_row_guard"] == 1, stats


def test_fuse_attention_dynamic_shapes_boolean_mask_demo():
    """dynamic=True: the demo's ``masked_fill(triu)`` mask has a symbolic size, so causality is not
    proven and a boolean attn_mask is passed. The math reference ADDS a boolean mask (True = +1)
    instead of masking: the compiled output was off by 0.4. It now gets the mask as 0 / -inf."""
    case = model_case("demo", layers=1)
    other = model_case("demo", layers=1, seq=11, batch=3)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention()], lowering="eager", dynamic=True, strict=True)
    eager = copy.deepcopy(case.model)
    _compare(compiled, eager, case.inputs)
    for m in (case.model, eager):
        m.zero_grad(set_to_none=True)
    _compare(compiled, eager, other.inputs)  # another shape through the same symbolic graph
    stats = effpass.report(compiled).stats("fuse_attention")
    assert stats["fused"] >= 1 and stats["causal"] == 0 and stats["empty_row_guard"] >= 1, stats


def test_fuse_attention_dynamic_shapes_hf_llama_left_alone_with_reason():
    """With symbolic shapes HF Llama's scale is a tensor expression: the sites are left alone, and say so."""
    case = model_case("llama", layers=1)
    other = model_case("llama", layers=1, seq=11, batch=3)
    torch._dynamo.reset()
    compiled = effpass.compile(case.model, passes=[FuseAttention()], lowering="eager", dynamic=True, strict=True)
    eager = copy.deepcopy(case.model)
    _compare(compiled, eager, case.inputs)
    graphs = len(effpass.report(compiled).graphs)
    # another shape through the same symbolic graph (with grad enabled: a no_grad call would compile an
    # inference graph, a second dynamic-shape compile of this model, for the same check of the forward)
    _compare(compiled, eager, other.inputs, backward=False)
    assert len(effpass.report(compiled).graphs) == graphs  # no recompile: the symbolic graph took the new shape
    records = effpass.report(compiled).records("fuse_attention")
    skipped = [s for r in records for s in r.skipped]
    assert effpass.report(compiled).stats("fuse_attention")["fused"] == 0
    assert skipped and all(s["reason"] for s in skipped), skipped


# ------------------------------------------------------------------------------------------------------
# LoRA merge
# ------------------------------------------------------------------------------------------------------
def test_lora_merge_leaves_tied_gpt2_lm_head_unmerged():
    """GPT-2's lm_head weight is the token embedding: merging its adapter (``W += B @ A``) changed the
    embedding too (logits off by ~2). The tied adapter now stays unmerged, with a warning."""
    case = model_case("gpt2", layers=1)
    model = case.model.eval()
    effpass.prepare(model, passes=[InjectLoRA(rank=4)], lowering="eager")
    torch.manual_seed(1)
    for m in il.lora.lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    with torch.no_grad():
        before = model(**case.inputs).logits
    with pytest.warns(UserWarning, match="tied"):
        merged = il.merge(model)
    mods = il.lora.lora_modules(model)
    assert merged == len(mods) - 1 and not mods["lm_head"].merged
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[InjectLoRA(rank=4), FuseAttention()], lowering="eager")
    with torch.no_grad():
        after = model(**case.inputs).logits
        out = compiled(**case.inputs).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-5)
    assert il.unmerge(model) == len(mods)
    with torch.no_grad():
        torch.testing.assert_close(model(**case.inputs).logits, before, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# the passes together
# ------------------------------------------------------------------------------------------------------
def test_all_graph_and_module_passes_together_llama_lora_dropout():
    """fuse_attention + apply_autocast(bf16) + inject_lora(dropout) + quantize_linear in training:
    compiled matches the prepared eager model run under torch.autocast(bf16) (same dropout masks)."""
    case = model_case("llama", train=True)
    passes = [FuseAttention(), ApplyAutocast(dtype="bfloat16"), InjectLoRA(rank=4, dropout=0.1), QuantizeLinear()]

    def reference(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**case.inputs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compile_and_compare(case, passes, reference=reference, atol=2e-2, rtol=2e-2, step=False)
    r = res.report
    assert r.stats("fuse_attention")["fused"] == case.num_layers
    assert r.stats("quantize_linear")["quantized"] > 0
    assert r.stats("inject_lora")["adapters"] > 0
    assert r.stats("apply_autocast")["matmuls_by_dtype_after"].get("bfloat16", 0) > 0


def test_lora_under_apply_autocast_matches_eager_autocast():
    """LoRALinear cast its output back with ``.to(result.dtype)``: Dynamo baked the fp32 seen while
    tracing, so under apply_autocast the adapter outputs became fp32 where eager torch.autocast keeps
    bf16 (logits fp32 instead of bf16, ~1% gradient difference). It now uses ``type_as``."""
    case = model_case("llama", train=True)

    def reference(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**case.inputs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compile_and_compare(case, [ApplyAutocast(dtype="bfloat16"), InjectLoRA(rank=4)], reference=reference,
                                  atol=1e-5, rtol=1e-5, step=False)
    assert [t.dtype for t in res.compiled_out] == [t.dtype for t in res.eager_out]
    assert res.report.stats("inject_lora")["merged_groups"] > 0
    assert res.report.stats("apply_autocast")["matmuls_by_dtype_after"].get("bfloat16", 0) > 0
