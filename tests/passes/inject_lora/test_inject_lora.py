"""Tests of the ``inject_lora`` pass and the LoRA helpers (``effpass.passes.lora``)."""
from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
import torch.nn as nn

import effpass
from effpass.passes import InjectLoRA, lora
from effpass.testing import compile_and_compare, dynamo_counters, grads_of, model_case, train_steps

LLAMA_TARGETS = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]
GPT2_TARGETS = ["*.c_attn", "*.c_proj", "*.c_fc"]
TARGETS = {"llama": LLAMA_TARGETS, "gpt2": GPT2_TARGETS}
# adapters sharing an input per layer: llama q/k/v and gate/up; GPT-2's fused c_attn shares with nothing
GROUPS_PER_LAYER = {"llama": 2, "gpt2": 0}
ADAPTERS_PER_LAYER = {"llama": 7, "gpt2": 4}


def randomize_adapters(model: nn.Module, seed: int = 0) -> None:
    """B = 0 at init makes every parity check trivial: give the adapters random non-zero weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            for w in (m.lora_A.weight, m.lora_B.weight):
                w.copy_(torch.randn(w.shape, generator=g) * 0.1)


@functools.lru_cache(maxsize=None)
def plain_graph_breaks(name: str, layers: int) -> int:
    """Graph breaks of plain ``torch.compile`` on the unmodified model (forward and backward)."""
    case = model_case(name, layers=layers)
    torch._dynamo.reset()
    with dynamo_counters() as counters:
        torch.compile(case.model, backend="aot_eager")(**case.inputs).loss.backward()
    torch._dynamo.reset()
    return counters["graph_breaks"]


def prepared(name: str, layers: int = 2, **opts):
    case = model_case(name, layers=layers)
    effpass.prepare(case.model, passes=[InjectLoRA(targets=TARGETS[name], **opts)])
    randomize_adapters(case.model)
    return case


# ---------------------------------------------------------------------------------------------------
# module level
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_adapters_are_parameters_and_base_is_frozen(name):
    case = model_case(name)
    names_before = {n for n, _ in case.model.named_parameters()}
    effpass.prepare(case.model, passes=[InjectLoRA(rank=4, alpha=8, targets=TARGETS[name])])
    params = dict(case.model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    expected_adapters = ADAPTERS_PER_LAYER[name] * case.num_layers
    assert len(trainable) == 2 * expected_adapters
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in trainable)
    assert trainable <= set(case.model.state_dict())
    # the base weights are still there (under base_layer, as PEFT) and frozen
    assert len(params) - len(trainable) == len(names_before)
    mods = lora.lora_modules(case.model)
    assert all(torch.count_nonzero(m.lora_B.weight) == 0 for m in mods.values())  # B = 0 at init
    assert all(m.scaling == 2.0 for m in mods.values())
    stats = effpass.report(case.model).stats("inject_lora")
    assert stats["adapters"] == expected_adapters and sorted(stats["modules"]) == sorted(mods)
    assert stats["trainable_params"] == sum(params[n].numel() for n in trainable)
    assert stats["frozen_params"] == sum(p.numel() for n, p in params.items() if n not in trainable)
    assert stats["trainable_bytes"] == 4 * stats["trainable_params"]


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_eager_forward_is_base_plus_scaled_low_rank_update(kind, use_rslora):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    base = nn.Linear(16, 24) if kind == "linear" else Conv1D(24, 16)
    w = base.weight.detach().clone() if kind == "linear" else base.weight.detach().T.clone()  # [out, in]
    m = lora.LoRALinear(copy.deepcopy(base), rank=4, alpha=8, use_rslora=use_rslora)
    randomize_adapters(nn.Sequential(m))
    x = torch.randn(3, 5, 16)
    scaling = 8 / math.sqrt(4) if use_rslora else 8 / 4
    expected = x @ w.T + base.bias + scaling * (x @ m.lora_A.weight.T) @ m.lora_B.weight.T
    torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)
    assert m.scaling == scaling


def test_fused_qkv_projection_of_phi3():
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are plain nn.Linear: one adapter each, as PEFT does."""
    import peft
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = tf.Phi3ForCausalLM(cfg).eval()
    peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"]))
    effpass.prepare(model, passes=[InjectLoRA(rank=4, alpha=8, targets=["*.qkv_proj", "*.gate_up_proj"])])
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, lora.LoRALinear) and qkv.lora_B.weight.shape == (64 + 2 * 2 * 16, 4)
    randomize_adapters(model)
    _copy_adapters_to_peft(model, peft_model)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_exclude_leaves_modules_alone():
    case = model_case("llama")
    effpass.prepare(case.model, passes=[InjectLoRA(targets=["*.q_proj", "*.v_proj"], exclude=["model.layers.1"])])
    assert sorted(lora.lora_modules(case.model)) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]


def test_plain_state_dict_loads_into_adapted_model():
    case = model_case("llama")
    sd = copy.deepcopy(case.model.state_dict())
    effpass.prepare(case.model, passes=[InjectLoRA(targets=["*.q_proj"])])
    with torch.no_grad():
        case.model.model.layers[0].self_attn.q_proj.base_layer.weight.zero_()
    missing, unexpected = case.model.load_state_dict(sd, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    torch.testing.assert_close(case.model.model.layers[0].self_attn.q_proj.base_layer.weight,
                               sd["model.layers.0.self_attn.q_proj.weight"])


def test_quantized_base_contract():
    class FakeQuantLinear(nn.Module):
        __effpass_linear__ = True

        def __init__(self, lin):
            super().__init__()
            self.in_features, self.out_features = lin.in_features, lin.out_features
            self.register_buffer("qweight", torch.round(lin.weight.detach() * 64).to(torch.int8))
            self.register_buffer("scale", torch.tensor(1 / 64))

        def forward(self, x):
            return x @ (self.qweight.float() * self.scale).T

    model = nn.Sequential(FakeQuantLinear(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))
    effpass.prepare(model, passes=[InjectLoRA(rank=2, targets=["0"])])
    assert isinstance(model[0], lora.LoRALinear) and isinstance(model[0].base_layer, FakeQuantLinear)
    assert model[0].lora_A.weight.dtype == torch.float32
    randomize_adapters(model)
    x = torch.randn(3, 8)
    ref = model[0].base_layer(x) + 8.0 * model[0].lora_B(model[0].lora_A(x))
    torch.testing.assert_close(model[0](x), ref)
    with pytest.raises(ValueError, match="cannot merge"):
        lora.merge(model)
    assert InjectLoRA.run_after == ("quantize_linear",)


def test_error_when_model_has_no_linear():
    with pytest.raises(ValueError, match="no linear-like module"):
        effpass.prepare(nn.Sequential(nn.ReLU(), nn.Tanh()), passes=[InjectLoRA()])


def test_error_when_targets_match_no_linear_lists_linear_names():
    case = model_case("llama")
    with pytest.raises(effpass.TargetMatchError, match=r"'model\.layers\.0\.self_attn\.q_proj'"):
        effpass.prepare(case.model, passes=[InjectLoRA(targets=["*.qkv_proj"])])
    # a glob that matches only non-linear modules is an error too (it matches no linear)
    with pytest.raises(effpass.TargetMatchError, match="no linear"):
        effpass.prepare(model_case("llama").model, passes=[InjectLoRA(targets=["*.input_layernorm"])])


@pytest.mark.parametrize("opts, match", [({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"),
                                         ({"alpha": -1}, "alpha"), ({"init": "orthogonal"}, "init")])
def test_bad_options_are_rejected(opts, match):
    with pytest.raises(ValueError, match=match):
        InjectLoRA(**opts)


# ---------------------------------------------------------------------------------------------------
# graph level
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_matches_eager_and_shared_input_adapters_merge(name):
    case = prepared(name, layers=2 if name == "llama" else 1, rank=4)  # (GPT-2 compiles slower: 3 graphs)
    before = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    res = compile_and_compare(case, passes=[InjectLoRA(targets=TARGETS[name], rank=4)])
    # no graph break beyond the unmodified model's own (plain torch.compile breaks GPT-2 where transformers logs a
    # warning about its loss_type; effpass.compile sets loss_type for Hugging Face models, so none remain there)
    want = 0 if name == "gpt2" else plain_graph_breaks(name, case.num_layers)
    assert res.counters["graph_breaks"] == want and res.counters["recompiles"] == 0
    if name == "gpt2":
        assert plain_graph_breaks(name, case.num_layers) > 0  # the breaks effpass removes are really there
    stats = res.report.stats("inject_lora", graph="torch_ir")
    assert stats["adapters_in_graph"] == ADAPTERS_PER_LAYER[name] * case.num_layers
    assert stats["merged_groups"] == GROUPS_PER_LAYER[name] * case.num_layers
    recs = [r for r in res.report.records("inject_lora") if r.graph == "torch_ir"]
    delta = lambda op: sum(r.ops_after.get(op, 0) - r.ops_before.get(op, 0) for r in recs)  # noqa: E731
    assert delta("torch.cat") == stats["merged_groups"]
    assert delta("F.linear") == stats["merged_groups"] - stats["merged_adapters"]
    # gradients reach every adapter, and one SGD step changes adapters only
    assert set(res.compiled_grads) == {n for n, p in case.model.named_parameters() if p.requires_grad}
    assert all(g.abs().sum() > 0 for g in res.compiled_grads.values())
    changed = {n for n, p in res.compiled_params_after_step.items() if not torch.equal(p, before[n])}
    assert changed == set(res.compiled_grads)


def test_merge_shared_inputs_off_leaves_graph_alone():
    case = prepared("llama", layers=1)
    res = compile_and_compare(case, passes=[InjectLoRA(targets=LLAMA_TARGETS, merge_shared_inputs=False)])
    stats = res.report.stats("inject_lora", graph="torch_ir")
    assert stats["merged_groups"] == 0 and stats["adapters_in_graph"] == 7 * case.num_layers


def test_dropout_compiles_without_breaks_or_recompiles_and_skips_merging():
    case = model_case("llama", layers=1)
    case.model.train()
    passes = [InjectLoRA(targets=LLAMA_TARGETS, dropout=0.1)]
    torch._dynamo.reset()
    with dynamo_counters() as counters:
        compiled = effpass.compile(case.model, passes=passes, lowering="eager")
        losses = train_steps(compiled, case, 3, lr=1e-2)
    assert counters["graph_breaks"] == 0 and counters["recompiles"] == 0 and counters["unique_graphs"] == 1
    assert all(math.isfinite(v) for v in losses)
    rec = [r for r in effpass.report(compiled).records("inject_lora") if r.graph == "torch_ir"][-1]
    assert rec.stats["merged_groups"] == 0
    assert len(rec.skipped) == 7 * case.num_layers and all("dropout" in s["reason"] for s in rec.skipped)
    # plain torch.compile on the same prepared model: no more breaks than effpass
    torch._dynamo.reset()
    with dynamo_counters() as plain:
        # (a copy: effpass.compile compiled case.model in place, and wrapping it in torch.compile again is an error)
        train_steps(torch.compile(copy.deepcopy(case.model), backend="aot_eager"), case, 2)
    assert counters["graph_breaks"] <= plain["graph_breaks"]


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_lowering_matches_eager():
    case = prepared("llama", layers=1)  # one block: the merged groups count per layer, depth is not what is lowered
    res = compile_and_compare(case, passes=[InjectLoRA(targets=LLAMA_TARGETS)], lowering="inductor",
                              atol=1e-4, rtol=1e-4)
    assert res.report.stats("inject_lora", graph="torch_ir")["merged_groups"] == 2 * case.num_layers


# ---------------------------------------------------------------------------------------------------
# PEFT parity and interop
# ---------------------------------------------------------------------------------------------------
def _peft_model(base: nn.Module, name: str, **kw):
    import peft

    targets = [t.removeprefix("*.") for t in TARGETS[name]]
    cfg = peft.LoraConfig(r=kw.get("r", 8), lora_alpha=kw.get("alpha", 16), lora_dropout=0.0,
                          target_modules=targets, fan_in_fan_out=(name == "gpt2"),
                          use_rslora=kw.get("use_rslora", False))
    return peft.get_peft_model(base, cfg)


def _copy_adapters_to_peft(src: nn.Module, peft_model) -> None:
    pm = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, m in lora.lora_modules(src).items():
            for which in ("lora_A", "lora_B"):
                pm[f"base_model.model.{name}.{which}.default.weight"].copy_(getattr(m, which).weight)


@pytest.mark.parametrize("name, use_rslora", [("llama", False), ("gpt2", False), ("llama", True)])
def test_outputs_and_adapter_grads_match_peft(name, use_rslora):
    case = model_case(name)
    peft_model = _peft_model(copy.deepcopy(case.model), name, use_rslora=use_rslora)
    effpass.prepare(case.model, passes=[InjectLoRA(targets=TARGETS[name], use_rslora=use_rslora)])
    randomize_adapters(case.model)
    _copy_adapters_to_peft(case.model, peft_model)
    compiled = effpass.compile(case.model, passes=[InjectLoRA(targets=TARGETS[name])], lowering="eager")
    out, ref = compiled(**case.inputs), peft_model(**case.inputs)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    ours, theirs = grads_of(case.model), grads_of(peft_model)
    assert len(ours) == len(theirs) == 2 * ADAPTERS_PER_LAYER[name] * case.num_layers
    for n, g in ours.items():
        which = "lora_A" if ".lora_A." in n else "lora_B"
        peft_name = "base_model.model." + n.replace(f".{which}.weight", f".{which}.default.weight")
        torch.testing.assert_close(g, theirs[peft_name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_saved_adapter_loads_in_peft_and_reproduces_outputs(name, tmp_path):
    import peft

    case = model_case(name)
    base = copy.deepcopy(case.model)
    effpass.prepare(case.model, passes=[InjectLoRA(targets=TARGETS[name], rank=4, alpha=8)])
    randomize_adapters(case.model)
    lora.save(case.model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["fan_in_fan_out"] == (name == "gpt2")
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(loaded(**case.inputs).logits, case.model(**case.inputs).logits,
                                   atol=1e-5, rtol=1e-5)


def test_peft_saved_adapter_loads_into_effpass(tmp_path):
    case = model_case("llama")
    plain = copy.deepcopy(case.model)
    peft_model = _peft_model(case.model, "llama", r=4, alpha=8)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(str(tmp_path))
    names = lora.load(plain, tmp_path, trainable=True)
    assert len(names) == 7 * case.num_layers
    assert all(p.requires_grad == (".lora_" in n) for n, p in plain.named_parameters())
    compiled = effpass.compile(plain, passes=[], lowering="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(**case.inputs).logits, peft_model(**case.inputs).logits,
                                   atol=1e-5, rtol=1e-5)


def test_load_rejects_unsupported_config(tmp_path):
    case = prepared("llama")
    lora.save(case.model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["bias"] = "all"
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bias='all'"):
        lora.load(model_case("llama").model, tmp_path)


# ---------------------------------------------------------------------------------------------------
# merge / unmerge
# ---------------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.graphs, self.inputs = [], []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        self.inputs += list(example_inputs)
        return gm.forward


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_merge_keeps_outputs_and_unmerge_restores_weights(name):
    case = prepared(name, layers=1)
    weights = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    with torch.no_grad():
        ref = case.model(**case.inputs).logits
        assert lora.merge(case.model) == ADAPTERS_PER_LAYER[name] * case.num_layers
        merged = case.model(**case.inputs).logits
        torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5)
        changed = [n for n, p in case.model.named_parameters() if not torch.equal(p, weights[n])]
        assert changed and all(n.endswith("base_layer.weight") for n in changed)
        # a merged model compiles to a graph with no adapter ops: one linear/addmm per base module
        torch._dynamo.reset()
        rec = _Recorder()
        torch.compile(case.model, backend=rec)(**case.inputs)
        lora_ids = {id(p) for n, p in case.model.named_parameters() if ".lora_" in n}
        assert not any(id(x) in lora_ids for x in rec.inputs)
        n_linear = sum(1 for g in rec.graphs for n in g.graph.nodes if n.op == "call_function" and n.target in (
            torch._C._nn.linear, torch.addmm))
        n_base = sum(1 for m in case.model.modules() if lora.is_linear_like(m)) - 2 * len(lora.lora_modules(case.model))
        assert n_linear == n_base
        lora.unmerge(case.model)
        for n, p in case.model.named_parameters():
            torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(case.model(**case.inputs).logits, ref, atol=1e-5, rtol=1e-5)


def test_merge_in_bf16_is_within_dtype_rounding():
    case = model_case("llama")
    case.model.to(torch.bfloat16)
    effpass.prepare(case.model, passes=[InjectLoRA(targets=LLAMA_TARGETS)])
    assert all(m.lora_A.weight.dtype == torch.float32 for m in lora.lora_modules(case.model).values())
    randomize_adapters(case.model)
    with torch.no_grad():
        ref = case.model(**case.inputs).logits.float()
        lora.merge(case.model)
        merged = case.model(**case.inputs).logits.float()
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (merged - ref).pow(2).mean())
    assert sqnr > 30, f"merged bf16 output SQNR {sqnr:.1f} dB"


# ---------------------------------------------------------------------------------------------------
# composition with other passes
# ---------------------------------------------------------------------------------------------------
def test_dropout_composes_with_checkpoint_activations():
    """Dropout masks are drawn identically with and without checkpointing (no re-drawn mask on recompute),
    both match eager under the same seed, and neither graph-breaks."""
    from effpass.passes import CheckpointActivations

    grads = {}
    for arm, extra in (("plain", []), ("checkpointed", [CheckpointActivations(policy="full")])):
        case = model_case("llama", layers=1, train=True)
        torch._dynamo.reset()
        with dynamo_counters() as counters:
            compiled = effpass.compile(case.model, passes=[InjectLoRA(targets=LLAMA_TARGETS, dropout=0.2), *extra],
                                       lowering="eager")
            randomize_adapters(case.model)
            eager = copy.deepcopy(case.model)
            torch.manual_seed(5)
            out = compiled(**case.inputs)
            out.loss.backward()
            torch.manual_seed(5)
            ref = eager(**case.inputs)
            ref.loss.backward()
        assert counters["graph_breaks"] == 0 and counters["recompiles"] == 0
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
        grads[arm] = grads_of(case.model)
        for n, g in grads_of(eager).items():
            torch.testing.assert_close(grads[arm][n], g, atol=1e-5, rtol=1e-5)
    assert effpass.report(compiled).stats("checkpoint_activations")["marked_recompute"] > 0
    for n, g in grads["plain"].items():
        torch.testing.assert_close(grads["checkpointed"][n], g, atol=1e-6, rtol=1e-6)


def test_qlora_adapters_wrap_quantized_linears():
    from effpass.passes import QuantizeLinear

    case = model_case("llama", layers=1)
    passes = [InjectLoRA(targets=["*.q_proj", "*.v_proj"]), QuantizeLinear(scheme="int8", targets=["model.layers.*"])]
    effpass.prepare(case.model, passes=passes)  # the pipeline orders quantize_linear first
    mods = lora.lora_modules(case.model)
    assert len(mods) == 2 and all(getattr(m.base_layer, "__effpass_linear__", False) for m in mods.values())
    assert {n for n, p in case.model.named_parameters() if p.requires_grad} == {
        f"{n}.{w}.weight" for n in mods for w in ("lora_A", "lora_B")}
    # frozen bytes as storage holds them: the int8 layers' codes and scales, not 4 bytes per parameter
    from effpass.quantized import storage_bytes

    st = effpass.report(case.model).stats("inject_lora")
    frozen = [p for p in case.model.parameters() if not p.requires_grad]
    assert st["frozen_bytes"] == storage_bytes(frozen) < 4 * st["frozen_params"], st
    randomize_adapters(case.model)
    res = compile_and_compare(case, passes=passes, atol=1e-4, rtol=1e-4)
    assert res.report.stats("inject_lora", graph="torch_ir")["adapters_in_graph"] == 2
    assert all(g.abs().sum() > 0 for g in res.compiled_grads.values()) and len(res.compiled_grads) == 4


def test_dump_shows_adapters_and_composes_with_fuse_attention(tmp_path):
    from effpass.passes import FuseAttention

    case = prepared("llama", layers=1)
    res = compile_and_compare(case, passes=[InjectLoRA(targets=LLAMA_TARGETS), FuseAttention()],
                              dump_dir=str(tmp_path))
    assert res.report.stats("fuse_attention")["fused"] == 1
    assert res.report.stats("inject_lora", graph="torch_ir")["merged_groups"] == 2
    module_index = json.loads((tmp_path / "module" / "index.json").read_text())
    rec = next(r for r in module_index["passes"] if r["name"] == "inject_lora")
    # the pipeline was applied to an already prepared model: nothing new, every adapter listed as kept
    assert len(rec["skipped"]) == 7 and all("already" in s["reason"] for s in rec["skipped"])
    assert rec["stats"]["trainable_params"] > 0 and rec["stats"]["frozen_bytes"] > 0
    graph_index = json.loads(next(tmp_path.glob("graph_*/index.json")).read_text())
    rec = next(r for r in graph_index["passes"] if r["name"] == "inject_lora")
    assert rec["changed"] and rec["stats"]["merged_adapters"] == 5


def test_dump_lists_adapted_modules(tmp_path):
    case = model_case("gpt2", layers=1)
    effpass.prepare(case.model, passes=[InjectLoRA(targets=["*.c_attn"])], dump_dir=str(tmp_path))
    rec = next(r for r in json.loads((tmp_path / "module" / "index.json").read_text())["passes"]
               if r["name"] == "inject_lora")
    assert rec["stats"]["modules"] == ["transformer.h.0.attn.c_attn"] and rec["stats"]["adapters"] == 1
