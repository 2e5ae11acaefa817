"""Lowering failures fall back with a warning naming the graph (strict raises); eager lowering survives
eager kernels' strides (Qwen3-Next's gated DeltaNet backward crashed plain aot_eager)."""
import warnings

import pytest
import torch

import effpass
from effpass.backend import EffpassBackend
from effpass.testing import assert_close_tree, grads_of, model_case


def _boom(*a, **k):
    raise RuntimeError("planted lowering failure")


def _run(model, case):
    out = model(**case.inputs)
    loss = case.loss(out)
    loss.backward()
    return loss.detach(), grads_of(model)


def test_failed_lowering_falls_back_to_graph_as_is_with_warning(monkeypatch):
    case = model_case("llama", layers=1)
    ref_loss, ref_grads = _run(case.fresh().model, case)
    monkeypatch.setattr(EffpassBackend, "_lower_eager", _boom)
    monkeypatch.setattr(EffpassBackend, "_lower_inductor", _boom)
    model = effpass.compile(case.fresh().model, lowering="eager", allow_fallback=True)
    with pytest.warns(RuntimeWarning, match=r"lowering failed on graph_000.*planted lowering failure"):
        loss, grads = _run(model, case)
    assert_close_tree(loss, ref_loss, what="loss")
    assert_close_tree(grads, ref_grads, what="grads")
    rep = effpass.report(model)
    fb = rep.graphs[0].notes["lowering_fallback"]
    assert fb["to"] == "none" and sum("planted" in e for e in fb["errors"]) == 2
    assert any("not run without a lowering" in e and "fuse_cross_entropy" in e for e in fb["errors"])
    # the torch-IR passes still ran on the graph (the default pipeline's fused attention)
    assert rep.stats("fuse_attention").get("fused", 0) >= 1
    assert "lowering fell back to 'none'" in rep.summary() and "fuse_cross_entropy" in rep.summary()


def test_fallback_that_turns_passes_off_is_an_error_unless_allowed(monkeypatch):
    """Running a graph as captured skips its joint/post-grad passes (checkpointing, the fused loss's late part):
    without allow_fallback=True that is an error naming effpass, the graph and the passes, and the way to allow
    it; a pipeline with no such pass falls back with a warning only (nothing is turned off)."""
    case = model_case("llama", layers=1)
    monkeypatch.setattr(EffpassBackend, "_lower_eager", _boom)
    monkeypatch.setattr(EffpassBackend, "_lower_inductor", _boom)
    model = effpass.compile(case.fresh().model, lowering="eager")
    with pytest.raises(Exception, match=r"effpass: every lowering failed on graph_000.*would skip the passes "
                                        r"\[.*fuse_cross_entropy.*\].*allow_fallback=True"):
        _run(model, case)
    torch._dynamo.reset()
    ref_loss, _ = _run(case.fresh().model, case)
    bare = effpass.compile(case.fresh().model, passes=[], lowering="eager")
    with pytest.warns(RuntimeWarning, match="runs as captured"):
        loss, _ = _run(bare, case)
    assert_close_tree(loss, ref_loss, what="loss")
    assert effpass.report(bare).graphs[0].notes["lowering_fallback"]["to"] == "none"
    with pytest.raises(TypeError, match="allow_fallback must be a bool"):
        effpass.compile(case.fresh().model, lowering="eager", allow_fallback="yes")


def test_failed_eager_lowering_falls_back_to_inductor(monkeypatch):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(*[type(x)() if isinstance(x, torch.nn.GELU) else x for x in m])
    x = torch.randn(4, 8)
    expected = m(x).sum()
    monkeypatch.setattr(EffpassBackend, "_lower_eager", _boom)
    compiled = torch.compile(m, backend=effpass.EffpassBackend({"passes": {}, "lowering": "eager"}))
    with pytest.warns(RuntimeWarning, match=r"lowered with 'inductor' instead"):
        got = compiled(x).sum()
    torch.testing.assert_close(got, expected)
    del ref


def test_strict_raises_the_lowering_error(monkeypatch):
    case = model_case("llama", layers=1)
    monkeypatch.setattr(EffpassBackend, "_lower_eager", _boom)
    model = effpass.compile(case.model, lowering="eager", strict=True)
    with pytest.raises(Exception, match="planted lowering failure"):
        model(**case.inputs)


def test_wrong_result_error_is_never_rolled_back_or_fallen_back():
    @effpass.register_pass("refuse_test_site")
    class Refuses(effpass.Pass):
        def transform_torch_ir(self, gm, ctx):
            raise effpass.WrongResultError("site x would mix examples")

    try:
        case = model_case("llama", layers=1)
        model = effpass.compile(case.model, passes=[Refuses()], lowering="eager")
        with pytest.raises(Exception, match="WrongResultError: site x would mix examples") as info:
            model(**case.inputs)
        # Dynamo wraps what a backend raises; the cause is the pass's own error, not a fallback
        assert isinstance(getattr(info.value, "inner_exception", info.value), effpass.WrongResultError)
        assert not any("lowering_fallback" in g.notes for g in effpass.report(model).graphs)
    finally:
        from effpass import pass_api
        pass_api._REGISTRY.pop("refuse_test_site", None)


def test_qwen3_next_trains_with_eager_lowering():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.Qwen3NextForCausalLM(cfg)
    import copy
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 128, (2, 16))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    model = effpass.compile(model, lowering="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback needed: the eager lowering itself runs
        got = model(input_ids=ids, labels=ids)
        got.loss.backward()
    torch.testing.assert_close(got.loss, out.loss, rtol=1e-5, atol=1e-6)
    assert_close_tree(grads_of(model), grads_of(ref), atol=1e-5, rtol=1e-4, what="grads")
    rep = effpass.report(model)
    assert sum(g.notes.get("eager_views_as_reshape", 0) for g in rep.graphs) > 0
    assert not any("lowering_fallback" in g.notes for g in rep.graphs)
