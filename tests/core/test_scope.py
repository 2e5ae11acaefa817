"""Scoping: targets/exclude globs and the skip/only decorators, on real models."""
import pytest
import torch

import effpass
from effpass.scope import Scope, normalize_module_path
from effpass.testing import compile_and_compare, model_case
from _helpers import register_test_passes


@pytest.fixture(autouse=True)
def test_passes():
    restore = register_test_passes()
    yield
    restore()


def _linear_paths(case, **options):
    res = compile_and_compare(case, [effpass.make_pass("count_linears", options)], backward=False)
    return res.report.stats("count_linears")["paths"]


def test_normalize_dynamo_module_paths():
    assert normalize_module_path("L['self'].model.layers.0.self_attn") == "model.layers.0.self_attn"
    assert normalize_module_path("L['self']._modules['layers']._modules['3']") == "layers.3"
    assert normalize_module_path("L['self']") == ""
    assert normalize_module_path("L['self']._wrapper.__self__.lm_head") == "lm_head"
    assert normalize_module_path("L['self'].model._fwd.__self__.layers.0") == "model.layers.0"
    # a decorator ``wrapper(*args, **kwargs)`` around forward (transformers >= 5.24): the module is args[0]
    assert normalize_module_path("L['args'][0].model.layers.0") == "model.layers.0"
    assert normalize_module_path("L['args'][0]._modules['lm_head']") == "lm_head"
    assert normalize_module_path("L['args'][0]") == ""


def test_globs_select_modules_on_llama():
    # five scopes of the same counting pass, registered under five names, in one compile (each pass is scoped
    # by its own targets/exclude; one Dynamo trace of the 3-layer Llama instead of five)
    from _helpers import CountLinears

    scopes = {"count_linears": {}, "count_linears_q": {"targets": ["*.q_proj"]},
              "count_linears_ranged": {"targets": ["model.layers.[0-1].*"]},
              "count_linears_block": {"targets": ["model.layers.2"]},
              "count_linears_excl": {"exclude": ["lm_head", "*.mlp.*"]}}
    for name in scopes:
        if name != "count_linears":
            effpass.register_pass(name)(type(f"CountLinears_{name}", (CountLinears,), {}))
    case = model_case("llama", layers=3)
    res = compile_and_compare(case, [effpass.make_pass(n, o) for n, o in scopes.items()], backward=False)
    paths = {n: res.report.stats(n)["paths"] for n in scopes}
    all_paths = paths["count_linears"]
    assert len(all_paths) == 7 * 3 + 1
    q = paths["count_linears_q"]
    assert q == [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]
    ranged = paths["count_linears_ranged"]
    assert {p.split(".")[2] for p in ranged} == {"0", "1"} and len(ranged) == 14
    # a glob on an enclosing module covers everything inside it
    block = paths["count_linears_block"]
    assert len(block) == 7 and all(p.startswith("model.layers.2.") for p in block)
    excl = paths["count_linears_excl"]
    assert len(excl) == 4 * 3 and "lm_head" not in excl


def test_targets_matching_nothing_is_an_error_naming_the_pattern():
    scope = Scope("inject_lora", targets=["*.query_proj"])
    model = model_case("llama").model
    with pytest.raises(effpass.TargetMatchError, match=r"inject_lora: targets pattern '\*\.query_proj' matches no linear;"
                                                         r" linear names here include: 'model.layers.0.self_attn.q_proj'"):
        scope.select_modules(model, lambda n, m: isinstance(m, torch.nn.Linear), what="linear")


def test_skip_decorator_on_a_class_and_only_on_an_instance():
    from transformers.models.llama import modeling_llama

    case = model_case("llama", layers=2)
    try:
        effpass.skip("count_linears")(modeling_llama.LlamaMLP)
        paths = _linear_paths(case)
        assert len(paths) == 4 * 2 + 1 and not any(".mlp." in p for p in paths)
    finally:
        del modeling_llama.LlamaMLP.__effpass_skip__
    case = model_case("llama", layers=2)
    effpass.skip("count_linears")(case.model.model.layers[1])         # instance: all of layer 1
    effpass.only("some_other_pass")(case.model.lm_head)               # only another pass may touch lm_head
    paths = _linear_paths(case)
    assert paths == [p for p in paths if p.startswith("model.layers.0.")] and len(paths) == 7


def test_skip_for_another_pass_does_not_apply():
    case = model_case("demo")
    effpass.skip("apply_autocast")(case.model.layers[0])
    assert len(_linear_paths(case)) == 7 * 2 + 1


def test_decorators_reject_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        effpass.skip("fuse_attention")(object())
    with pytest.raises(ValueError, match="at least one"):
        effpass.only()


def test_glob_match_and_glob_match_within():
    """The glob functions passes use (nothing else imports fnmatch): whole-name matching, and matching a path or
    any module enclosing it, which is what ``t`` or ``t + ".*"`` matched before (checked on a grid of paths)."""
    import fnmatch

    from effpass.scope import enclosing_paths, glob_match, glob_match_within

    assert enclosing_paths("a.b.c") == ["a", "a.b", "a.b.c"] and enclosing_paths("") == [""]
    assert glob_match("model.layers.3.mlp", "model.layers.*") and not glob_match("model.layers", "model.layers.*")
    assert not glob_match("Model", ["model"]) and not glob_match("x", [])
    assert glob_match_within("model.layers.3.mlp", ["model.layers.3"])
    assert not glob_match_within("model.layers.31.mlp", ["model.layers.3"])
    assert glob_match_within("model.layers.31.mlp", ["model.layers.3?"])
    paths = ["", "lm_head", "model", "model.layers.3", "model.layers.3.mlp.up", "model.layers.31.mlp",
             "a..b", "ax.yb.c"]
    globs = ["*", "model", "model.layers.3", "model.layers.*.mlp", "*.mlp", "a*b", "lm_*", "", "[ab]x.*"]
    for path in paths:
        for g in globs:
            assert glob_match(path, [g]) == fnmatch.fnmatchcase(path, g)
            old = fnmatch.fnmatchcase(path, g) or fnmatch.fnmatchcase(path, g + ".*")
            assert glob_match_within(path, [g]) == old, (path, g)
