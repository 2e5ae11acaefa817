"""Tests of the ``quantize_linear`` pass: accuracy (SQNR, error bounds), memory, reference semantics,
kernels (aten int8pack on CPU, Triton under TRITON_INTERPRET=1), state dicts, fp8 and QLoRA."""
from __future__ import annotations

import copy
import gc
import io
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

import effpass
from effpass.testing import compile_and_compare, model_case, train_steps
from effpass.passes.quantize_linear import (NF4_CODE, QuantizedLinear, QuantizeLinear, dequantize_int8,
                                            fp8_supported, nf4_code_from_normal_quantiles, quantize_int8, sqnr)

SCHEMES = {  # scheme options used on the tiny models (in_features 64 and 128)
    "int8": {},
    "int4": {"group_size": 32},
    "nf4": {"double_quant": True},
}
# SQNR floors in dB, for weights and layer outputs on tiny random HF Llama (normal weights). Theory for a
# Gaussian: int8 per-channel ~ 40+, 4-bit with 32-64 wide blocks ~ 20.
SQNR_FLOOR = {"int8": 40.0, "int4": 19.0, "nf4": 19.0}


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _quantized(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


# ------------------------------------------------------------------------------------------------------
# accuracy
# ------------------------------------------------------------------------------------------------------
def test_nf4_code_values_match_qlora_paper():
    code = torch.tensor(NF4_CODE, dtype=torch.float64)
    # Rebuilt from the paper's construction (normal quantiles, exact zero, 8 positive / 7 negative).
    torch.testing.assert_close(code, nf4_code_from_normal_quantiles(), atol=1e-6, rtol=0)
    # Spot values printed in the QLoRA paper (appendix E).
    for i, v in {0: -1.0, 1: -0.6961928009986877, 7: 0.0, 8: 0.07958029955625534, 14: 0.7229568362236023,
                 15: 1.0}.items():
        assert code[i].item() == pytest.approx(v, abs=1e-7)
    assert len(set(NF4_CODE)) == 16 and list(NF4_CODE) == sorted(NF4_CODE)


def test_int8_per_channel_error_is_at_most_half_a_step():
    case = model_case("llama")
    for name, lin in _linears(case.model):
        w = lin.weight.detach()
        q, scale = quantize_int8(w)
        err = (w - dequantize_int8(q, scale, torch.float32)).abs()
        step = scale[:, None]
        assert (err <= step / 2 * (1 + 1e-5)).all(), name
        assert err.max() > step.min() / 10  # the bound is not vacuous: the error is a real fraction of a step


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weight_and_output_sqnr_on_llama(scheme):
    case = model_case("llama")
    g = torch.Generator().manual_seed(0)
    worst_w = worst_y = float("inf")
    for name, lin in _linears(case.model):
        q = QuantizedLinear.from_linear(lin, scheme=scheme, **SCHEMES[scheme])
        x = torch.randn(32, lin.in_features, generator=g)
        with torch.no_grad():
            worst_w = min(worst_w, sqnr(lin.weight, q.dequantize()))
            worst_y = min(worst_y, sqnr(lin(x), q(x)))
    assert worst_w >= SQNR_FLOOR[scheme], (scheme, worst_w)
    assert worst_y >= SQNR_FLOOR[scheme] - 1.0, (scheme, worst_y)
    assert worst_w < 80  # something really was quantized


def test_nf4_double_quant_costs_little_accuracy():
    lin = model_case("llama").model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        dq = sqnr(lin.weight, QuantizedLinear.from_linear(lin, scheme="nf4", double_quant=True).dequantize())
        plain = sqnr(lin.weight, QuantizedLinear.from_linear(lin, scheme="nf4", double_quant=False).dequantize())
    assert abs(dq - plain) < 0.3, (dq, plain)


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_outlier_columns_kept_in_high_precision_lower_the_error(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        planted = torch.tensor([5, 77, 100])
        lin.weight[:, planted] *= 40.0  # a few outlier-heavy input features (LLM.int8's observation)
    x = torch.randn(16, 128)
    kw = {"group_size": 64} if scheme == "int4" else {}
    plain = QuantizedLinear.from_linear(lin, scheme=scheme, **kw)
    kept = QuantizedLinear.from_linear(lin, scheme=scheme, outlier_threshold=6.0, **kw)
    assert sorted(kept.outlier_idx.tolist()) == planted.tolist()
    assert plain.outlier_idx.numel() == 0
    with torch.no_grad():
        ref = lin(x)
        s_plain, s_kept = sqnr(ref, plain(x)), sqnr(ref, kept(x))
        torch.testing.assert_close(kept.dequantize()[:, planted], lin.weight[:, planted], rtol=0, atol=0)
    assert s_kept > s_plain + 6.0, (s_plain, s_kept)


# ------------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,opts,lo,hi", [
    ("int8", {}, 0.99, 1.01),
    ("int4", {"group_size": 128}, 0.5, 0.5 + 5 / 128 + 0.002),        # fp32 scale + uint8 zero per 128
    ("nf4", {"double_quant": True}, 0.51, 0.52),                       # 4 + ~0.127 bits
    ("nf4", {"double_quant": False}, 0.5625 - 0.001, 0.5625 + 0.001),  # 4 + 32/64 bits
])
def test_bytes_per_parameter(scheme, opts, lo, hi):
    # A Llama-shaped layer (in_features 1024): scale overheads are as they would be on a real model.
    model = nn.Sequential(nn.Linear(1024, 512, bias=False))
    weight_ref = weakref.ref(model[0].weight)
    effpass.prepare(model, passes=[QuantizeLinear(scheme=scheme, **opts)])
    gc.collect()
    assert weight_ref() is None, "the full-precision weight is still alive"
    assert not any(p.numel() == 512 * 1024 for p in model.parameters())
    stats = effpass.report(model).stats("quantize_linear")
    nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert stats["bytes_after"] == nbytes
    assert lo <= nbytes / (512 * 1024) <= hi, nbytes / (512 * 1024)
    assert stats["bytes_before"] == 512 * 1024 * 4


# ------------------------------------------------------------------------------------------------------
# reference semantics: eager prepared model == compiled
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compiled_matches_eager_on_llama(scheme):
    case = model_case("llama")
    n_linears = len(_linears(case.model))
    res = compile_and_compare(case, [QuantizeLinear(scheme=scheme, **SCHEMES[scheme])], atol=1e-5, rtol=1e-4)
    stats = res.report.stats("quantize_linear")
    assert stats["quantized"] == n_linears == 15  # 7 per layer x 2 + lm_head
    assert not _linears(res.model) and len(_quantized(res.model)) == n_linears
    assert res.counters["graph_breaks"] == 0
    # Gradients still reach the unquantized parameters (norms, embeddings) through the quantized linears.
    assert "model.embed_tokens.weight" in res.compiled_grads
    assert not any("qweight" in n for n in res.compiled_grads)


def test_compiled_matches_eager_on_bert_with_bias():
    case = model_case("bert")
    res = compile_and_compare(case, [QuantizeLinear(scheme="nf4", exclude=["cls.*"])], atol=1e-5, rtol=1e-4)
    q = _quantized(res.model)
    assert q and all(not n.startswith("cls.") for n in q)
    assert any(m.bias is not None for m in q.values())


def test_quantize_linear_skips_tied_lm_head_on_gpt2():
    case = model_case("gpt2")  # GPT-2's blocks use Conv1D; its only nn.Linear (lm_head) is tied to wte
    model = effpass.prepare(case.model, passes=[QuantizeLinear(scheme="int8")])
    rec = effpass.report(model).records("quantize_linear")[0]
    assert rec.stats["quantized"] == 0 and not rec.changed
    assert rec.skipped == [{"site": "lm_head", "reason": rec.skipped[0]["reason"]}]
    assert "tied" in rec.skipped[0]["reason"]
    assert model.lm_head.weight is model.transformer.wte.weight


def test_quantize_linear_skips_shapes_the_scheme_cannot_handle():
    model = nn.Sequential(nn.Linear(96, 32), nn.Linear(32, 8))
    effpass.prepare(model, passes=[QuantizeLinear(scheme="nf4")])
    rec = effpass.report(model).records("quantize_linear")[0]
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Linear)
    assert [s["site"] for s in rec.skipped] == ["0", "1"]
    assert "block_size=64" in rec.skipped[0]["reason"]


def test_backward_reaches_input_not_quantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = QuantizedLinear.from_linear(lin, scheme="nf4")
    x = torch.randn(4, 64, requires_grad=True)
    q(x).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, q.dequantize(), lin.bias.detach()).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert [n for n, _ in q.named_parameters()] == ["bias"]
    assert all(not b.requires_grad for b in q.buffers())


def test_int8_uses_aten_int8pack_without_grad_and_matches_reference():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = QuantizedLinear.from_linear(lin, scheme="int8")
    x = torch.randn(2, 5, 64)
    assert q.kernel_for(x.device, needs_grad=False) == "aten._weight_int8pack_mm"
    assert q.kernel_for(x.device, needs_grad=True) == "dequantize+linear"
    with torch.no_grad():
        fast = q(x)
    ref = torch.nn.functional.linear(x, q.dequantize(), lin.bias)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    # Inside a compiled no-grad region the aten op is in the graph.
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()
    with torch.no_grad():
        out = torch.compile(q, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, fast)
    assert "effpass_quant.weight_int8pack_mm" in str(backend.graphs[0].code)


# ------------------------------------------------------------------------------------------------------
# state dict
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_state_dict_round_trips_exactly(scheme):
    opts = dict(SCHEMES[scheme], outlier_threshold=4.0)
    case = model_case("llama", seed=0)
    model = effpass.prepare(case.model, passes=[QuantizeLinear(scheme=scheme, **opts)])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    other = effpass.prepare(model_case("llama", seed=1).model, passes=[QuantizeLinear(scheme=scheme, **opts)])
    buf.seek(0)
    missing, unexpected = other.load_state_dict(torch.load(buf, weights_only=True))
    assert not missing and not unexpected
    sd_a, sd_b = model.state_dict(), other.state_dict()
    assert set(sd_a) == set(sd_b) and any(k.endswith("qweight") for k in sd_a)
    for k in sd_a:
        assert sd_a[k].dtype == sd_b[k].dtype and torch.equal(sd_a[k], sd_b[k]), k
    with torch.no_grad():
        assert torch.equal(model(**case.inputs).logits, other(**case.inputs).logits)


def test_safetensors_round_trip_nf4():
    safetensors = pytest.importorskip("safetensors.torch")
    case = model_case("llama")
    model = effpass.prepare(case.model, passes=[QuantizeLinear(scheme="nf4")])
    blob = safetensors.save(model.state_dict())
    other = effpass.prepare(model_case("llama", seed=3).model, passes=[QuantizeLinear(scheme="nf4")])
    other.load_state_dict(safetensors.load(blob))
    with torch.no_grad():
        assert torch.equal(model(**case.inputs).logits, other(**case.inputs).logits)


# ------------------------------------------------------------------------------------------------------
# fp8
# ------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(fp8_supported(), reason="this machine has an fp8 GPU")
def test_fp8_without_a_capable_gpu_is_a_clear_error():
    case = model_case("llama")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9"):
        effpass.prepare(case.model, passes=[QuantizeLinear(scheme="fp8")])


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_fp8_emulated_trains_and_matches_eager(granularity):
    case = model_case("llama", layers=1)
    ref = copy.deepcopy(case.model)
    res = compile_and_compare(case, [QuantizeLinear(scheme="fp8", fp8_emulate=True, fp8_granularity=granularity)],
                              atol=1e-5, rtol=1e-4)
    assert res.report.stats("quantize_linear")["quantized"] == 8
    # The weight stays a trainable parameter and gets a gradient through the fp8 backward.
    assert "model.layers.0.self_attn.q_proj.weight" in res.compiled_grads
    fresh = effpass.prepare(copy.deepcopy(ref), passes=[QuantizeLinear(scheme="fp8", fp8_emulate=True,
                                                                       fp8_granularity=granularity)])
    with torch.no_grad():
        assert sqnr(ref(**case.inputs).logits, fresh(**case.inputs).logits) > 20


# ------------------------------------------------------------------------------------------------------
# options, scoping, dumps
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,match", [
    ({"scheme": "int3"}, "int3"),
    ({"group_size": 0}, "group_size"),
    ({"block_size": 63}, "block_size"),
    ({"outlier_threshold": -1.0}, "outlier_threshold"),
    ({"scheme": "nf4", "kernel": "aten"}, "aten"),
    ({"scheme": "int8", "fp8_emulate": True}, "fp8_emulate"),
])
def test_bad_options_are_rejected(opts, match):
    with pytest.raises(ValueError, match=match):
        QuantizeLinear(**opts)


def test_targets_and_exclude_select_linears():
    case = model_case("llama")
    model = effpass.prepare(case.model, passes=[QuantizeLinear(scheme="int8", targets=["*.mlp.*"], exclude=["model.layers.1.*"])])
    q = _quantized(model)
    assert sorted(q) == [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    with pytest.raises(effpass.TargetMatchError, match="nomatch"):
        effpass.prepare(model_case("llama").model, passes=[QuantizeLinear(targets=["nomatch*"])])


def test_dump_shows_scheme_bytes_and_kernel_per_linear(tmp_path):
    case = model_case("llama", layers=1)
    effpass.compile(case.model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])], lowering="eager",
                    dump_dir=str(tmp_path))
    index = json.loads((tmp_path / "module" / "index.json").read_text())
    rec = next(r for r in index["passes"] if r["name"] == "quantize_linear")
    linears = rec["stats"]["linears"]
    assert len(linears) == 7 and "lm_head" not in linears
    entry = linears["model.layers.0.self_attn.q_proj"]
    assert entry["scheme"] == "nf4" and entry["bytes_before"] == 64 * 64 * 4
    assert 0 < entry["bytes_after"] < entry["bytes_before"] / 7
    assert entry["kernel"] == "dequantize+linear"


@pytest.mark.inductor
def test_inductor_matches_eager_int8():
    case = model_case("llama", layers=1)
    res = compile_and_compare(case, [QuantizeLinear(scheme="int8")], lowering="inductor", atol=1e-4, rtol=1e-4)
    assert res.report.stats("quantize_linear")["quantized"] == 8
    assert res.counters["graph_breaks"] == 0
    # Inference (no grad) takes the aten int8pack kernel inside the Inductor-compiled graph.
    with torch.no_grad():
        out = res.compiled(**case.inputs).logits
        ref = res.eager_model(**case.inputs).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_matches_eager_nf4_training():
    case = model_case("llama", layers=1)
    res = compile_and_compare(case, [QuantizeLinear(scheme="nf4", exclude=["lm_head"])], lowering="inductor",
                              atol=1e-4, rtol=1e-4)
    assert res.report.stats("quantize_linear")["quantized"] == 7
    assert "model.layers.0.input_layernorm.weight" in res.compiled_grads


# ------------------------------------------------------------------------------------------------------
# Triton kernels (interpreted on CPU)
# ------------------------------------------------------------------------------------------------------
_TRITON_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from effpass.passes.quantize_linear import QuantizedLinear
    torch.manual_seed(0)
    results = []
    for scheme, kw in [("int8", {}), ("int4", {"group_size": 32}), ("nf4", {"double_quant": True}),
                       ("nf4", {"double_quant": False})]:
        lin = torch.nn.Linear(64, 48)
        q = QuantizedLinear.from_linear(lin, scheme=scheme, kernel="triton", outlier_threshold=3.5, **kw)
        x = torch.randn(3, 64, requires_grad=True)
        assert q.kernel_for(x.device, needs_grad=True) == f"triton_{scheme}_mm"
        y = q(x)
        ref = torch.nn.functional.linear(x, q.dequantize(), lin.bias)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        gy = torch.randn_like(y)
        gx, = torch.autograd.grad(y, x, gy)
        gx_ref, = torch.autograd.grad(ref, x, gy)
        torch.testing.assert_close(gx, gx_ref, atol=1e-4, rtol=1e-4)
        results.append(scheme)
    # The custom op traces as one node (fake impl) and its registered backward works under compile.
    cq = torch.compile(q, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 64, requires_grad=True)
    yc = cq(x)
    torch.testing.assert_close(yc, q(x), atol=1e-5, rtol=1e-5)
    gc_, = torch.autograd.grad(yc.sum(), x)
    torch.testing.assert_close(gc_, torch.ones(5, 48) @ q.dequantize(), atol=1e-4, rtol=1e-4)
    # Half-precision activations: the kernel accumulates in fp32 like F.linear does. (fp16 here: the
    # Triton interpreter's tl.dot mishandles bf16 operands; bf16 is checked on a GPU.)
    lin = torch.nn.Linear(64, 32).half()
    q = QuantizedLinear.from_linear(lin, scheme="int8", kernel="triton")
    xb = torch.randn(4, 64, dtype=torch.float16)
    with torch.no_grad():
        yb = q(xb)
    assert yb.dtype == torch.float16
    torch.testing.assert_close(yb.float(), torch.nn.functional.linear(xb.float(), q.dequantize(torch.float32), lin.bias.float()),
                               atol=2e-2, rtol=2e-2)
    print("OK", results)
""")


def test_triton_kernels_match_reference_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK ['int8', 'int4', 'nf4', 'nf4']" in out.stdout


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_triton_kernels_on_gpu_bf16(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    q = QuantizedLinear.from_linear(lin, scheme=scheme, outlier_threshold=3.5, **SCHEMES[scheme])
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert q.kernel_for(x.device, needs_grad=True) == f"triton_{scheme}_mm"
    y = q(x)
    ref = torch.nn.functional.linear(x, q.dequantize(torch.bfloat16), lin.bias)
    assert sqnr(ref, y) > 40
    gy = torch.randn_like(y)
    assert sqnr(torch.autograd.grad(ref, x, gy)[0], torch.autograd.grad(y, x, gy)[0]) > 40
    with torch.no_grad():  # decode shape
        x1 = x[:1].detach()
        assert sqnr(torch.nn.functional.linear(x1, q.dequantize(torch.bfloat16), lin.bias), q(x1)) > 40


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_supported(), reason="needs a GPU with compute capability >= 8.9")
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_fp8_scaled_mm_matches_emulation_on_gpu(granularity):
    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    real = QuantizedLinear.from_linear(lin, scheme="fp8", fp8_granularity=granularity)
    emu = QuantizedLinear.from_linear(lin, scheme="fp8", fp8_granularity=granularity, fp8_emulate=True)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, ye = real(x), emu(x)
    assert sqnr(ye, y) > 35 and sqnr(lin(x), y) > 20
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, real.weight), gy)
    gxe, gwe = torch.autograd.grad(ye, (x, emu.weight), gy)
    assert sqnr(gxe, gx) > 30 and sqnr(gwe, gw) > 30


# ------------------------------------------------------------------------------------------------------
# QLoRA
# ------------------------------------------------------------------------------------------------------
def test_qlora_tracks_full_precision_lora():
    lora_mod = pytest.importorskip("effpass.passes.inject_lora")
    InjectLoRA = lora_mod.InjectLoRA
    targets = ["*.q_proj", "*.v_proj"]
    losses = {}
    for arm in ("fp32", "nf4"):
        case = model_case("llama", layers=1, seed=0)
        passes = [InjectLoRA(rank=8, targets=targets)]
        if arm == "nf4":
            passes.insert(0, QuantizeLinear(scheme="nf4", double_quant=True))
        torch.manual_seed(123)  # identical adapter initialisation in both arms
        compiled = effpass.compile(case.model, passes=passes, lowering="eager")
        trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), trainable
        losses[arm] = train_steps(compiled, case, 20, lr=1e-2)
        if arm == "nf4":
            qs = _quantized(case.model)
            assert len(qs) == 8
            loss = case.loss(compiled(**case.inputs))
            loss.backward()
            with_grad = [n for n, p in case.model.named_parameters() if p.grad is not None]
            assert with_grad and all("lora_" in n for n in with_grad)
    ref, q = torch.tensor(losses["fp32"]), torch.tensor(losses["nf4"])
    assert ref[-1] < ref[0] - 0.2 and q[-1] < q[0] - 0.2  # both learn
    # Tolerance: NF4's ~20 dB weight noise shifts the loss by much less than 2% over 20 steps here.
    assert ((q - ref).abs() / ref).max() < 0.02, (ref.tolist(), q.tolist())
