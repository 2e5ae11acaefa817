"""The pass interface: registration, names, options validation, uuids."""
import dataclasses
from typing import Literal

import pytest
import torch

import effpass
from effpass.pass_api import _REGISTRY


@pytest.fixture
def registry_snapshot():
    effpass.registered_passes()  # load the built-ins first so restoring keeps them
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_class_pass_registers_with_declarations_and_validated_options(registry_snapshot):
    @effpass.register_pass("fold_scale", run_after=("fuse_attention",), conflicts_with=("other_thing",))
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class FoldScale(effpass.Pass):
        """Fold constant scales into matmuls."""
        factor: float = dataclasses.field(default=1.0, metadata={"doc": "scale factor"})
        mode: Literal["a", "b"] = "a"

        def transform_torch_ir(self, gm, ctx):
            return effpass.PassResult(False)

    assert effpass.get_pass_class("fold_scale") is FoldScale
    assert FoldScale.name == "fold_scale" and FoldScale.run_after == ("fuse_attention",)
    assert FoldScale.conflicts_with == ("other_thing",)
    assert FoldScale.phases() == (effpass.Phase.TORCH_IR,)
    assert FoldScale.summary == "Fold constant scales into matmuls."
    p = effpass.make_pass("fold_scale", {"factor": 2, "targets": ["model.layers.*"]})
    assert p.factor == 2.0 and isinstance(p.factor, float) and p.targets == ("model.layers.*",)
    with pytest.raises(ValueError, match=r"unknown option 'factr'.*valid options: \[.*'factor'"):
        effpass.make_pass("fold_scale", {"factr": 2})
    with pytest.raises(TypeError, match=r"fold_scale.factor: expected a number, got str 'x'"):
        FoldScale(factor="x")
    with pytest.raises(ValueError, match=r"'c' is not valid; choose one of \['a', 'b'\]"):
        FoldScale(mode="c")
    with pytest.raises(TypeError, match=r"targets: expected a list"):
        FoldScale(targets=3)
    # The uuid changes with the options (Inductor's cache keys on it) and is stable otherwise.
    assert FoldScale(factor=2).uuid() == FoldScale(factor=2).uuid() != FoldScale(factor=3).uuid()
    assert FoldScale(factor=2).options()["factor"] == 2.0


def test_plain_class_and_function_passes(registry_snapshot):
    @effpass.register_pass("count_nodes", phase="joint")
    def count_nodes(gm, ctx):
        """Count nodes."""
        return effpass.PassResult(False, {"nodes": len(gm.graph.nodes)})

    assert count_nodes.phases() == (effpass.Phase.JOINT,)
    assert count_nodes.summary == "Count nodes."

    @effpass.register_pass("noop_everything")
    class Noop:  # a plain class with hook methods becomes a Pass
        def transform_post_grad(self, gm, ctx):
            return None

    assert issubclass(Noop, effpass.Pass) and Noop.phases() == (effpass.Phase.POST_GRAD,)


@pytest.mark.parametrize("name, err", [
    ("FoldScale", "snake_case"), ("fold-scale", "snake_case"), ("apply_autocast", "reserved"),
])
def test_bad_pass_names(name, err, registry_snapshot):
    with pytest.raises(ValueError, match=err):
        effpass.register_pass(name)(lambda gm, ctx: None)


def test_duplicate_registration_is_an_error(registry_snapshot):
    effpass.register_pass("twice_registered")(lambda gm, ctx: None)

    def other(gm, ctx):
        return None

    with pytest.raises(ValueError, match="already registered"):
        effpass.register_pass("twice_registered")(other)


def test_unknown_pass_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown pass 'fuse_atention' \(did you mean 'fuse_attention'\?\); registered passes: \["):
        effpass.make_pass("fuse_atention")


def test_dtype_options_accept_json_strings(registry_snapshot):
    @effpass.register_pass("cast_things")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CastThings(effpass.Pass):
        dtype: torch.dtype = torch.bfloat16

        def transform_torch_ir(self, gm, ctx):
            return None

    assert effpass.make_pass("cast_things", {"dtype": "float16"}).dtype is torch.float16
    with pytest.raises(TypeError, match="'int9' is not a dtype"):
        effpass.make_pass("cast_things", {"dtype": "int9"})


def test_passes_expose_helpers_as_effpass_attributes_without_the_core_importing_them():
    import importlib

    assert effpass.loss_scaler is importlib.import_module("effpass.passes.scale_loss").loss_scaler
    assert effpass.lora is importlib.import_module("effpass.passes.lora")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_helper'"):
        effpass.no_such_helper
    with pytest.raises(ValueError, match="already registered"):
        effpass.register_extension("lora", object())
    # the core package itself names no concrete pass module
    import pathlib

    core = pathlib.Path(effpass.__file__).parent
    for f in core.glob("*.py"):
        text = f.read_text()
        for name in sorted(effpass.reserved_pass_names()):
            assert f"effpass.passes.{name}" not in text and f"passes import {name}" not in text, (f, name)
