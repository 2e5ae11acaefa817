"""effpass's Axolotl plugin, driven in the order Axolotl's PluginManager calls it, without Axolotl (the project's
environment has none; tests/integrations/test_axolotl_real.py runs the real Axolotl 0.19.0 where scripts/axolotl_check.sh
installs it): the YAML section turns effpass on, the Trainer trains the compiled model with the same losses as
effpass.compile by hand, bad sections are named."""
import copy

import pytest
import torch

import effpass
from effpass.integrations.axolotl import EffpassArgs, EffpassPlugin, parse_effpass_config
from effpass.testing import model_case
from effpass.testing.hf import lm_dataset

transformers = pytest.importorskip("transformers")


class DictDefault(dict):  # what Axolotl hands plugins: a dict with attribute access (None when absent)
    def __getattr__(self, k):
        return self.get(k)


def _train(model, tmp_path, callbacks=()):
    args = transformers.TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                                          report_to=[], seed=0, save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_dataset(8, 16), callbacks=list(callbacks))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_plugin_compiles_the_model_from_the_yaml_section(tmp_path):
    base = model_case("llama", layers=1).model
    cfg = DictDefault(plugins=["effpass.integrations.axolotl.EffpassPlugin"],
                      effpass={"passes": {"fuse_attention": {}, "fuse_cross_entropy": {}}, "lowering": "eager",
                               "dump_dir": str(tmp_path / "dump")})
    # Axolotl's order: register -> pre_model_load -> (model built, adapters) -> add_callbacks_pre_trainer
    # -> Trainer(...) -> train -> post_train
    plugin = EffpassPlugin()
    assert plugin.get_input_args() == "effpass.integrations.axolotl.EffpassArgs"
    assert EffpassArgs(**{"effpass": cfg.effpass}).effpass == cfg.effpass
    plugin.register(cfg)
    plugin.pre_model_load(cfg)
    model = copy.deepcopy(base)
    callbacks = plugin.add_callbacks_pre_trainer(cfg, model)
    assert len(callbacks) == 1
    losses, trainer = _train(model, tmp_path / "run", callbacks)
    plugin.post_train(cfg, model)
    rep = effpass.report(model)
    assert rep.stats("fuse_cross_entropy").get("fused", 0) == 1 and rep.stats("fuse_attention").get("fused", 0) == 1
    assert (tmp_path / "dump" / "report.html").exists()
    # the same training with effpass.compile by hand: the same losses
    ref = effpass.compile(copy.deepcopy(base), passes=["fuse_attention", "fuse_cross_entropy"], lowering="eager")
    ref_losses, _ = _train(ref, tmp_path / "ref")
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_plugin_is_off_without_a_section_or_when_disabled():
    model = model_case("llama", layers=1).model
    for cfg in (DictDefault(), DictDefault(effpass={"enabled": False, "passes": ["fuse_attention"]})):
        plugin = EffpassPlugin()
        plugin.register(cfg)
        assert plugin.add_callbacks_pre_trainer(cfg, model) == []
    assert not hasattr(model, "_effpass_compile_kwargs")


@pytest.mark.parametrize("section, match", [
    ({"pases": ["fuse_attention"]}, r"unknown key\(s\) \['pases'\].*valid keys"),
    ({"passes": ["fuse_atention"]}, "fuse_atention"),
    ({"lowering": "tvm"}, r"lowering 'tvm' is not one of"),
    ({"verify": "yes"}, "'verify' must be true or false"),
    ({"allow": "nf4"}, "'allow' must be a list"),
    ("on", "must be a mapping"),
])
def test_bad_sections_are_named(section, match):
    with pytest.raises(ValueError, match=match):
        parse_effpass_config(DictDefault(effpass=section))


def test_axolotl_torch_compile_is_refused():
    with pytest.raises(ValueError, match="torch_compile: true"):
        parse_effpass_config(DictDefault(effpass={}, torch_compile=True))


def test_axolotl_lora_kernels_are_turned_off_before_validation_or_refused():
    # register() gets the raw config: Axolotl would switch its fused LoRA kernels on for adapter: lora when none is
    # set; the plugin sets them to false (Dynamo cannot trace the QKV kernel, tests/integrations/test_axolotl_real.py)
    cfg = DictDefault(adapter="lora", effpass={"lowering": "eager"})
    EffpassPlugin().register(cfg)
    assert [cfg[k] for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")] == \
        [False] * 4
    # a user's choice stays (Axolotl then auto-enables nothing); no effpass section or another adapter: untouched
    for cfg in (DictDefault(adapter="lora", lora_mlp_kernel=True, effpass={}), DictDefault(adapter="lora"),
                DictDefault(adapter="full", effpass={})):
        before = dict(cfg)
        EffpassPlugin().register(cfg)
        assert dict(cfg) == before
    with pytest.raises(ValueError, match=r"lora_qkv_kernel: true.*Dynamo.*set lora_qkv_kernel: false"):
        EffpassPlugin().register(DictDefault(adapter="lora", lora_qkv_kernel=True, effpass={}))
    with pytest.raises(ValueError, match=r"lora_o_kernel: true.*set lora_o_kernel: false"):
        EffpassPlugin().register(DictDefault(adapter="lora", lora_o_kernel=True, lora_qkv_kernel=False, effpass={}))
