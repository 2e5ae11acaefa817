"""Quantized MoE expert weights (``quantize_linear`` with ``experts=True``, issue 24.3): int8 and NF4 (double
quantization) for every expert layout transformers 5 uses, on eight MoE families built from configs and a
self-written MoE. Oracles: numerics against the same model holding the dequantized expert weights (forward
and input gradients), SQNR against fp32; structure: every 3-D expert tensor replaced, bytes before/after as
storage holds them, the layout detected."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effpass
from effpass.passes import QuantizeLinear
from effpass.quantized import dequantize, is_quantized, storage_bytes

transformers = pytest.importorskip("transformers")

_D = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=64)
#: family -> (config class, model class, config kwargs, experts module path, transposed layout)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_D, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       intermediate_size=128, decoder_sparse_step=1), "model.layers.0.mlp.experts", False),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_D, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
                "model.layers.0.mlp.experts", False),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_D, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["full_attention"], sliding_window=8), "model.layers.0.mlp.experts", True),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(_D, head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=1, moe_layers=[0], no_rope_layers=[1]),
               "model.layers.0.feed_forward.experts", True),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_D, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
                         n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                         qk_nope_head_dim=16, v_head_dim=16), "model.layers.0.mlp.experts", False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_D, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1), "model.layers.0.mlp.experts",
                  False),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_D, intermediate_size=64, num_experts=4, num_experts_per_tok=2, eos_token_id=0, pad_token_id=1),
              "model.layers.0.mlp.experts", False),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(_D, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
                   "model.layers.0.block_sparse_moe.experts", False),
}
# Floors (dB): per expert weight vs fp32 (as for linears: int8 per-row >= 40, 4-bit blocks of 64 >= 19), and
# whole-model logits vs fp32 on these 1-layer random models (measured 44.5-48.2 int8, 20.6-24.3 NF4).
WEIGHT_FLOOR = {"int8": 40.0, "nf4": 19.0}
LOGIT_FLOOR = {"int8": 35.0, "nf4": 15.0}
BYTES_PER_PARAM = {"int8": (1.0, 1.07), "nf4": (0.5, 0.53)}  # int8: + one fp32 scale per row of 64


def build(name):
    cfg_cls, model_cls, kw, path, transposed = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids}, path, transposed


def with_dequantized_experts(model):
    """A copy of the prepared model whose expert weights are plain tensors holding the dequantized values
    (the reference the quantized model must reproduce)."""
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if is_quantized(p) and p.dim() == 3:
                setattr(mod, pname, nn.Parameter(dequantize(p), requires_grad=False))
    return ref


def check_experts(model, inputs, expert_paths, scheme, transposed, fp_model):
    stats = effpass.report(model).stats("quantize_linear")
    entries = {k: v for k, v in stats["modules"].items() if v["kind"] == "experts"}
    expected = set()
    for path in expert_paths:
        mod = model.get_submodule(path)
        orig = fp_model.get_submodule(path)
        for pname, p0 in orig.named_parameters(recurse=False):
            if p0.dim() != 3:
                continue
            full = f"{path}.{pname}"
            expected.add(full)
            p = getattr(mod, pname)
            # structural: replaced, same logical shape and dtype, the layout found, bytes as storage holds them
            assert type(p).__name__ == "ExpertsWeightTensor" and is_quantized(p), full
            assert p.shape == p0.shape and p.dtype == p0.dtype and p.scheme == scheme and p.transposed == transposed
            e = entries[full]
            assert e["status"] == "quantized" and e["scheme"] == scheme and e["experts"] == p0.shape[0]
            assert e["bytes_before"] == p0.numel() * 4 == storage_bytes(p0)
            lo, hi = BYTES_PER_PARAM[scheme]
            assert lo * p0.numel() <= e["bytes_after"] <= hi * p0.numel() + 64, (full, e["bytes_after"])
            assert e["bytes_after"] <= storage_bytes(p)  # the shared NF4 code table is counted once
            # numerics per expert weight, and the contract's dequantize (3-D and one expert)
            deq = dequantize(p)
            assert type(deq) is torch.Tensor and deq.shape == p0.shape
            for k in range(p0.shape[0]):
                from effpass.passes.quantize_linear import sqnr

                assert sqnr(p0[k], deq[k]) > WEIGHT_FLOOR[scheme], (full, k)
                assert torch.equal(dequantize(p[k]), deq[k])
    assert expected and expected == {k for k, v in entries.items() if v["status"] == "quantized"}
    assert stats["quantized_expert_tensors"] == len(expected)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_experts_of_every_family_quantized(name, scheme):
    model, inputs, path, transposed = build(name)
    fp_model = copy.deepcopy(model)
    with torch.no_grad():
        fp_logits = model(**inputs).logits
    effpass.prepare(model, passes=[QuantizeLinear(scheme=scheme, exclude=["lm_head"])])
    check_experts(model, inputs, [path], scheme, transposed, fp_model)
    ref = with_dequantized_experts(model)
    # numerics: forward equals the model holding the dequantized experts; input gradients too (the autograd
    # functions dequantize again in backward); vs fp32 within the floor.
    emb_q = model.get_input_embeddings().weight
    emb_r = ref.get_input_embeddings().weight
    emb_q.requires_grad_(True)
    emb_r.requires_grad_(True)
    out_q, out_r = model(**inputs).logits, ref(**inputs).logits
    torch.testing.assert_close(out_q, out_r, rtol=1e-5, atol=1e-5)
    out_q.square().mean().backward()
    out_r.square().mean().backward()
    torch.testing.assert_close(emb_q.grad, emb_r.grad, rtol=1e-4, atol=1e-6)
    from effpass.passes.quantize_linear import sqnr

    assert sqnr(fp_logits, out_q.detach()) > LOGIT_FLOOR[scheme]


def test_experts_bytes_before_after_and_state_dict_round_trip():
    model, inputs, path, _ = build("qwen3_moe")
    before = sum(storage_bytes(p) for n, p in model.named_parameters() if ".experts." in n)
    effpass.prepare(model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])])
    after = storage_bytes([p for n, p in model.named_parameters() if ".experts." in n])
    stats = effpass.report(model).stats("quantize_linear")
    ex = [v for v in stats["modules"].values() if v["kind"] == "experts"]
    assert sum(v["bytes_before"] for v in ex) == before == (4 * 128 * 64 + 4 * 64 * 64) * 4
    # the shared 16-value NF4 code table (64 B) is counted once per model, here in a linear before the experts
    assert sum(v["bytes_after"] for v in ex) == after - 64 and after < before / 7.5  # NF4: ~0.52 B/param vs 4
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh, _, _, _ = build("qwen3_moe")
    effpass.prepare(fresh, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])])
    fresh.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, fresh(**inputs).logits)


# ------------------------------------------------------------------------------------------------------
# a self-written MoE in plain PyTorch: routed experts (3-D, per-expert F.linear) beside a shared expert
# ------------------------------------------------------------------------------------------------------
class TinyExperts(nn.Module):
    def __init__(self, n, hidden, inter):
        super().__init__()
        self.num_experts = n
        self.w_in = nn.Parameter(torch.randn(n, inter, hidden) * 0.1)
        self.w_out = nn.Parameter(torch.randn(n, hidden, inter) * 0.1)

    def forward(self, x, idx, wts):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                h = F.linear(F.gelu(F.linear(x[tok], self.w_in[e])), self.w_out[e])
                out.index_add_(0, tok, h * wts[tok, slot, None])
        return out


class TinyMoE(nn.Module):
    def __init__(self, n=4, hidden=64, inter=128):
        super().__init__()
        self.router = nn.Linear(hidden, n, bias=False)
        self.experts = TinyExperts(n, hidden, inter)
        self.shared = nn.Sequential(nn.Linear(hidden, inter), nn.GELU(), nn.Linear(inter, hidden))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        wts, idx = probs.topk(2, dim=-1)
        return self.experts(x, idx, wts) + self.shared(x)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_self_written_moe(scheme):
    torch.manual_seed(0)
    model = TinyMoE()
    fp = copy.deepcopy(model)
    x = torch.randn(16, 64)
    effpass.prepare(model, passes=[QuantizeLinear(scheme=scheme, exclude=["router"])])
    check_experts(model, {}, ["experts"], scheme, False, fp)
    stats = effpass.report(model).stats("quantize_linear")
    assert stats["quantized"] == 2 and "router" not in stats["modules"]  # the shared expert's two linears
    assert type(model.router.weight) is nn.Parameter  # excluded: routing unchanged
    ref = with_dequantized_experts(model)
    xq, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yq, yr = model(xq), ref(xr)
    torch.testing.assert_close(yq, yr, rtol=1e-5, atol=1e-6)
    yq.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(xq.grad, xr.grad, rtol=1e-4, atol=1e-6)


def test_int4_experts_are_skipped_with_the_reason():
    model, _, path, _ = build("mixtral")
    effpass.prepare(model, passes=[QuantizeLinear(scheme="int4", group_size=32, exclude=["lm_head"])])
    stats = effpass.report(model).stats("quantize_linear")
    e = stats["modules"][f"{path}.gate_up_proj"]
    assert e["status"] == "skipped" and "use scheme='int8' or 'nf4'" in e["reason"]
    assert type(model.get_submodule(path).gate_up_proj) is nn.Parameter


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("llama4", marks=pytest.mark.slow)])  # F.linear; bmm
def test_compiled_matches_eager_with_nf4_experts(name):
    """Under torch.compile the experts' overrides run eagerly (the data-dependent experts loop breaks the graph
    anyway): compiled logits equal the prepared eager model's, and the backward runs."""
    model, inputs, path, _ = build(name)
    ref = copy.deepcopy(model)
    effpass.prepare(ref, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])])
    compiled = effpass.compile(model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"])], lowering="eager")
    out = compiled(**inputs).logits
    assert type(model.get_submodule(path).down_proj).__name__ == "ExpertsWeightTensor"
    with torch.no_grad():
        torch.testing.assert_close(out, ref(**inputs).logits, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
