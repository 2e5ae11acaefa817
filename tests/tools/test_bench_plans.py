"""bench/plans.py: plans made ahead of a GPU window are found by their exact key, keep their figures and pipeline,
say when effpass's source changed since (stale), and are not found for another shape (the arm then plans on the
spot)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from _paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import plans  # noqa: E402

KEY = {"device": "cuda", "hidden": 4096, "layers": 2, "seq": 8192, "cap_gib": 12.0, "dtype": "bfloat16"}


def _record():
    import effpass

    pipeline = [effpass.make_pass("fuse_cross_entropy", {"chunk_bytes": 1 << 20})]
    return {"plan": "as given", "passes": [{"name": p.name, "options": p.options()} for p in pipeline],
            "predicted_bytes": 7_234_567_891, "predicted_device_bytes": 7_516_192_768, "plan_fits": True}


def test_saved_plan_loads_by_its_key_and_rebuilds_its_pipeline(tmp_path):
    rec = _record()
    path = plans.save("plan_check", KEY, rec, cpu_s=126.04, folder=str(tmp_path))
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("plan_check_cuda_")
    got, prov = plans.load("plan_check", dict(KEY), folder=str(tmp_path))
    # numerical: the figures exactly as saved; structural: the provenance and the same pipeline rebuilt
    assert got["predicted_bytes"] == 7_234_567_891 and got["predicted_device_bytes"] == 7_516_192_768
    assert prov["plan_source"] == "precomputed" and prov["plan_stale"] is False and prov["plan_cpu_s"] == 126.0
    (p,) = plans.passes_of(got)
    assert p.name == "fuse_cross_entropy" and p.options() == rec["passes"][0]["options"]
    assert p.options()["chunk_bytes"] == 1 << 20
    # another shape: no plan (the arm plans on the device)
    assert plans.load("plan_check", {**KEY, "seq": 4096}, folder=str(tmp_path)) is None
    assert plans.load("full_ft", KEY, folder=str(tmp_path)) is None


def test_plan_from_another_source_is_marked_stale_and_a_renamed_pass_raises(tmp_path):
    path = plans.save("plan_check", KEY, _record(), cpu_s=1.0, folder=str(tmp_path))
    doc = json.load(open(path))
    doc["source_digest"] = "0" * 64
    doc["record"]["passes"][0]["name"] = "fuse_cross_entropy_renamed"
    with open(path, "w") as f:
        json.dump(doc, f)
    got, prov = plans.load("plan_check", KEY, folder=str(tmp_path))
    assert prov["plan_stale"] is True and got["predicted_bytes"] == 7_234_567_891
    with pytest.raises(ValueError, match="unknown pass 'fuse_cross_entropy_renamed'"):
        plans.passes_of(got)
    # a file whose key is not the asked one (hand-edited) is not taken for it
    doc["key"] = {**KEY, "seq": 1}
    with open(path, "w") as f:
        json.dump(doc, f)
    assert plans.load("plan_check", KEY, folder=str(tmp_path)) is None


def test_shipped_gpu_plans_are_for_the_proofs_shapes():
    """The plans committed under bench/plans/ are keyed by the GPU proof's shapes (section d: 20 GiB; section g:
    4,096 and 8,192 tokens under 12 GiB, and plan_max_seq; its host arm below), each with its figures and a
    pipeline that builds."""
    files = sorted(os.listdir(plans.PLANS))
    docs = [json.load(open(os.path.join(plans.PLANS, f))) for f in files if f.endswith(".json")]
    keys = {(d["workload"], d["key"].get("seq"), d["key"].get("budget", d["key"].get("cap_gib"))) for d in docs}
    assert {("full_ft", 4096, "20GiB"), ("plan_check", 4096, 12.0), ("plan_check", 8192, 12.0),
            ("plan_check", None, 12.0)} <= keys, keys
    for d in docs:
        assert d["key"]["device"] == "cuda" and plans.path(d["workload"], d["key"]).endswith(
            os.path.basename(plans.path(d["workload"], d["key"])))
        assert d["record"]["predicted_device_bytes"] > 0 and d["record"]["passes"] and len(d["commit"]) == 40
        assert d["workload"] != "plan_check" or d["key"].get("seq") is not None or d["record"]["max_seq"] > 0


def test_shipped_host_plans_hold_adamw_on_the_host():
    """Section g's host arm (issue 39.6): at 4,096 and 8,192 tokens, with the user's passes HOST_USER_PASSES and the
    arm's caps, the plans made ahead hold host memory: AdamW's states on the host (torchao's CPUOffloadOptimizer),
    whose predicted host bytes equal a hand count over the LoRA adapters of the 8B-width step."""
    import bench_plan_check as b

    docs = [json.load(open(os.path.join(plans.PLANS, f))) for f in sorted(os.listdir(plans.PLANS)) if f.endswith(".json")]
    host = {d["key"]["seq"]: d for d in docs if d["workload"] == "plan_check" and "user_passes" in d["key"]}
    assert sorted(host) == [4096, 8192], sorted(host)

    def pow2(n):
        return 1 << (n - 1).bit_length()

    # the adapters: r=16, fp32, on every projection of 2 layers at hidden 4,096 / kv 1,024 / ffn 14,336; per adapter
    # matrix of n bytes (>= 4,096 elements: all of them) a pinned copy and gradient (powers of two), two states, a step
    projections = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    sizes = [16 * k * 4 for _ in range(2) for fan_in, fan_out in projections for k in (fan_in, fan_out)]
    hand = sum(2 * pow2(n) + 2 * n + 4 for n in sizes)
    for seq, d in host.items():
        rec, key = d["record"], d["key"]
        assert key["user_passes"] == [dict(p) for p in b.HOST_USER_PASSES] and key["cap_gib"] == b.HOST_CAP_GPU[str(seq)]
        # numerical: the planner's host figure is the hand count; structural: the plan and the optimizer the arm builds
        assert rec["host_bytes"] == hand == 43_516_016 and plans.host_bytes_of(rec) == hand
        assert rec["plan"] == "adamw on host" and rec["optimizer"] == "adamw_offload" and rec["plan_fits"]
        assert rec["predicted_device_bytes"] <= rec["budget_bytes"] == int(key["cap_gib"] * 2**30)
        assert [p["name"] for p in rec["passes"]][2:] == [p["name"] for p in b.HOST_USER_PASSES]


def test_plan_record_host_figure_and_records_saved_before_it():
    """The host figure a row predicts: the plan's ``host_bytes`` as saved; a record saved before plans had one reads
    0 when it holds no host option (what the planner counts for it) and is refused when it does."""
    import bench_plan_check

    rec = {**_record(), "host_bytes": 43_516_016, "optimizer": "adamw_offload", "transfer_bound": False}
    got = bench_plan_check._figures(rec)
    # numerical: the saved figure exactly; structural: the optimizer the arm builds comes from the plan
    assert got["predicted_host_bytes"] == 43_516_016 and got["optimizer"] == "adamw_offload"
    old = _record()  # no host_bytes, no optimizer: AdamW on the device, no offload pass
    assert plans.host_bytes_of(old) == 0 and bench_plan_check._figures(old)["optimizer"] == "adamw"
    off = {**old, "passes": old["passes"] + [{"name": "offload_activations", "options": {}}]}
    with pytest.raises(ValueError, match="holds a host option but has no host_bytes"):
        plans.host_bytes_of(off)


def test_host_columns_say_why_a_figure_was_not_measured():
    """The row's host columns: the ratio measured/predicted where both are numbers; on a CPU run (the device is
    the host) every measured figure and the ratio are the reason, never a number."""
    import bench_plan_check
    from effpass.testing.memory import NA_ON_CPU, HostMeter

    cpu = HostMeter("cpu")
    cpu.start(), cpu.before_step()
    host = cpu.result()
    assert all(v.startswith(NA_ON_CPU) for v in host.values()) and NA_ON_CPU == "n/a on CPU"
    assert host["pinned_peak_bytes"] == host["rss_growth_bytes"] == NA_ON_CPU and "the device is the host" in host["host_measure"]
    row = bench_plan_check.host_figures({"predicted_host_bytes": 1 << 20}, host)
    assert row["measured_host_bytes"] == row["host_ratio"] == row["rss_growth_bytes"] == NA_ON_CPU
    gpu = {"pinned_peak_bytes": 3 << 19, "pinned_active_peak_bytes": 1 << 20, "rss_growth_bytes": 5 << 20,
           "host_measure": "pinned: ..."}
    row = bench_plan_check.host_figures({"predicted_host_bytes": 1 << 20}, gpu)
    assert row["host_ratio"] == 1.5 and row["measured_host_bytes"] == 3 << 19 and row["rss_growth_bytes"] == 5 << 20
    assert bench_plan_check.host_figures({"predicted_host_bytes": 0}, gpu)["host_ratio"].startswith("n/a: the plan")


def test_pinned_stats_are_a_reason_without_cuda():
    """torch.cuda.host_memory_stats() without an initialised CUDA has no figures: the reason, not a number."""
    import torch

    from effpass.testing.memory import pinned_host_stats

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA initialised: the stats are real here")
    got = pinned_host_stats()
    assert isinstance(got, str) and got.startswith("not measurable with this torch")


def test_measure_step_with_host_figures_measures_the_same_device_step():
    """``measure_step(..., host=True)`` (what section g's arms call): the device figures are those of the step
    measured without it, and on a CPU every host figure says "n/a on CPU"."""
    import torch

    from effpass.planning.measure import measure_step
    from effpass.testing.memory import NA_ON_CPU

    def run(host):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        x = torch.randn(32, 64)
        return measure_step(model, model, (x,), warmup=1, loss_fn=lambda out: out.sum(), host=host)

    plain, host = run(False), run(True)
    assert plain.host is None and (host.peak_bytes, host.start_bytes, host.loss) == (plain.peak_bytes, plain.start_bytes, plain.loss)
    assert host.host["pinned_peak_bytes"] == host.host["rss_growth_bytes"] == NA_ON_CPU
