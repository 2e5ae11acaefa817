"""Every statistic a pass reports is defined in its docs page (docs/passes/<name>.md names it in backticks, or in
a `prefix_a/b/c` group: tests/_docs.py): one compile of a broad pipeline on the tiny Llama (eager lowering) collects
the names. wrap_fsdp and shard_sequence report only inside ranks: their tests check the same on the ranks' stats."""
import glob
import os
import re

import pytest

import effpass
from _docs import glance_statistics, undocumented_statistics
from _paths import ROOT
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


def test_every_documented_statistic_is_asserted_somewhere():
    """Each statistic of a pass's 'At a glance' row is read by name in some test (issue 38.2: a test that can fail
    when it counts the wrong thing); a statistic added to a pass and its docs without one fails here."""
    tests = "".join(open(f).read() for f in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
                    if not f.endswith("test_docs_statistics.py"))
    missing = {}
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "passes", "*.md"))):
        name = os.path.basename(page)[:-3]
        unread = sorted(n for n in glance_statistics(name) if not re.search(rf"""["']{n}["']""", tests))
        if unread:
            missing[name] = unread
    assert not missing, f"statistics no test reads: {missing}"
