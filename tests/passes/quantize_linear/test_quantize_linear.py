"""Tests of the ``quantize_linear`` pass (torchao tensor subclasses in ``nn.Linear.weight``): accuracy (SQNR,
error bounds), memory, structure (which modules, which weight type), reference semantics on several model
families (Llama, GPT-2 Conv1D, BERT, T5, Falcon both layouts, Mixtral and Qwen3-MoE experts), kernels,
state dicts, fp8, QLoRA and error cases."""
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
import torch.nn.functional as F
from torch import nn
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

import effpass
from effpass.testing import compile_and_compare, model_case, train_steps
from effpass.passes.quantize_linear import (NF4_CODE, ExpertsWeightTensor, Fp8Linear, Int4WeightTensor,
                                            Int8WeightTensor, NF4WeightTensor,
                                            QuantizeLinear, dequantized_weight, fp8_supported,
                                            nf4_code_from_normal_quantiles, sqnr)

SCHEMES = {  # scheme options used on the tiny models (in_features 64 and 128)
    "int8": {},
    "int4": {"group_size": 32},
    "nf4": {},
}
WEIGHT_TYPE = {"int8": Int8WeightTensor, "int4": Int4WeightTensor, "nf4": NF4WeightTensor}
# SQNR floors in dB, for weights and layer outputs on tiny random HF models (normal weights). Theory for a
# Gaussian: int8 per-channel ~ 40+, 4-bit with 32-64 wide blocks ~ 20.
SQNR_FLOOR = {"int8": 40.0, "int4": 19.0, "nf4": 19.0}
# Floors for whole-model logits vs fp32 (errors of all layers add up): measured 41-45 dB int8, 17.5-22 dB NF4.
LOGIT_FLOOR = {"int8": 35.0, "nf4": 15.0}


def _quantized(model):
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and isinstance(m.weight, (Int8Tensor, NF4Tensor, Int4WeightTensor))}


def _prepare(model, **opts):
    return effpass.prepare(model, passes=[QuantizeLinear(**opts)])


# ------------------------------------------------------------------------------------------------------
# model families not in effpass.testing.model_case (tiny configs, random weights)
# ------------------------------------------------------------------------------------------------------
def family(name: str):
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    if name == "t5":
        cfg = tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
                          num_heads=4, decoder_start_token_id=0, pad_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
        inputs["decoder_input_ids"] = ids
    elif name in ("falcon_old", "falcon_new"):
        new = name == "falcon_new"
        cfg = tf.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              new_decoder_architecture=new, num_kv_heads=2 if new else None, multi_query=not new,
                              bias=not new)
        model = tf.FalconForCausalLM(cfg)
    elif name == "mixtral":
        cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    elif name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:  # pragma: no cover
        raise ValueError(name)
    model.config._attn_implementation = "eager"
    return model.eval(), inputs


# ------------------------------------------------------------------------------------------------------
# accuracy
# ------------------------------------------------------------------------------------------------------
def test_nf4_code_values_match_qlora_paper_and_torchao():
    code = torch.tensor(NF4_CODE, dtype=torch.float64)
    # Rebuilt from the paper's construction (normal quantiles, exact zero, 8 positive / 7 negative).
    torch.testing.assert_close(code, nf4_code_from_normal_quantiles(), atol=1e-6, rtol=0)
    for i, v in {0: -1.0, 1: -0.6961928009986877, 7: 0.0, 8: 0.07958029955625534, 14: 0.7229568362236023,
                 15: 1.0}.items():
        assert code[i].item() == pytest.approx(v, abs=1e-7)
    # torchao's NF4Tensor table (4 decimals) is the same code.
    model = _prepare(nn.Sequential(nn.Linear(64, 64)), scheme="nf4")
    torch.testing.assert_close(model[0].weight.nf4.double(), code, atol=5e-5, rtol=0)


def test_int8_per_channel_error_is_at_most_half_a_step():
    case = model_case("llama")
    ref = {n: m.weight.detach().clone() for n, m in case.model.named_modules() if isinstance(m, nn.Linear)}
    model = _prepare(case.model, scheme="int8")
    for name, lin in _quantized(model).items():
        step = lin.weight.scale.reshape(-1, 1)
        err = (ref[name] - dequantized_weight(lin)).abs()
        assert (err <= step / 2 * (1 + 1e-4)).all(), (name, (err / step).max())
        assert err.max() > step.min() / 10  # the bound is not vacuous


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weight_and_output_sqnr_on_llama(scheme):
    case = model_case("llama")
    ref = {n: copy.deepcopy(m) for n, m in case.model.named_modules() if isinstance(m, nn.Linear)}
    model = _prepare(case.model, scheme=scheme, **SCHEMES[scheme])
    q = _quantized(model)
    assert sorted(q) == sorted(ref) and len(q) == 15
    g = torch.Generator().manual_seed(0)
    worst_w = worst_y = float("inf")
    for name, lin in q.items():
        assert type(lin) is nn.Linear and type(lin.weight) is WEIGHT_TYPE[scheme]
        assert lin.weight.dtype == torch.float32 and lin.weight.shape == ref[name].weight.shape
        x = torch.randn(32, lin.in_features, generator=g)
        with torch.no_grad():
            worst_w = min(worst_w, sqnr(ref[name].weight, dequantized_weight(lin)))
            worst_y = min(worst_y, sqnr(ref[name](x), lin(x)))
    assert worst_w >= SQNR_FLOOR[scheme], (scheme, worst_w)
    assert worst_y >= SQNR_FLOOR[scheme] - 1.0, (scheme, worst_y)
    assert worst_w < 80  # something really was quantized


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
    plain = _prepare(nn.Sequential(copy.deepcopy(lin)), scheme=scheme, **kw)[0]
    kept = _prepare(nn.Sequential(copy.deepcopy(lin)), scheme=scheme, outlier_threshold=6.0, **kw)[0]
    assert sorted(kept.outlier_idx.tolist()) == planted.tolist()
    assert not hasattr(plain, "outlier_idx")  # outlier_threshold=0: no buffers
    with torch.no_grad():
        ref = lin(x)
        s_plain, s_kept = sqnr(ref, plain(x)), sqnr(ref, kept(x))
        torch.testing.assert_close(dequantized_weight(kept)[:, planted], lin.weight[:, planted], rtol=0, atol=0)
        torch.testing.assert_close(kept(x), F.linear(x, dequantized_weight(kept)), atol=1e-5, rtol=1e-5)
    assert s_kept > s_plain + 6.0, (s_plain, s_kept)


# ------------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,opts,lo,hi", [
    ("int8", {}, 0.99, 1.0 + 4 / 1024 + 1e-6),                         # int8 + one fp32 scale per row
    ("int4", {"group_size": 128}, 0.5, 0.5 + 5 / 128 + 0.002),        # fp32 scale + uint8 zero per 128
    ("nf4", {}, 0.51, 0.52),                                           # 4 + ~0.127 bits (double quant)
])
def test_bytes_per_parameter(scheme, opts, lo, hi):
    # A Llama-shaped layer (in_features 1024): scale overheads are as they would be on a real model.
    model = nn.Sequential(nn.Linear(1024, 512, bias=False))
    weight_ref = weakref.ref(model[0].weight)
    _prepare(model, scheme=scheme, **opts)
    gc.collect()
    assert weight_ref() is None, "the full-precision weight is still alive"
    w = model[0].weight
    assert isinstance(model[0], nn.Linear) and type(w) is WEIGHT_TYPE[scheme] and not w.requires_grad
    stats = effpass.report(model).stats("quantize_linear")
    names, _ = w.__tensor_flatten__()
    nbytes = sum(getattr(w, n).numel() * getattr(w, n).element_size() for n in names if getattr(w, n) is not None)
    assert stats["bytes_after"] == nbytes == stats["modules"]["0"]["bytes_after"]
    assert lo <= nbytes / (512 * 1024) <= hi, nbytes / (512 * 1024)
    assert stats["bytes_before"] == 512 * 1024 * 4
    assert stats["bytes_per_param"] == round(nbytes / (512 * 1024), 4)  # as the storage holds them


# ------------------------------------------------------------------------------------------------------
# reference semantics: eager prepared model == compiled
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compiled_matches_eager_on_llama(scheme):
    case = model_case("llama", layers=1)  # one layer has every kind of linear (q/k/v/o, gate/up/down) and the head
    n_linears = sum(isinstance(m, nn.Linear) for m in case.model.modules())
    res = compile_and_compare(case, [QuantizeLinear(scheme=scheme, **SCHEMES[scheme])], atol=1e-5, rtol=1e-4)
    stats = res.report.stats("quantize_linear")
    assert stats["quantized"] == n_linears == 8  # 7 in the layer + lm_head
    assert len(_quantized(res.model)) == n_linears
    assert all(r["status"] == "quantized" and r["weight_type"] == WEIGHT_TYPE[scheme].__name__
               for r in stats["modules"].values())
    assert res.counters["graph_breaks"] == 0
    # Gradients still reach the unquantized parameters (norms, embeddings) through the quantized linears.
    assert "model.embed_tokens.weight" in res.compiled_grads
    assert not any(n.endswith("proj.weight") for n in res.compiled_grads)


def test_compiled_matches_eager_on_bert_with_bias():
    case = model_case("bert")
    res = compile_and_compare(case, [QuantizeLinear(scheme="nf4", exclude=["cls.*"])], atol=1e-5, rtol=1e-4)
    q = _quantized(res.model)
    assert len(q) == 6 * 2 and all(not n.startswith("cls.") for n in q)
    assert any(m.bias is not None for m in q.values())


def test_gpt2_conv1d_becomes_a_quantized_linear_and_tied_head_is_skipped():
    case = model_case("gpt2")  # GPT-2's blocks use Conv1D ([in, out] weight); lm_head is tied to wte
    with torch.no_grad():
        ref = case.model(**case.inputs).logits
    model = _prepare(case.model, scheme="int8")
    rec = effpass.report(model).records("quantize_linear")[0]
    q = _quantized(model)
    assert sorted(q) == sorted(f"transformer.h.{i}.{p}" for i in range(2)
                                for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert all(rec.stats["modules"][n]["kind"] == "conv1d" for n in q)
    assert rec.skipped == [{"site": "lm_head", "reason": rec.skipped[0]["reason"]}]
    assert "tied" in rec.skipped[0]["reason"]
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        assert sqnr(ref, model(**case.inputs).logits) > LOGIT_FLOOR["int8"]


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_t5_reads_weight_dtype_of_quantized_linears(scheme):
    model, inputs = family("t5")
    with torch.no_grad():
        ref = model(**inputs).logits
    res_model = effpass.compile(model, passes=[QuantizeLinear(scheme=scheme)], lowering="eager")
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo
    assert wo.weight.dtype == torch.float32 and type(wo.weight) is WEIGHT_TYPE[scheme]  # T5 reads wo.weight.dtype
    stats = effpass.report(model).stats("quantize_linear")
    assert stats["quantized"] == 16 and stats["modules"]["lm_head"]["status"] == "skipped"  # tied to shared
    with torch.no_grad():
        eager = model(**inputs).logits
        compiled = res_model(**inputs).logits
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
    assert sqnr(ref, eager) > LOGIT_FLOOR[scheme]


@pytest.mark.parametrize("name", ["falcon_old", "falcon_new"])
def test_falcon_linear_subclass_is_quantized_in_place(name):
    import transformers as tf

    model, inputs = family(name)
    with torch.no_grad():
        ref = model(**inputs).logits
    _prepare(model, scheme="int8")
    stats = effpass.report(model).stats("quantize_linear")
    fl = {n: m for n, m in model.named_modules() if isinstance(m, tf.models.falcon.modeling_falcon.FalconLinear)}
    assert len(fl) == 4 and stats["quantized"] == 4
    for n, m in fl.items():  # still a FalconLinear, now with nn.Linear's forward and an int8 weight
        assert stats["modules"][n]["kind"] == "linear_subclass" and type(m.weight) is Int8WeightTensor
    with torch.no_grad():
        out = model(**inputs)
    assert sqnr(ref, out.logits) > LOGIT_FLOOR["int8"]


def test_linear_subclass_whose_forward_is_not_linear_is_skipped():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Doubled(64, 64), nn.Linear(64, 64))
    _prepare(model, scheme="int8")
    rec = effpass.report(model).records("quantize_linear")[0]
    assert [s["site"] for s in rec.skipped] == ["0"]
    assert "does not compute F.linear" in rec.skipped[0]["reason"]
    assert type(model[0].weight) is nn.Parameter and type(model[1].weight) is Int8WeightTensor


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_expert_weights_quantized_per_expert_int8(name):
    model, inputs = family(name)
    experts = model.model.layers[0].mlp.experts
    fp = {a: getattr(experts, a).detach().clone() for a in ("gate_up_proj", "down_proj")}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 64, generator=g)
    idx = torch.randint(0, 4, (10, 2), generator=g)
    wts = torch.rand(10, 2, generator=g)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        ref_experts = experts(x, idx, wts)
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        ref = model(**inputs).logits
    _prepare(model, scheme="int8")
    stats = effpass.report(model).stats("quantize_linear")
    assert stats["quantized_expert_tensors"] == 2 and stats["experts_implementation"] == "grouped_mm -> eager"
    for a in ("gate_up_proj", "down_proj"):
        w = getattr(experts, a)
        assert type(w) is ExpertsWeightTensor and w.shape == fp[a].shape and w.scheme == "int8"
        assert w.qdata.dtype == torch.int8 and w.scale.shape == (*fp[a].shape[:2], 1)  # per expert and row
        entry = stats["modules"][f"model.layers.0.mlp.experts.{a}"]
        assert entry["status"] == "quantized" and entry["experts"] == 4
        for e in range(4):
            assert sqnr(fp[a][e], w.dequantize()[e]) > SQNR_FLOOR["int8"]
    # Same routing (the same top-k indices and weights in): the experts' output moves by int8 noise only.
    with torch.no_grad():
        assert sqnr(ref_experts, experts(x, idx, wts)) > SQNR_FLOOR["int8"] - 5
        assert sqnr(ref, model(**inputs).logits) > LOGIT_FLOOR["int8"]


def test_moe_expert_weights_listed_as_skipped_for_int4(tmp_path):
    model, inputs = family("mixtral")
    effpass.compile(model, passes=[QuantizeLinear(scheme="int4", group_size=32)], lowering="eager",
                    dump_dir=str(tmp_path))
    rec = effpass.report(model).records("quantize_linear")[0]
    experts = {s["site"]: s["reason"] for s in rec.skipped if ".experts." in s["site"]}
    assert sorted(experts) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    assert all("no 3-D (per-expert) format" in r for r in experts.values())
    index = json.loads((tmp_path / "module" / "index.json").read_text())
    dumped = next(r for r in index["passes"] if r["name"] == "quantize_linear")
    assert dumped["stats"]["modules"]["model.layers.0.mlp.experts.down_proj"]["status"] == "skipped"
    assert rec.stats["quantized"] == 5 and type(model.model.layers[0].mlp.experts.down_proj) is nn.Parameter


def test_int8_uses_aten_int8pack_for_half_inference_and_torchao_otherwise():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).bfloat16()
    _prepare(nn.Sequential(lin), scheme="int8")
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ref = F.linear(x, dequantized_weight(lin, torch.bfloat16), lin.bias)
    with torch.no_grad():
        fast = lin(x)
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    from torch._dynamo.backends.common import aot_autograd

    graphs = []  # the aten graph AOTAutograd traces through the subclass's F.linear
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm)
    with torch.no_grad():
        out = torch.compile(lin, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, fast)
    assert "effpass_quant.weight_int8pack_mm" in str(graphs[0].code)
    # With a gradient needed: torchao's weight-only path, differentiable in x.
    xg = x.float().requires_grad_(True)
    lin32 = nn.Linear(64, 48)
    _prepare(nn.Sequential(lin32), scheme="int8")
    lin32(xg).pow(2).sum().backward()
    x2 = xg.detach().clone().requires_grad_(True)
    F.linear(x2, dequantized_weight(lin32), lin32.bias).pow(2).sum().backward()
    torch.testing.assert_close(xg.grad, x2.grad, atol=1e-4, rtol=1e-4)


def test_nf4_backward_reaches_input_not_quantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    _prepare(nn.Sequential(lin), scheme="nf4")
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, dequantized_weight(lin), lin.bias.detach()).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == ["bias"]
    # effpass's pair-table dequantization equals torchao's own.
    torch.testing.assert_close(dequantized_weight(lin), NF4Tensor.get_original_weight(lin.weight), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------
# state dict
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_state_dict_round_trips_exactly(scheme):
    opts = dict(SCHEMES[scheme], outlier_threshold=4.0)
    case = model_case("llama", seed=0)
    model = _prepare(case.model, scheme=scheme, **opts)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    other = _prepare(model_case("llama", seed=1).model, scheme=scheme, **opts)
    buf.seek(0)
    missing, unexpected = other.load_state_dict(torch.load(buf, weights_only=True))
    assert not missing and not unexpected
    sd_a, sd_b = model.state_dict(), other.state_dict()
    assert set(sd_a) == set(sd_b) and any(type(v) is WEIGHT_TYPE[scheme] for v in sd_a.values())
    for k in sd_a:
        a, b = sd_a[k], sd_b[k]
        assert type(a) is type(b), k
        if hasattr(type(a), "__tensor_flatten__"):
            names, _ = a.__tensor_flatten__()
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in names), k
        else:
            assert torch.equal(a, b), k
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
    q = res.report.stats("quantize_linear")["modules"]["model.layers.0.self_attn.q_proj"]
    assert q["weight_type"] == "Parameter" and q["kernel"] == "torchao Float8Linear (emulated)"
    # The weight stays a trainable parameter and gets a gradient through the fp8 backward.
    assert "model.layers.0.self_attn.q_proj.weight" in res.compiled_grads
    fresh = effpass.prepare(copy.deepcopy(ref), passes=[QuantizeLinear(scheme="fp8", fp8_emulate=True,
                                                                       fp8_granularity=granularity)])
    with torch.no_grad():
        assert sqnr(ref(**case.inputs).logits, fresh(**case.inputs).logits) > 20


def test_fp8_fsdp_all_gather_wraps_weights_for_torchao_fp8_all_gather():
    """fp8_fsdp_all_gather: torchao's enable_fsdp_float8_all_gather (the weight becomes the subclass that
    FSDP2 all-gathers in fp8); without FSDP the linear computes as before (emulated here)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    ref = copy.deepcopy(lin)
    m = _prepare(nn.Sequential(lin), scheme="fp8", fp8_granularity="tensorwise", fp8_emulate=True,
                 fp8_fsdp_all_gather=True)
    assert type(m[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor" and m[0].config.enable_fsdp_float8_all_gather
    x = torch.randn(8, 64)
    y = m(x)
    y.sum().backward()
    assert m[0].weight.grad is not None and sqnr(ref(x), y) > 20


# ------------------------------------------------------------------------------------------------------
# options, scoping, dumps
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,match", [
    ({"scheme": "int3"}, "int3"),
    ({"group_size": 0}, "group_size"),
    ({"block_size": 63}, "block_size"),
    ({"outlier_threshold": -1.0}, "outlier_threshold"),
    ({"scheme": "nf4", "kernel": "triton"}, r"kernel='triton'.*\['auto', 'torchao'\]"),
    ({"scheme": "fp8", "kernel": "torchao"}, r"kernel='torchao'.*\['auto'\]"),
    ({"scheme": "nf4", "double_quant": False}, "double_quant=False"),
    ({"scheme": "int8", "fp8_emulate": True}, "fp8_emulate"),
    ({"scheme": "fp8", "fp8_fsdp_all_gather": True}, r"fp8_fsdp_all_gather=True needs .*tensorwise"),
])
def test_bad_options_are_rejected(opts, match):
    with pytest.raises(ValueError, match=match):
        QuantizeLinear(**opts)


def test_targets_and_exclude_select_linears():
    case = model_case("llama")
    model = _prepare(case.model, scheme="int8", targets=["*.mlp.*"], exclude=["model.layers.1.*"])
    assert sorted(_quantized(model)) == [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    assert isinstance(model.model.layers[1].mlp.up_proj.weight, nn.Parameter)
    with pytest.raises(effpass.TargetMatchError, match="nomatch"):
        _prepare(model_case("llama").model, targets=["nomatch*"])


def test_misspelt_exclude_is_an_error_naming_the_pattern_and_modules():
    model = model_case("llama").model
    with pytest.raises(effpass.TargetMatchError, match=r"exclude pattern 'lm_haed' matches no .*'model\.layers\.0"):
        _prepare(model, exclude=["lm_haed"])
    assert type(model.lm_head.weight) is nn.Parameter  # nothing was quantized
    assert all(type(m.weight) is nn.Parameter for m in model.modules() if isinstance(m, nn.Linear))


def test_nothing_to_quantize_warns_naming_the_pass():
    model = nn.Sequential(nn.Linear(96, 32), nn.Linear(32, 8))
    with pytest.warns(UserWarning, match="pass .quantize_linear. has nothing to act on: nothing was quantized"):
        _prepare(model, scheme="nf4")
    rec = effpass.report(model).records("quantize_linear")[0]
    assert [s["site"] for s in rec.skipped] == ["0", "1"] and "block_size=64" in rec.skipped[0]["reason"]
    assert all(type(m.weight) is nn.Parameter for m in model)


def test_dump_shows_scheme_bytes_and_kernel_per_module(tmp_path):
    case = model_case("llama", layers=1)
    effpass.compile(case.model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])], lowering="eager",
                    dump_dir=str(tmp_path))
    index = json.loads((tmp_path / "module" / "index.json").read_text())
    rec = next(r for r in index["passes"] if r["name"] == "quantize_linear")
    modules = rec["stats"]["modules"]
    assert len(modules) == 7 and "lm_head" not in modules
    entry = modules["model.layers.0.self_attn.q_proj"]
    assert entry["status"] == "quantized" and entry["scheme"] == "nf4" and entry["weight_type"] == "NF4WeightTensor"
    assert entry["bytes_before"] == 64 * 64 * 4 and 0 < entry["bytes_after"] < entry["bytes_before"] / 7
    assert entry["kernel"] == "nf4 pair-table dequantize+linear"


@pytest.mark.inductor
def test_inductor_matches_eager_int8():
    case = model_case("llama", layers=1)
    res = compile_and_compare(case, [QuantizeLinear(scheme="int8")], lowering="inductor", atol=1e-4, rtol=1e-4)
    assert res.report.stats("quantize_linear")["quantized"] == 8
    assert res.counters["graph_breaks"] == 0
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
# Triton kernel (int4; interpreted on CPU)
# ------------------------------------------------------------------------------------------------------
_TRITON_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.nn.functional as F
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import effpass
    from effpass.passes.quantize_linear import QuantizeLinear, dequantized_weight
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    effpass.prepare(torch.nn.Sequential(lin), passes=[QuantizeLinear(scheme="int4", group_size=32, kernel="triton",
                                                                     outlier_threshold=3.5)])
    x = torch.randn(3, 64, requires_grad=True)
    assert lin.weight.kernel_for(x.device) == "triton_int4_mm"
    y = lin(x)
    ref = F.linear(x, dequantized_weight(lin), lin.bias)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    gy = torch.randn_like(y)
    gx, = torch.autograd.grad(y, x, gy)
    gx_ref, = torch.autograd.grad(ref, x, gy)
    torch.testing.assert_close(gx, gx_ref, atol=1e-4, rtol=1e-4)
    # The custom op traces as one node (fake impl) and its registered backward works under compile.
    cq = torch.compile(lin, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 64, requires_grad=True)
    yc = cq(x)
    torch.testing.assert_close(yc, lin(x), atol=1e-5, rtol=1e-5)
    gc_, = torch.autograd.grad(yc.sum(), x)
    torch.testing.assert_close(gc_, torch.ones(5, 48) @ dequantized_weight(lin), atol=1e-4, rtol=1e-4)
    print("OK int4")
""")


def test_triton_int4_kernel_matches_reference_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK int4" in out.stdout


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_linears_on_gpu_bf16(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    _prepare(nn.Sequential(lin), scheme=scheme, outlier_threshold=3.5, **SCHEMES[scheme])
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if scheme == "int4":
        assert lin.weight.kernel_for(x.device) == "triton_int4_mm"
    y = lin(x)
    ref = F.linear(x, dequantized_weight(lin, torch.bfloat16), lin.bias)
    assert sqnr(ref, y) > 40
    gy = torch.randn_like(y)
    assert sqnr(torch.autograd.grad(ref, x, gy)[0], torch.autograd.grad(y, x, gy)[0]) > 40
    with torch.no_grad():  # decode shape
        x1 = x[:1].detach()
        assert sqnr(F.linear(x1, dequantized_weight(lin, torch.bfloat16), lin.bias), lin(x1)) > 40


def test_torchao_int4_needs_cuda_bf16():
    """torchao's tinygemm int4 is CUDA + bf16 only: elsewhere a clear error at prepare time, nothing quantized."""
    lin = nn.Linear(256, 384)
    w = lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"kernel='torchao' needs bf16 weights on CUDA.*torch.float32 on cpu"):
        _prepare(nn.Sequential(lin), scheme="int4", kernel="torchao")
    assert type(lin.weight) is nn.Parameter and torch.equal(lin.weight, w)


@pytest.mark.gpu
@needs_cuda
def test_torchao_int4_inference_on_gpu():
    """kernel='torchao': torchao's Int4TilePackedTo4dTensor, registered with the quantized-weight protocol
    (dequantize through its own matmul of the identity; bytes from its inner tensors)."""
    from effpass.quantized import dequantize, is_quantized, storage_bytes

    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    w = lin.weight.detach().clone()
    _prepare(nn.Sequential(lin), scheme="int4", kernel="torchao", group_size=128)
    assert type(lin.weight).__name__ == "Int4TilePackedTo4dTensor" and is_quantized(lin.weight)
    assert sqnr(w, dequantize(lin.weight, torch.bfloat16)) > 15
    assert storage_bytes(lin.weight) < 0.6 * w.numel()
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert sqnr(F.linear(x, dequantize(lin.weight, torch.bfloat16), lin.bias), lin(x)) > 40


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_supported(), reason="needs a GPU with compute capability >= 8.9")
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_fp8_scaled_mm_matches_emulation_on_gpu(granularity):
    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    real = _prepare(nn.Sequential(copy.deepcopy(lin)), scheme="fp8", fp8_granularity=granularity)[0]
    emu = _prepare(nn.Sequential(copy.deepcopy(lin)), scheme="fp8", fp8_granularity=granularity, fp8_emulate=True)[0]
    assert type(real) is Fp8Linear and not real.config.emulate and emu.config.emulate  # torchao's Float8Linear
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
    from effpass.passes import InjectLoRA

    targets = ["*.q_proj", "*.v_proj"]
    losses = {}
    for arm in ("fp32", "nf4"):
        case = model_case("llama", layers=1, seed=0)
        passes = [InjectLoRA(rank=8, targets=targets)]
        if arm == "nf4":
            passes.insert(0, QuantizeLinear(scheme="nf4"))
        torch.manual_seed(123)  # identical adapter initialisation in both arms
        compiled = effpass.compile(case.model, passes=passes, lowering="eager")
        trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), trainable
        losses[arm] = train_steps(compiled, case, 20, lr=1e-2)
        if arm == "nf4":
            qs = _quantized(case.model)
            assert len(qs) == 8 and all(type(m.weight) is NF4WeightTensor for m in qs.values())
            assert type(case.model.model.layers[0].self_attn.q_proj.base_layer.weight) is NF4WeightTensor
            loss = case.loss(compiled(**case.inputs))
            loss.backward()
            with_grad = [n for n, p in case.model.named_parameters() if p.grad is not None]
            assert with_grad and all("lora_" in n for n in with_grad)
    ref, q = torch.tensor(losses["fp32"]), torch.tensor(losses["nf4"])
    assert ref[-1] < ref[0] - 0.2 and q[-1] < q[0] - 0.2  # both learn
    # Tolerance: NF4's ~20 dB weight noise shifts the loss by much less than 2% over 20 steps here.
    assert ((q - ref).abs() / ref).max() < 0.02, (ref.tolist(), q.tolist())


# ------------------------------------------------------------------------------------------------------
# AOTAutograd's cache keys quantized weights (_stable_hash_for_caching)
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fresh_inductor_cache(tmp_path_factory):
    """One cache directory, empty when this session starts, for the three schemes: each scheme's first compile
    misses (its graph differs), and the kernels the three share (ReLU, the backward's sums) build once."""
    return str(tmp_path_factory.mktemp("inductor_cache"))


@pytest.mark.inductor
@pytest.mark.parametrize("scheme", ["int8", "nf4", "int4"])
def test_warm_aot_autograd_cache_hit_with_quantized_weights(scheme, fresh_inductor_cache, monkeypatch):
    """A second compile of the same model (after torch._dynamo.reset) hits AOTAutograd's cache, and no
    'does not implement _stable_hash_for_caching' warning is raised for effpass's formats."""
    import warnings

    import torch._functorch.config as fc
    import torch._inductor.config as ic
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", fresh_inductor_cache)
    x = torch.randn(4, 64, requires_grad=True)
    hits = []
    with warnings.catch_warnings(record=True) as caught, fc.patch(enable_autograd_cache=True), \
            ic.patch(fx_graph_cache=True):
        warnings.simplefilter("always")
        counters.clear()
        for _ in range(2):
            torch._dynamo.reset()
            torch.manual_seed(0)
            m = _prepare(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)), scheme=scheme,
                         **SCHEMES[scheme])
            assert type(m[0].weight) is WEIGHT_TYPE[scheme]
            torch.compile(m, backend="inductor")(x).sum().backward()
            hits.append(counters["aot_autograd"]["autograd_cache_hit"])
    torch._dynamo.reset()
    assert hits == [0, 1], dict(counters["aot_autograd"])
    assert not [w for w in caught if "_stable_hash_for_caching" in str(w.message)]
    w = m[0].weight
    assert w._stable_hash_for_caching() == copy.deepcopy(w)._stable_hash_for_caching()


def _saved_for_backward(monkeypatch, passes):
    """Compile a 1-layer Llama with ``passes`` (eager lowering), run one training step; return the
    partitioned forward's saved tensors as (is a parameter input, dtype, bytes), and the loss."""
    import torch._functorch.partitioners as P

    orig, saved = P.min_cut_rematerialization_partition, []

    def spy(joint, inputs, **kw):
        fw, bw = orig(joint, inputs, **kw)
        params = {n.name for n, f in zip([n for n in joint.graph.nodes if n.op == "placeholder"
                                          and n.name.startswith("primals")], flags[0]) if f}
        out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        for s in out[kw["num_fwd_outputs"]:]:
            v = s.meta.get("val")
            if isinstance(v, torch.Tensor):
                saved.append((s.op == "placeholder" and s.name in params, v.dtype, v.numel() * v.element_size()))
        return fw, bw

    flags = []
    import effpass.graph

    real_flags = effpass.graph.parameter_input_flags

    def keep(xs):
        flags.append(real_flags(xs))
        return flags[-1]

    monkeypatch.setattr(P, "min_cut_rematerialization_partition", spy)
    monkeypatch.setattr("effpass.backend.parameter_input_flags", keep)
    case = model_case("llama", layers=1, seq=64)
    ref = copy.deepcopy(case.model)
    torch.manual_seed(0)  # the adapters' initialisation
    m = effpass.compile(case.model, passes=passes, lowering="eager")
    loss = m(**case.inputs).loss
    loss.backward()
    torch.manual_seed(0)
    effpass.prepare(ref, passes=passes)  # the eager prepared model: the same function (reference semantics)
    ref_loss = ref(**case.inputs).loss
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = [(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters()) if a.requires_grad]
    assert grads and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in grads)
    return saved, loss, m


def test_qlora_backward_recomputes_dequantized_weights_instead_of_saving_them(monkeypatch):
    """QLoRA under compile: the forward saves no full-precision copy of a quantized weight for the backward
    (quantize_linear marks the dequantization MUST_RECOMPUTE in the joint graph): what it saves beyond the
    parameters is what fp32 LoRA saves (activations), within the few bytes of small quantized constants."""
    from effpass.passes import InjectLoRA, QuantizeLinear

    lora = lambda: InjectLoRA(rank=4, targets=["*.q_proj", "*.v_proj"])  # noqa: E731
    fp_saved, _, _ = _saved_for_backward(monkeypatch, [lora()])
    q_saved, loss, m = _saved_for_backward(monkeypatch, [QuantizeLinear(scheme="nf4"), lora()])
    activations = lambda s: sum(b for is_param, _, b in s if not is_param)  # noqa: E731
    assert activations(q_saved) <= activations(fp_saved) * 1.01, (activations(q_saved), activations(fp_saved))
    assert effpass.report(m).stats("quantize_linear")["dequant_recompute_nodes"] > 0
    assert torch.isfinite(loss)


def test_qlora_dequantized_weights_stay_recomputed_under_a_checkpoint_plan_that_saves_their_ops(monkeypatch):
    """checkpoint_activations' plan marks whole blocks (here every ``mul`` and ``t`` MUST_SAVE); it must not
    override quantize_linear's MUST_RECOMPUTE on the dequantization when quantize_linear's joint hook runs
    first, so the joint graph the partitioner gets still has every node the report counts as recomputed."""
    import torch._functorch.partitioners as P
    from torch.utils.checkpoint import CheckpointPolicy

    from effpass.passes import CheckpointActivations, InjectLoRA, QuantizeLinear

    orig, marks = P.min_cut_rematerialization_partition, []

    def spy(joint, inputs, **kw):
        marks.append(sum(n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE for n in joint.graph.nodes))
        return orig(joint, inputs, **kw)

    monkeypatch.setattr(P, "min_cut_rematerialization_partition", spy)
    case = model_case("llama", layers=1, seq=32)
    ref = copy.deepcopy(case.model)
    passes = lambda: [QuantizeLinear(scheme="nf4"), InjectLoRA(rank=4, targets=["*.q_proj", "*.v_proj"]),  # noqa: E731
                      CheckpointActivations(save_ops=("aten.mul", "aten.t"))]
    torch.manual_seed(0)
    m = effpass.compile(case.model, passes=passes(), lowering="eager")
    loss = m(**case.inputs).loss
    loss.backward()
    torch.manual_seed(0)
    effpass.prepare(ref, passes=passes())
    ref_loss = ref(**case.inputs).loss
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = [(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters()) if a.requires_grad]
    assert grads and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in grads)
    stats = effpass.report(m).stats("quantize_linear")
    assert stats["dequant_recompute_nodes"] > 0
    assert marks == [stats["dequant_recompute_nodes"]], (marks, stats["dequant_recompute_nodes"])


def test_nf4_fake_weight_is_quantized_in_one_chunk_with_the_same_bytes(monkeypatch):
    """The planner's fake NF4 weights skip torchao's memory-bounding chunks: same codes (real weights, chunk
    sizes compared), same inner shapes and dtypes (fake vs real), torchao's chunk size left as it was."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    from effpass.passes.quantize_linear import formats as qf

    mod = sys.modules[qf.to_nf4.__module__]
    w = torch.randn(256, 128)
    ref = qf.to_nf4_weight(w)
    monkeypatch.setattr(mod, "CHUNK_SIZE", 1000)  # many chunks on a real weight: the same codes
    small = qf.to_nf4_weight(w)
    assert torch.equal(small.quantized_data, ref.quantized_data)
    assert torch.equal(small.quantized_scalers, ref.quantized_scalers)
    seen = []
    real_q = mod.NF4Tensor.quantize_tensor_nearest
    monkeypatch.setattr(mod.NF4Tensor, "quantize_tensor_nearest",
                        staticmethod(lambda x, nf4: seen.append(x.numel()) or real_q(x, nf4)))
    with FakeTensorMode():
        fake = qf.to_nf4_weight(torch.empty(256, 128))
    assert seen == [256 * 128] and mod.CHUNK_SIZE == 1000  # one chunk, and restored
    for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        a, b = getattr(fake, name), getattr(ref, name)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
