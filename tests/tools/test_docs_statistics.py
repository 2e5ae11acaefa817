"""Every statistic a pass reports is defined in its docs page (docs/passes/<name>.md names it in backticks, or in
a `prefix_a/b/c` group: tests/_docs.py): one compile of a broad pipeline on the tiny Llama (eager lowering) collects
the names. wrap_fsdp and shard_sequence report only inside ranks: their tests check the same on the ranks' stats."""
import pytest

import effpass
from _docs import undocumented_statistics
from effpass.testing import model_case

PASSES = ["inject_lora", "fuse_attention", "fuse_cross_entropy", "checkpoint_activations", "tile_sequence",
          "compress_activations"]
#: a second pipeline for the passes the first cannot hold (fp16 with loss scaling, int8 weights, the in-graph step)
MIXED = [("apply_autocast", {"dtype": "float16"}), ("scale_loss", {}), ("quantize_linear", {"scheme": "int8"}),
         ("step_in_backward", {})]


def _keys(passes) -> dict[str, set]:
    case = model_case("llama", train=True)
    model = effpass.compile(case.model, passes=passes, lowering="eager", detailed_stats=True)
    case.loss(model(**case.inputs)).backward()
    keys: dict[str, set] = {}
    for r in effpass.report(model).records():
        keys.setdefault(r.name, set()).update(r.current_stats())
    return keys


@pytest.fixture(scope="module")
def reported():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {**_keys(PASSES), **_keys([effpass.make_pass(n, o) for n, o in MIXED])}


@pytest.mark.parametrize("name", PASSES + [n for n, _ in MIXED])
def test_every_reported_statistic_is_documented(name, reported):
    assert reported.get(name), f"{name} reported no statistics"
    missing = undocumented_statistics(name, reported[name])
    assert not missing, f"docs/passes/{name}.md does not define: {missing}"
