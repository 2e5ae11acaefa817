"""effpass verify: reference semantics checked per pass and for the pipeline, bisection to the pass at fault,
packed rows against examples alone, verify=True on the first call, and the command line."""
import dataclasses
import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

import effpass
from effpass.passes import FuseAttention, FuseCrossEntropy, PackSequences
from effpass.testing import model_case

from _families import family_case


@effpass.register_pass("perturb_one_value", run_after=("fuse_attention",))
class PerturbOneValue(effpass.Pass):
    """A planted fault: scales the output of one linear (the module named ``site``) by 1 + 1e-3."""

    site: str = dataclasses.field(default="model.layers.1.mlp.down_proj", metadata={"doc": "the module whose output is scaled"})

    def transform_torch_ir(self, gm, ctx):
        from effpass.graph import module_path_of_node

        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.linear and module_path_of_node(n) == self.site:
                with gm.graph.inserting_after(n):
                    m = gm.graph.call_function(torch.mul, (n, 1.001))
                n.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
                return effpass.PassResult(changed=True, stats={"perturbed": 1})
        return effpass.PassResult(stats={"perturbed": 0})


def test_verify_passes_a_correct_pipeline_and_leaves_the_model_alone():
    case = model_case("llama", layers=1)  # three checks, each a compile: one block shows what two would
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    rep = effpass.verify(case.model, case.inputs, [FuseAttention(), FuseCrossEntropy()])
    assert rep.ok, rep.to_text()
    assert [c.label for c in rep.checks] == ["fuse_attention alone", "fuse_cross_entropy alone", "pipeline"]
    assert rep.failing_pass is None
    pipe = rep.checks[-1]
    assert set(pipe.errors) == {"loss", "grad", "output"} or set(pipe.errors) == {"loss", "grad"}
    assert all(v <= 1e-5 for v in pipe.errors.values())
    # the fused head returns no training logits by design: said, not hidden
    assert "output.logits" in pipe.not_returned
    # the user's model is untouched (verify works on copies)
    assert all(torch.equal(before[k], v) for k, v in case.model.state_dict().items())
    assert not hasattr(case.model, "_effpass_compile_kwargs")


@pytest.fixture(scope="module")
def planted():
    """effpass.compile(verify=True) with the planted pass, first call made: its first call runs
    ``effpass.verify(model, inputs, passes)`` on a copy of the model taken before effpass prepared it, so its
    report is what a direct call returns (one verification, ~8 compiles, shared by the two tests below)."""
    case = model_case("llama", layers=2)
    ref_loss = case.fresh().model(**case.inputs).loss
    model = effpass.compile(case.model, passes=[FuseAttention(), PerturbOneValue(), FuseCrossEntropy()],
                            lowering="eager", verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**case.inputs)
    return SimpleNamespace(case=case, model=model, out=out, ref_loss=ref_loss, warnings=caught)


@pytest.mark.xdist_group("verify_planted")
def test_verify_catches_a_planted_perturbation_and_bisects_to_it(planted):
    rep = effpass.report(planted.model).verification
    assert rep is not None and not rep.ok
    by = {c.label: c for c in rep.checks}
    assert by["fuse_attention alone"].ok and by["fuse_cross_entropy alone"].ok
    assert not by["perturb_one_value alone"].ok and not by["pipeline"].ok
    assert 1e-5 < max(by["pipeline"].errors.values()) < 1e-1  # 1e-3 on one linear: seen, and small
    assert rep.failing_pass == "perturb_one_value"
    # the site: the tensor that differs most belongs to the perturbed layer or what it feeds
    assert rep.site and "model.layers.1" in rep.site or "lm_head" in rep.site or "norm" in rep.site, rep.site
    assert "first failing pass: perturb_one_value" in rep.to_text()


def test_verify_catches_one_leaking_packing_mask(monkeypatch):
    from effpass.passes import pack_sequences as ps

    case = family_case("llama", seq=12)
    rep = effpass.verify(case.model, case.inputs, [FuseAttention(), PackSequences()], alone=False)
    assert rep.ok, rep.to_text()
    packed = [c for c in rep.checks if c.label == "packed rows"]
    assert len(packed) == 1 and packed[0].errors["output"] <= 1e-5

    orig = ps.packed_sdpa
    leaked = []

    def leaky(q, k, v, same, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # the packing mask with one leak: causal and per example, except that token 7 (verify packs 2 x 12
        # tokens as examples of 7, 9 and 8: token 7 starts the second one) also sees token 0 of the first
        n = same.shape[-1]
        mask = same & torch.ones(n, n, dtype=torch.bool, device=same.device).tril()
        mask[..., 7, 0] = True
        leaked.append(n)
        return orig(q, k, v, mask, None, dropout_p, False, scale, enable_gqa)

    monkeypatch.setattr(ps, "packed_sdpa", leaky)
    rep = effpass.verify(case.model, case.inputs, [FuseAttention(), PackSequences()], alone=False)
    assert leaked, "the planted leak never ran"
    assert not rep.ok and rep.failing_pass == "pack_sequences"
    assert rep.checks[-1].label == "packed rows" and rep.checks[-1].errors["output"] > 1e-4
    assert rep.site.startswith("example 1") or rep.site.startswith("example 2"), rep.site


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "gpt_neox", "opt"])
@pytest.mark.sweep
def test_verify_raises_no_false_alarm_on_families(family):
    case = family_case(family)
    rep = effpass.verify(case.model, case.inputs, alone=False)  # the default pipeline
    assert rep.ok, rep.to_text()
    assert rep.checks[0].errors["grad"] <= 1e-5


@pytest.mark.xdist_group("verify_planted")
def test_compile_verify_turns_a_failing_graph_pass_off(planted):
    case, model = planted.case, planted.model
    assert any(issubclass(w.category, RuntimeWarning) and re.search(r"turning off \['perturb_one_value'\]", str(w.message))
               for w in planted.warnings), [str(w.message) for w in planted.warnings]
    torch.testing.assert_close(planted.out.loss, planted.ref_loss, rtol=1e-5, atol=1e-6)
    rep = effpass.report(model)
    assert rep.verification is not None and rep.verification.failing_pass == "perturb_one_value"
    # the model now runs without the planted pass, and still with the others
    # (verification ran before the first compile: the planted pass never ran in the user's model)
    assert rep.graphs and not any(r.name == "perturb_one_value" for g in rep.graphs for r in g.records)
    assert any(r.name == "fuse_attention" and r.changed for g in rep.graphs for r in g.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(**case.inputs)  # no second verification


@pytest.mark.xdist_group("verify_planted")
def test_compile_verify_strict_raises(planted, monkeypatch):
    """strict=True raises on the first call instead of turning the pass off. Strictness is the reaction to a failed
    verification, not the verification: the first call's verify returns the report of the planted fixture (the
    same pipeline on the same model, verified for real there), so this test compiles nothing (was a verification
    of its own: ~4 compiles)."""
    import effpass.verification as ev

    failed = effpass.report(planted.model).verification
    calls = []
    monkeypatch.setattr(ev, "verify", lambda model, inputs, passes, **kw: calls.append(passes) or failed)
    case = model_case("llama", layers=2)
    model = effpass.compile(case.model, passes=[FuseAttention(), PerturbOneValue(), FuseCrossEntropy()],
                            lowering="eager", verify=True, strict=True)
    with pytest.raises(effpass.verification.VerifyError, match="perturb_one_value") as info:
        model(**case.inputs)
    assert "first failing pass: perturb_one_value" in str(info.value)
    assert len(calls) == 1 and [p.name for p in calls[0]] == ["fuse_attention", "perturb_one_value",
                                                              "fuse_cross_entropy"]


def test_bad_input_is_named():
    case = model_case("llama", layers=1)
    with pytest.raises(TypeError, match="example_inputs must be a dict"):
        effpass.verify(case.model, case.inputs["input_ids"])
    with pytest.raises(TypeError, match="verify must be a bool"):
        effpass.compile(case.model, verify="yes")
    with pytest.raises(ValueError, match="unknown|not a registered|no pass"):
        effpass.verify(case.model, case.inputs, ["fuse_atention"])


def test_cli_verify_on_a_config(tmp_path, capsys):
    from effpass.cli import main

    cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["verify", str(path), "--seq", "12", "--layers", "1", "--no-alone", "--packed"]) == 0
    out = capsys.readouterr().out
    assert "qwen3: 1 layers" in out and "ok    pipeline" in out and "ok    packed rows" in out
    with pytest.raises(SystemExit, match="does not exist on Qwen3Config"):
        main(["verify", str(path), "--set", "hiden_size=64"])
