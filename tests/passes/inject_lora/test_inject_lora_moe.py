"""LoRA on MoE expert tensors (issue 24): PEFT ``target_parameters`` parity, interop, compile, bad input.

Families with different expert layouts: Qwen3-MoE / Mixtral / OLMoE (fused gate_up (E, 2I, H)), Qwen2-MoE
(plus a shared expert), GPT-OSS (transposed (E, H, 2I) with biases, interleaved gate/up, its own gate),
Llama 4 (dense bmm over all experts, transposed, no ``is_transposed`` flag, a shared expert), and a
self-written MoE in plain PyTorch (transposed with biases, its own per-expert loop).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import effpass
from effpass.passes import InjectLoRA, lora
from effpass.testing import dynamo_counters

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from _families import family_case  # noqa: E402

HF_MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "llama4")
EXPERT_TARGETS = ["*.experts.gate_up_proj", "*.experts.down_proj"]
TARGETS = [*EXPERT_TARGETS, "*.q_proj"]


# ------------------------------------------------------------------------------------------------------
# a self-written MoE in plain PyTorch: transposed expert storage with biases, a per-expert loop forward
# ------------------------------------------------------------------------------------------------------
class TinyExperts(nn.Module):
    has_gate, has_bias, is_transposed = True, True, True  # the layout flags effpass reads

    def __init__(self, n=4, hidden=16, inter=24):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.randn(n, hidden, 2 * inter) * 0.2)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(n, 2 * inter) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(n, inter, hidden) * 0.2)
        self.down_proj_bias = nn.Parameter(torch.randn(n, hidden) * 0.1)
        self.act_fn = nn.SiLU()

    def _apply_gate(self, h):
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            h = self._apply_gate(x[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
            h = h @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, tok, h * top_k_weights[tok, pos, None])
        return out


class TinyMoE(nn.Module):
    def __init__(self, vocab=64, hidden=16, top_k=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.q_proj = nn.Linear(hidden, hidden)
        self.router = nn.Linear(hidden, 4, bias=False)
        self.experts = TinyExperts(hidden=hidden)
        self.head = nn.Linear(hidden, vocab)
        self.top_k = top_k

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        h = h + self.q_proj(h)
        flat = h.reshape(-1, h.shape[-1])
        probs = self.router(flat).float().softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        h = h + self.experts(flat, idx, w / w.sum(-1, keepdim=True)).view_as(h)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
        return loss, logits


def _case(name):
    if name == "tiny":
        torch.manual_seed(0)
        model = TinyMoE()
        ids = torch.randint(0, 64, (2, 8))
        return model, {"input_ids": ids, "labels": ids}
    c = family_case(name)
    return c.model, c.inputs


def _loss_logits(out):
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.loss, out.logits


def _perturb(model):
    """Non-zero B so the adapters change the function (B starts at zero)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for ad in lora.expert_lora_modules(model).values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.1)
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _targets(name):
    return ["experts.gate_up_proj", "experts.down_proj", "q_proj"] if name == "tiny" else TARGETS


@pytest.mark.parametrize("name", [*HF_MOE, "tiny"])
def test_expert_lora_matches_peft_target_parameters(name, tmp_path):
    """Outputs, loss and every adapter gradient equal PEFT's target_parameters LoRA (fp32, 1e-5 relative);
    effpass's saved adapter is what PEFT loads."""
    model, inputs = _case(name)
    base = copy.deepcopy(model)
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=_targets(name))])
    stats = effpass.report(model).stats("inject_lora")
    experts = lora.expert_lora_modules(model)
    assert experts and all(n.rsplit(".", 1)[1] in ("gate_up_proj", "down_proj") for n in experts)
    _perturb(model)
    lora.save(model, tmp_path)
    pm = peft.PeftModel.from_pretrained(base, tmp_path, is_trainable=True)

    loss, logits = _loss_logits(model(**inputs))
    p_loss, p_logits = _loss_logits(pm(**inputs))
    assert _rel(logits, p_logits) < 1e-5 and _rel(loss, p_loss) < 1e-5
    loss.backward()
    p_loss.backward()
    p_params = dict(pm.named_parameters())
    for stem, (full, ad) in lora._peft_expert_keys(model).items():
        ga = ad.lora_A.grad.reshape(ad.n_experts * ad.rank, -1)
        gb = ad.lora_B.grad.permute(1, 2, 0).reshape(ad.lora_B.shape[1], -1)
        pa = p_params[f"base_model.model.{stem}.lora_A.default.weight"].grad
        pb = p_params[f"base_model.model.{stem}.lora_B.default.weight"].grad
        assert _rel(ga, pa) < 1e-5 and _rel(gb, pb) < 1e-5, full
        assert pb.abs().max() > 0
    assert stats["expert_adapters"] == len(experts)
    keyed = lora._peft_expert_keys(model).values()   # (full parameter name, adapter) per adapted expert tensor
    assert sorted(stats["expert_parameters"]) == sorted(full for full, _ in keyed) and len(keyed) == len(experts)
    assert stats["expert_adapter_params"] == sum(ad.lora_A.numel() + ad.lora_B.numel() for _, ad in keyed) > 0
    assert stats["delta_weight_bytes_avoided"] == sum(
        getattr(m, a).numel() * 4 for m, a, _ in lora.expert_parameters(model).values() if a in ("gate_up_proj", "down_proj"))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "llama4"])
def test_peft_saved_expert_adapter_loads_into_effpass(name, tmp_path):
    model, inputs = _case(name)
    base = copy.deepcopy(model)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    pm = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp_path)
    ref = _loss_logits(pm(**inputs))[1]
    names = lora.load(model, tmp_path)
    assert sum(n.endswith("gate_up_proj") for n in names) >= 1
    assert _rel(_loss_logits(model(**inputs))[1], ref) < 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "llama4", "tiny"])
def test_expert_lora_compiles_without_breaks_or_routing_recompiles(name):
    """effpass.compile equals the eager prepared model; new routings neither break the graph nor recompile."""
    model, inputs = _case(name)
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=_targets(name))])
    _perturb(model)
    ref_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[InjectLoRA(rank=4, alpha=8, targets=_targets(name))], lowering="eager")
    with dynamo_counters() as c:
        for seed in range(3):  # different tokens: different experts chosen
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, 60, inputs["input_ids"].shape, generator=g)
            batch = {"input_ids": ids, "labels": ids}
            loss, logits = _loss_logits(compiled(**batch))
            r_loss, r_logits = _loss_logits(ref_model(**batch))
            assert _rel(logits, r_logits) < 1e-5
            loss.backward()
            r_loss.backward()
    assert c["graph_breaks"] == 0 and c["recompiles"] == 0 and c["unique_graphs"] == 1, c
    ex, r_ex = lora.expert_lora_modules(model), lora.expert_lora_modules(ref_model)
    for n in ex:
        assert _rel(ex[n].lora_A.grad, r_ex[n].lora_A.grad) < 1e-4


def test_expert_lora_never_allocates_a_delta_weight():
    """Structural: the traced training step holds no tensor of an expert weight's shape other than the
    weights themselves (PEFT's ParamWrapper adds an (E, d1, d2) delta per adapted tensor and forward)."""
    model, inputs = _case("qwen3_moe")
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=EXPERT_TARGETS)])
    shapes = {tuple(ad_w.shape) for n, (m, a, _) in lora.expert_parameters(model).items()
              for ad_w in [getattr(m, a)]}
    seen = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and tuple(t.shape) in shapes:
                    seen.append(func)
            return out
    with Watch():
        _loss_logits(model(**inputs))[0].backward()
    assert seen == [], seen
    # and PEFT does allocate them (the oracle can fail)
    base, _ = _case("qwen3_moe")
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_parameters=["experts.gate_up_proj"]))
    seen.clear()
    with Watch():
        _loss_logits(pm(**inputs))[0].backward()
    assert seen


def test_router_aux_loss_equals_eager_and_trainer_save(tmp_path):
    """Mixtral's load-balancing loss with expert adapters: compiled equals eager; save_pretrained writes
    PEFT's target_parameters adapter."""
    c = family_case("mixtral")
    model = c.model
    model.config.output_router_logits = True
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=EXPERT_TARGETS)])
    _perturb(model)
    ref = copy.deepcopy(model)
    compiled = effpass.compile(model, passes=[InjectLoRA(rank=4, alpha=8, targets=EXPERT_TARGETS)], lowering="eager")
    out, r_out = compiled(**c.inputs), ref(**c.inputs)
    assert out.aux_loss is not None and _rel(out.aux_loss, r_out.aux_loss) < 1e-6
    assert _rel(out.loss, r_out.loss) < 1e-5
    model.save_pretrained(tmp_path)
    import json
    cfg = json.load(open(tmp_path / "adapter_config.json"))
    assert cfg["target_parameters"] and all(t.endswith(("gate_up_proj", "down_proj")) for t in cfg["target_parameters"])


def test_expert_lora_with_checkpointing_and_fused_cross_entropy():
    from effpass.passes import CheckpointActivations, FuseCrossEntropy
    c = family_case("qwen3_moe")
    effpass.prepare(c.model, passes=[InjectLoRA(rank=4, alpha=8, targets=TARGETS)])
    _perturb(c.model)
    ref = copy.deepcopy(c.model)
    compiled = effpass.compile(c.model, passes=[InjectLoRA(rank=4, alpha=8, targets=TARGETS),
                                                CheckpointActivations(), FuseCrossEntropy()], lowering="eager")
    loss, r_loss = compiled(**c.inputs).loss, ref(**c.inputs).loss
    assert _rel(loss, r_loss) < 1e-5
    loss.backward()
    r_loss.backward()
    ex, r_ex = lora.expert_lora_modules(c.model), lora.expert_lora_modules(ref)
    for n in ex:
        assert _rel(ex[n].lora_B.grad, r_ex[n].lora_B.grad) < 1e-4
    rep = effpass.report(c.model)
    assert rep.stats("fuse_cross_entropy")


def test_merge_unmerge_experts():
    model, inputs = _case("gpt_oss")
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=EXPERT_TARGETS)])
    _perturb(model)
    ref = _loss_logits(model(**inputs))[1]
    w0 = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    assert lora.merge(model) == 2
    assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, w0)
    assert _rel(_loss_logits(model(**inputs))[1], ref) < 1e-5
    lora.unmerge(model)
    assert torch.allclose(model.model.layers[0].mlp.experts.gate_up_proj, w0, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------------
def test_expert_lora_rejects_dropout():
    model, _ = _case("qwen3_moe")
    with pytest.raises(ValueError, match=r"dropout=0.1 on expert parameter 'model.layers.0.mlp.experts.gate_up_proj'"):
        effpass.prepare(model, passes=[InjectLoRA(rank=4, dropout=0.1, targets=EXPERT_TARGETS)])


def test_expert_lora_rejects_rank_above_expert_dims():
    model, _ = _case("qwen3_moe")
    with pytest.raises(ValueError, match=r"rank 64 on expert parameter .*down_proj.*larger than the expert's dimensions"):
        effpass.prepare(model, passes=[InjectLoRA(rank=64, targets=["*.experts.down_proj"])])


class OddExperts(nn.Module):
    """3-D expert weights with a forward effpass does not know (no layout flags)."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.w = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):
        return torch.einsum("td,edf->tf", x, self.w)


def test_expert_lora_rejects_unknown_layout():
    model = nn.Sequential(nn.Linear(8, 8), OddExperts())
    with pytest.raises(ValueError, match=r"'1.w' of OddExperts \(layout unknown.*Supported expert layouts: routed"):
        effpass.prepare(model, passes=[InjectLoRA(rank=2, targets=["*.w", "0"])])


def test_routers_are_fp32_islands_under_autocast():
    """apply_autocast(fp32_routers=True) keeps each MoE router (gate/router beside experts) in fp32: its logits are fp32 and the
    compiled step equals the eager prepared model; expert adapters train under bf16 autocast."""
    from effpass.passes import ApplyAutocast
    c = family_case("qwen3_moe")
    passes = [InjectLoRA(rank=4, alpha=8, targets=TARGETS), ApplyAutocast(dtype=torch.bfloat16, fp32_routers=True)]
    effpass.prepare(c.model, passes=passes)
    st = effpass.report(c.model).stats("apply_autocast")
    assert "model.layers.0.mlp.gate" in st["island_modules"]
    seen = {}
    def hook(mod, args, out):
        seen["dtype"] = out[0].dtype

    c.model.model.layers[0].mlp.gate.register_forward_hook(hook)
    _perturb(c.model)
    ref = copy.deepcopy(c.model)
    compiled = effpass.compile(c.model, passes=passes, lowering="eager")
    out, want = compiled(**c.inputs), ref(**c.inputs)
    assert seen["dtype"] == torch.float32
    assert _rel(out.loss.float(), want.loss.float()) < 1e-3
    out.loss.backward()
    assert all(ad.lora_B.grad is not None for ad in lora.expert_lora_modules(c.model).values())


def test_expert_lora_on_int8_quantized_experts():
    """QLoRA-style: quantize_linear's int8 expert tensors stay quantized; the adapters wrap them and the
    output equals the same adapters on the dequantized weights (compiled too)."""
    from effpass.passes import QuantizeLinear
    c = family_case("qwen3_moe")
    passes = [QuantizeLinear(scheme="int8"), InjectLoRA(rank=4, alpha=8, targets=EXPERT_TARGETS)]
    effpass.prepare(c.model, passes=passes)
    experts = c.model.model.layers[0].mlp.experts
    assert type(experts.gate_up_proj) is not nn.Parameter  # a quantized tensor subclass
    _perturb(c.model)
    plain = copy.deepcopy(c.model)
    for m in plain.modules():
        for a in ("gate_up_proj", "down_proj"):
            w = getattr(m, a, None)
            if isinstance(w, torch.Tensor) and type(w) is not nn.Parameter:
                setattr(m, a, nn.Parameter(w.dequantize().detach(), requires_grad=False))
    out, want = c.model(**c.inputs), plain(**c.inputs)
    assert _rel(out.logits, want.logits) < 1e-5
    compiled = effpass.compile(c.model, passes=passes, lowering="eager")
    assert _rel(compiled(**c.inputs).logits, want.logits) < 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "gpt_oss"])   # GPT-OSS: attention sinks too
def test_packed_moe_with_expert_lora_equals_each_example_alone(name):
    """pack_sequences on an MoE model with expert adapters: routing is per token, attention per example,
    so each packed example's logits equal the example run alone (eager prepared model)."""
    from effpass.passes import FuseAttention, PackSequences
    c = family_case(name)
    model = c.model
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=TARGETS)])
    _perturb(model)
    ref = copy.deepcopy(model)
    lens = [5, 9, 3]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    compiled = effpass.compile(model, passes=[InjectLoRA(rank=4, alpha=8, targets=TARGETS), FuseAttention(),
                                              PackSequences()], lowering="eager")
    with torch.no_grad():
        out = compiled(input_ids=ids, position_ids=pos).logits
        s = 0
        for n in lens:
            want = ref(input_ids=ids[:, s:s + n]).logits
            assert _rel(out[:, s:s + n], want) < 1e-5
            s += n
    assert effpass.report(compiled).stats("pack_sequences")["skipped"] == 0
