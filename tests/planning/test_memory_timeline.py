"""Where memory goes: the planner's live-byte timeline (categories, peak), drawn as SVG in the plan's HTML, the
compile report and `effpass plan --html`, and exported for PyTorch's memory visualizer."""
import json
import pickle
import re

import pytest

from effpass.inspect.timeline import memory_viz_snapshot, timeline_svg, write_timeline_html
from effpass.passes import CheckpointActivations
from effpass.planning import estimate_memory
from effpass.testing import model_case

from _browser import find_chromium, load_in_chromium


@pytest.fixture(scope="module")
def estimates():
    case = model_case("llama", layers=2)
    plain = estimate_memory(case.model, case.inputs, lowering="eager")
    ckpt = estimate_memory(case.model, case.inputs, passes=[CheckpointActivations(policy="full")], lowering="eager")
    return plain, ckpt


def test_timeline_adds_up_to_the_estimate(estimates):
    for est in estimates:
        tl = est.timeline
        assert tl["categories"] == ["parameters", "optimizer states", "inputs", "saved activations", "gradients",
                                    "transients"]
        st = tl["static"]
        assert st["parameters"] == est.parameters + est.buffers and st["optimizer states"] == est.optimizer_states
        assert sum(st.values()) == est.start_bytes
        totals = [p[2] + p[3] + p[4] for p in tl["points"]]
        # the drawn peak is the predicted one, to the byte, at the op the estimate names
        assert est.start_bytes + max(totals) == est.peak_bytes == tl["peak"]["bytes"]
        assert tl["peak"]["node"] == est.peak_node and len(tl["points"]) <= 600 < 10**6
        assert min(min(p[2:5]) for p in tl["points"]) >= 0
        assert max(p[3] for p in tl["points"]) > 0  # gradients appear in the backward
    plain, ckpt = estimates
    # checkpointing keeps fewer activations saved for backward
    assert max(p[2] for p in ckpt.timeline["points"]) < max(p[2] for p in plain.timeline["points"])


def test_svg_and_memory_viz_export(estimates, tmp_path):
    plain, ckpt = estimates
    svg = timeline_svg([("checkpoint full", ckpt.timeline), ("no technique", plain.timeline)])
    assert svg.count('class="band"') == 6 and svg.count('class="candidate"') == 1
    assert 'data-plan="no technique"' in svg and "peak " in svg and ckpt.peak_node.split(" ")[0] in svg
    snap = memory_viz_snapshot(plain.timeline)
    trace = snap["device_traces"][0]
    live, peak = 0, 0
    for ev in trace:
        live += ev["size"] if ev["action"] == "alloc" else -ev["size"]
        peak = max(peak, live)
    assert peak == plain.peak_bytes  # the exported trace reaches the same peak
    pickle.dumps(snap)
    out = write_timeline_html(str(tmp_path / "t.html"), [("plain", plain.timeline)])
    if find_chromium():
        dom, console = load_in_chromium(out)
        assert dom.count('class="band"') == 6 and not console


def test_plan_command_writes_html_and_snapshot(tmp_path, capsys):
    """``effpass plan --html --memory-viz``: the page draws the chosen plan's bands and one curve per other candidate,
    the pickle is a memory-visualizer trace. One block and the fused loss given: the checkpoint group's three plans
    (replayed in one shared capture) are candidates enough for the curves (two blocks and the loss left to the
    planner were six plans, ~2.5x the replays)."""
    from effpass.cli import main

    cfg = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    html_out, viz = tmp_path / "plan.html", tmp_path / "plan.pickle"
    rc = main(["plan", str(path), "--batch", "1", "--seq", "16", "--budget", "1GiB", "--html", str(html_out),
               "--memory-viz", str(viz), "--passes", json.dumps({"fuse_cross_entropy": {}})])
    assert rc == 0
    page = html_out.read_text()
    assert page.count('class="band"') == 6 and "memory plan for a budget" in page
    n_candidates = len(re.findall(r'class="candidate"', page))
    assert n_candidates == 2  # the other candidate plans (checkpoint ops, full), one curve each
    snap = pickle.loads(viz.read_bytes())
    assert snap["device_traces"][0][0]["action"] == "alloc"


def test_a_reused_storage_key_is_classified_per_lifetime():
    """Storage keys (addresses) are reused once freed: a forward activation freed in the backward is a saved
    activation even when a backward transient later gets the same key (classified by the key's last use, it
    was a transient, and the timeline depended on what the process had allocated before)."""
    from types import SimpleNamespace

    from effpass.planning.tracker import step_timeline

    est = SimpleNamespace(parameters=0, buffers=0, optimizer_states=0, inputs=0, start_bytes=0, peak_phase="backward",
                          peak_graph="-", peak_node="-")
    events = [(100, 7, "forward", "mm"), (-100, 7, "backward", ""), (50, 7, "backward", "mul"), (-50, 7, "backward", ""),
              (30, 7, "backward", "mm")]  # the last: a gradient alive past the backward
    pts = step_timeline(events, est)["points"]
    assert [p[2] for p in pts] == [100, 0, 0, 0, 0]     # saved activations
    assert [p[3] for p in pts] == [0, 0, 0, 0, 30]      # gradients
    assert [p[4] for p in pts] == [0, 0, 50, 0, 0]      # transients
