"""Every statistic a pass reports is defined in its docs page (docs/passes/<name>.md names it in backticks, or in
a `prefix_a/b/c` group): one compile of a broad pipeline on the tiny Llama (eager lowering) collects the names."""
import os
import re

import pytest

import effpass
from _paths import ROOT
from effpass.testing import model_case

PASSES = ["inject_lora", "fuse_attention", "fuse_cross_entropy", "checkpoint_activations", "tile_sequence",
          "compress_activations"]
#: a second pipeline for the passes the first cannot hold (fp16 with loss scaling, int8 weights, the in-graph step)
MIXED = [("apply_autocast", {"dtype": "float16"}), ("scale_loss", {}), ("quantize_linear", {"scheme": "int8"}),
         ("step_in_backward", {})]


def _documented(doc: str) -> set[str]:
    names = set(re.findall(r"`([a-z][a-z0-9_]*)`", doc))
    for prefix, group in re.findall(r"`([a-z][a-z0-9_]*_)([a-z0-9]+(?:/[a-z0-9]+)+)`", doc):
        names |= {prefix + g for g in group.split("/")}
    return names


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
    with open(os.path.join(ROOT, "docs", "passes", f"{name}.md")) as fh:
        missing = sorted(reported[name] - _documented(fh.read()))
    assert not missing, f"docs/passes/{name}.md does not define: {missing}"
