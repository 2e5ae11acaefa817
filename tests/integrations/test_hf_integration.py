"""effpass as a drop-in for Hugging Face training: compile in place, Trainer, TRL's SFTTrainer, PEFT adapters,
accelerate, per-model reports (effpass/integrations/huggingface.py, effpass/api.py).

Every Trainer here is real (transformers, TRL, PEFT; tokenizers built offline) and runs on tiny random
Llama models with ``lowering="eager"`` (the same passes, without Inductor) to stay fast.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os

import pytest
import torch

import effpass
from effpass.pass_api import _REGISTRY
from effpass.passes import FuseAttention, InjectLoRA, QuantizeLinear, ScaleLoss
from effpass.testing import dynamo_counters, model_case
from effpass.testing.hf import lm_dataset, text_dataset, tiny_tokenizer

transformers = pytest.importorskip("transformers")
from _paths import ROOT  # noqa: E402  (the repository's root)
LORA = dict(rank=4, alpha=8, targets=["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"])


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield


def _args(out, **kw):
    base = dict(max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                report_to=[], seed=0, save_strategy="no", use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(str(out), **base)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _model(passes, *, compiled: bool, seed: int = 0, layers: int = 1, **case_kw):
    """The same tiny Llama (and the same adapter initialisation) compiled by effpass or only prepared (the
    eager reference: after effpass.prepare the eager model computes what the compiled one does)."""
    torch.manual_seed(seed)
    model = model_case("llama", seed=seed, layers=layers, **case_kw).model
    torch.manual_seed(seed + 100)
    if compiled:
        return effpass.compile(model, passes=passes, lowering="eager")
    return effpass.prepare(model, passes=passes, lowering="eager")


# ------------------------------------------------------------------------------------------------------
# 1. compile in place
# ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compile_in_place_returns_the_model_itself():
    case = model_case("llama")
    model, config = case.model, case.model.config
    signature = inspect.signature(model.forward)
    out = effpass.compile(model, passes=[InjectLoRA(**LORA), FuseAttention()], lowering="eager")
    assert out is model and type(out) is transformers.LlamaForCausalLM
    assert inspect.signature(out.forward) == signature and out.config is config
    # module phase first: the adapters exist (and are in state_dict, under the model's own names) before any call
    keys = list(out.state_dict())
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in keys and not any(k.startswith("_orig_mod") for k in keys)
    assert out.to("cpu") is out
    eager = copy.deepcopy(out)  # a copy is the eager prepared model (not a second handle on the compiled code)
    assert eager._compiled_call_impl is None
    with dynamo_counters() as c:
        got = out(**case.inputs).logits
    assert c["frames"] == 1 and c["graph_breaks"] == 0
    torch.testing.assert_close(got, eager(**case.inputs).logits, atol=1e-5, rtol=1e-5)
    assert effpass.report(out).stats("fuse_attention")["fused"] == 2
    # generate goes through the compiled model (a new graph per decoding shape) and matches eager
    prompt = case.inputs["input_ids"][:1, :4]
    n = len(effpass.report(out).graphs)
    gen = out.generate(prompt, max_new_tokens=1, do_sample=False)
    assert torch.equal(gen, eager.generate(prompt, max_new_tokens=1, do_sample=False))
    assert len(effpass.report(out).graphs) > n


@pytest.fixture
def _registry():
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_default_pipeline_is_chosen_per_graph_from_its_inputs(_registry):
    @effpass.register_pass("count_ops_in_float64")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CountOpsInFloat64(effpass.Pass):
        @classmethod
        def enabled_by_default(cls, device=None, dtype=None):
            return dtype == torch.float64

        def transform_torch_ir(self, gm, ctx):
            return effpass.PassResult(False, {"nodes": len(gm.graph.nodes)})

    case = model_case("demo")
    model = effpass.compile(case.model, lowering="eager")  # the default pipeline, decided per graph
    model(**case.inputs)
    model.to(torch.float64)  # after compiling: the next graph's inputs are float64
    model(**case.inputs)
    graphs = effpass.report(model).graphs
    assert len(graphs) == 2
    assert [{r.name for r in g.records} for g in graphs] == [{"fuse_attention", "fuse_cross_entropy"}, {"fuse_attention", "fuse_cross_entropy", "count_ops_in_float64"}]


# ------------------------------------------------------------------------------------------------------
# 6. reports per model
# ------------------------------------------------------------------------------------------------------
def test_report_covers_each_model_however_compiled_and_only_that_model():
    opts = {"lowering": "eager", "passes": {"fuse_attention": {}}}
    a, b, c = model_case("demo", layers=2), model_case("demo", layers=3), model_case("llama")
    ca = torch.compile(a.model, backend="effpass", options=opts)   # the same options: one shared backend
    cb = torch.compile(b.model, backend="effpass", options=opts)
    c.model.compile(backend="effpass", options=opts)               # nn.Module.compile, in place
    ca(**a.inputs), cb(**b.inputs), c.model(**c.inputs)
    reports = [effpass.report(m) for m in (ca, cb, c.model)]
    assert [len(r.graphs) for r in reports] == [1, 1, 1]
    assert len({id(r.graphs[0]) for r in reports}) == 3
    assert effpass.report(a.model).graphs[0] is reports[0].graphs[0]  # the model or its OptimizedModule
    for r, case in zip(reports, (a, b, c)):
        assert r.graphs[0].belongs_to(case.model) and r.stats("fuse_attention")["fused"] == case.num_layers
    with pytest.raises(ValueError, match="compiled no graph of this GPT2LMHeadModel"):
        effpass.report(model_case("gpt2").model)

    # A second model of a's class and shapes with the same options: Dynamo runs a's graph for it without
    # calling the backend (NOTE(shared graphs)); its report still has that graph, the graph that ran for it.
    d = model_case("demo", layers=2, seed=1)
    cd = torch.compile(d.model, backend="effpass", options=opts)
    with dynamo_counters() as counts:
        out = cd(**d.inputs)
    assert counts["unique_graphs"] == 0                                     # really reused, not compiled
    torch.testing.assert_close(out, d.model(**d.inputs))                   # and computes d's function
    rd = effpass.report(cd)
    assert [g.graph_id for g in rd.graphs] == [g.graph_id for g in reports[0].graphs]
    assert rd.stats("fuse_attention")["fused"] == 2 and rd.graphs[0].belongs_to(d.model)
    assert not any(g.belongs_to(d.model) for g in reports[1].graphs + reports[2].graphs)   # that model only
    assert [len(effpass.report(m).graphs) for m in (ca, cb, c.model)] == [1, 1, 1]


# ------------------------------------------------------------------------------------------------------
# 2. Trainer: full fine-tuning, LoRA, QLoRA; gradient accumulation; evaluate / predict
# ------------------------------------------------------------------------------------------------------
PIPELINES = {
    "full": [FuseAttention()],
    "lora": [InjectLoRA(**LORA), FuseAttention()],
    "qlora": [QuantizeLinear(scheme="nf4", block_size=32, exclude=["lm_head"]), InjectLoRA(**LORA), FuseAttention()],
}


@pytest.mark.parametrize("kind", list(PIPELINES))
def test_trainer_trains_an_effpass_model_like_eager(kind, tmp_path):
    data, evals = lm_dataset(12), lm_dataset(4, seed=1)
    runs = {}
    for compiled in (False, True):
        model = _model(PIPELINES[kind], compiled=compiled)
        trainer = transformers.Trainer(model=model, args=_args(tmp_path / str(compiled)), train_dataset=data,
                                       eval_dataset=evals)
        with dynamo_counters() as counters:
            trainer.train()
            metrics = trainer.evaluate() if kind == "lora" else {}
            pred = trainer.predict(evals) if kind == "lora" else None
        runs[compiled] = (model, trainer, counters, metrics, pred)
    (_, eager, _, e_metrics, e_pred), (model, trainer, counters, metrics, pred) = runs[False], runs[True]
    # the default TrainingArguments keep every column (the model's forward signature is visible) and scale
    # the loss by the number of label tokens over the accumulated microbatches
    assert trainer.model_accepts_loss_kwargs
    assert len(_losses(trainer)) == 2
    assert _losses(trainer) == pytest.approx(_losses(eager), abs=1e-4)
    report = effpass.report(model)
    assert counters["graph_breaks"] == 0 and counters["frames"] >= 1
    assert len(report.graphs) >= 1 and all(g.records for g in report.graphs)   # effpass's graphs really ran
    assert report.stats("fuse_attention", "torch_ir")["fused"] >= 1
    if kind != "full":
        assert report.stats("inject_lora", "torch_ir")["merged_groups"] >= 1   # q/k/v A products as one matmul
        assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    if kind == "qlora":
        assert report.stats("quantize_linear")["quantized"] == 7    # every linear of the 1-layer model but lm_head
    if kind == "lora":
        assert metrics["eval_loss"] == pytest.approx(e_metrics["eval_loss"], abs=1e-4)
        torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(e_pred.predictions),
                                   atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------
# 2/3. LoRA: PEFT adapters wherever the user saves, resume from a checkpoint, PEFT -> effpass
# ------------------------------------------------------------------------------------------------------
def _adapter_files(path):
    return {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.slow
def test_lora_saves_peft_adapters_and_resumes_exactly(tmp_path):
    peft = pytest.importorskip("peft")
    data = lm_dataset(8)
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=1)
    model = _model(PIPELINES["lora"], compiled=True)
    trainer = transformers.Trainer(model=model, args=_args(tmp_path / "run", **args), train_dataset=data)
    trainer.train()
    full_losses, final = _losses(trainer), _adapters(model)
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert _adapter_files(ckpt) and (ckpt / "optimizer.pt").exists()
    trainer.save_model(str(tmp_path / "final"))
    model.save_pretrained(str(tmp_path / "direct"))
    for d in ("final", "direct"):
        assert _adapter_files(tmp_path / d) and not (tmp_path / d / "model.safetensors").exists()
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["peft_type"] == "LORA"

    # PEFT loads what effpass saved and computes the same logits
    base = model_case("llama", layers=1).model
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "final"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(peft_model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)

    # resume from checkpoint-2: adapters and optimizer restored, the last two steps repeat exactly
    resumed = _model(PIPELINES["lora"], compiled=True)
    with torch.no_grad():   # other adapter weights than the run's start: the checkpoint must restore them
        for p in resumed.parameters():
            if p.requires_grad:
                p.normal_()
    trainer2 = transformers.Trainer(model=resumed, args=_args(tmp_path / "run2", **args), train_dataset=data)
    trainer2.train(resume_from_checkpoint=str(ckpt))
    assert _losses(trainer2)[-2:] == pytest.approx(full_losses[-2:], abs=1e-6)
    for name, value in _adapters(resumed).items():
        torch.testing.assert_close(value, final[name], atol=1e-6, rtol=1e-6)

    # the reverse: a PEFT-saved adapter loads into an effpass-compiled model
    peft_model.save_pretrained(str(tmp_path / "from_peft"))
    target = effpass.compile(model_case("llama", layers=1).model, passes=[FuseAttention()], lowering="eager")
    loaded = effpass.lora.load(target, str(tmp_path / "from_peft"))
    assert len(loaded) == 4
    torch.testing.assert_close(target(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# 4. gradient checkpointing through Hugging Face's API, and TRL's SFTTrainer
# ------------------------------------------------------------------------------------------------------
def test_hf_gradient_checkpointing_is_taken_over_and_every_pass_still_acts():
    case = model_case("llama")
    model = effpass.compile(case.model, passes=[InjectLoRA(**LORA), FuseAttention()], lowering="eager", detailed_stats=True)
    eager = copy.deepcopy(model)
    eager.train(), model.train()
    # what Trainer(gradient_checkpointing=True) calls; the eager copy uses Hugging Face's own checkpointing
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert eager.is_activation_checkpointing and not model.is_activation_checkpointing
    with dynamo_counters() as c:
        model(**case.inputs).loss.backward()
    eager(**case.inputs).loss.backward()
    assert c["graph_breaks"] == 0
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    report = effpass.report(model)
    assert report.stats("fuse_attention", "torch_ir")["fused"] == 2        # attention visible again
    assert report.stats("inject_lora", "torch_ir")["merged_groups"] == 2
    ac = report.stats("checkpoint_activations", "joint")
    assert ac["blocks"] == 2 and ac["saved_bytes_after"] < 0.5 * ac["saved_bytes_before"]
    # turning it off again recompiles without the pass
    model.gradient_checkpointing_disable()
    n = len(report.graphs)
    model(**case.inputs).loss.backward()
    assert "checkpoint_activations" not in {r.name for r in effpass.report(model).graphs[n].records}


def test_trl_sft_trainer_default_config_runs_effpass_graphs_like_eager(tmp_path):
    trl = pytest.importorskip("trl")
    tok, data = tiny_tokenizer(), text_dataset(8)
    runs = {}
    for compiled in (False, True):
        model = _model(PIPELINES["lora"], compiled=compiled)
        config = trl.SFTConfig(str(tmp_path / str(compiled)), max_steps=2, per_device_train_batch_size=4,
                               logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True,
                               disable_tqdm=True)
        assert config.gradient_checkpointing and config.bf16   # TRL's defaults
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
        with dynamo_counters() as counters:
            trainer.train()
        runs[compiled] = (model, trainer, counters)
    (_, eager, _), (model, trainer, counters) = runs[False], runs[True]
    assert _losses(trainer) == pytest.approx(_losses(eager), abs=1e-3)   # bf16 autocast (TRL's default) on both
    report = effpass.report(model)
    joint = [g for g in report.graphs if any(r.graph == "joint" for r in g.records)]
    assert counters["frames"] >= 1 and len(joint) >= 1 and counters["graph_breaks"] == 0
    assert report.stats("inject_lora", "torch_ir")["merged_groups"] >= 1
    assert report.stats("checkpoint_activations", "joint")["blocks"] >= 1   # effpass's checkpointing, not HF's
    assert report.stats("fuse_attention", "torch_ir")["fused"] >= 1   # under TRL's bf16 autocast too
    assert not model.is_activation_checkpointing


# ------------------------------------------------------------------------------------------------------
# 5. accelerate, the callback, and bad input
# ------------------------------------------------------------------------------------------------------
def test_accelerate_rejects_effpass_as_torch_compile_backend(tmp_path):
    """Documented limitation: accelerate maps the backend name through its closed DynamoBackend enum."""
    with pytest.raises(ValueError, match="EFFPASS|effpass"):
        transformers.Trainer(model=model_case("llama").model,
                             args=_args(tmp_path, torch_compile=True, torch_compile_backend="effpass"))


def test_callback_compiles_the_trainers_model_in_one_line(tmp_path):
    from effpass.integrations.huggingface import EffpassCallback

    model = model_case("llama", layers=1).model
    callback = EffpassCallback(passes=[InjectLoRA(**LORA)], lowering="eager")
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=lm_dataset(4),
                                   callbacks=[callback])
    assert effpass.lora.lora_modules(model)       # adapters exist before the Trainer builds its optimizer
    trainer.train()
    assert callback.report.stats("inject_lora", "torch_ir")["adapters_in_graph"] == 4
    assert trainer.optimizer.param_groups[0]["params"][0] is model.model.layers[0].self_attn.q_proj.lora_A.weight


@pytest.mark.parametrize("case", ["torch_compile", "scale_loss"])
def test_trainer_with_incompatible_options_is_a_clear_error(case, tmp_path):
    passes = [ScaleLoss()] if case == "scale_loss" else []
    model = effpass.compile(model_case("llama").model, passes=passes, lowering="eager")
    kw = {"torch_compile": True} if case == "torch_compile" else {}
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=1, **kw), train_dataset=lm_dataset(4))
    match = r"TrainingArguments\(torch_compile=True\) would compile" if case == "torch_compile" else "scale_loss pass needs"
    with pytest.raises(ValueError, match=match):
        trainer.train()


def test_adapter_bad_input_is_a_clear_error(tmp_path):
    model = effpass.compile(model_case("llama").model, passes=[], lowering="eager")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        effpass.lora.save(model, str(tmp_path / "a"))
    lora = effpass.compile(model_case("llama").model, passes=[InjectLoRA(**LORA)], lowering="eager")
    effpass.lora.save(lora, str(tmp_path / "b"))
    cfg = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["attn.c_attn"]
    (tmp_path / "b" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"target_modules \['attn.c_attn'\] match no linear module of this LlamaForCausalLM"):
        effpass.lora.load(model, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="offload=True"):
        model.gradient_checkpointing_enable(offload=True)


# ------------------------------------------------------------------------------------------------------
# 7. the examples
# ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.xdist_group("readme")  # the fork server of the README's blocks (tests/conftest.py): one per run
@pytest.mark.parametrize("script", ["hf_trainer.py", "trl_sft.py"])
def test_example_runs(script, tmp_path, fork_server):
    """Each example runs as a script in its own process, forked from a server that imported torch, transformers,
    TRL and effpass once (tests/_fork_server.py: ~8 CPU-s of imports per example otherwise); it must exit 0 and
    print that its losses match eager (the example asserts the match itself)."""
    import _fork_server

    path = os.path.join(ROOT, "examples", script)
    out = _fork_server.run_block(fork_server, open(path).read(), tmp_path, env={"EFFPASS_LOWERING": "eager"},
                                 name=path)
    assert "matches eager" in out


def test_sft_trainer_with_an_adapter_on_lm_head_is_a_clear_error(tmp_path):
    trl = pytest.importorskip("trl")
    model = effpass.compile(model_case("llama", layers=1).model, passes=[InjectLoRA(rank=4)], lowering="eager")
    config = trl.SFTConfig(str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                           save_strategy="no", disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=text_dataset(2), processing_class=tiny_tokenizer())
    with pytest.raises(ValueError, match=r"LoRA adapter on lm_head would never be trained.*exclude=\['lm_head'\]"):
        trainer.train()
