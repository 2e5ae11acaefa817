"""effpass.config: keyword options become Options in one place; environment variables are read there."""
import pytest

from effpass.config import compile_options, env_overrides, progress_from_env, rowwise_compile_from_env


def test_compile_options_none_is_not_given_and_iterables_become_lists():
    opts = compile_options(passes=[], lowering="eager", bisect=None, dump_dir=None, inductor_config=None,
                           disable=iter(["fuse_attention"]), environ={})
    assert (opts.lowering, opts.bisect, opts.dump_dir, opts.inductor_config, opts.disable) == (
        "eager", None, None, {}, ("fuse_attention",))
    assert compile_options(passes=None, environ={}).default_pipeline  # passes=None: the default pipeline
    assert not compile_options(passes=[], environ={}).default_pipeline


def test_compile_options_rejects_an_unknown_keyword_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown effpass option 'lowerng' \(did you mean 'lowering'\?\); valid"):
        compile_options(passes=[], lowerng="eager")


def test_the_environment_overrides_code():
    env = {"EFFPASS_STRICT": "1", "EFFPASS_LOWERING": "eager", "EFFPASS_DISABLE": "fuse_attention, scale_loss"}
    opts = compile_options(passes=[], strict=False, lowering="inductor", environ=env)
    assert (opts.strict, opts.lowering, opts.disable) == (True, "eager", ("fuse_attention", "scale_loss"))
    assert env_overrides({}) == {}
    with pytest.raises(ValueError, match="EFFPASS_BISECT='two' is not an integer"):
        env_overrides({"EFFPASS_BISECT": "two"})


@pytest.mark.parametrize("value, expected", [(None, None), ("0", False), ("no", False), ("false", False),
                                             ("1", True), ("yes", True), ("2", True)])
def test_progress_from_env(value, expected):
    assert progress_from_env({} if value is None else {"EFFPASS_PROGRESS": value}) is expected


def test_rowwise_compile_from_env():
    assert rowwise_compile_from_env({}) and rowwise_compile_from_env({"EFFPASS_ROWWISE_COMPILE": "1"})
    assert not rowwise_compile_from_env({"EFFPASS_ROWWISE_COMPILE": "0"})
