"""Memory plans made ahead of a GPU window and shipped with the bench (issue 37: the GPU proof's planned arms).

A CUDA plan is what effpass makes on any machine (``plan_memory(..., device="cuda")`` replays the step on CPU fake
tensors and models CUDA's caching allocator), and at Llama-3-8B widths it costs minutes of CPU: more than a
planned arm's deadline on the GPU machine. So a bench script with planned arms makes its plans here
(``python bench/<script>.py --make-plans [--device cuda] [--quick]``) into ``bench/plans/<workload>_<device>_<key>.json``,
and on the device its arm loads the plan whose key (the planning-relevant shape, exactly) matches, compiles with
the saved pipeline and only measures. Each file holds the key, the plan (pipeline as the planner chose it: pass
names and options; predicted live and device peak; the max-seq answer where there is one), the effpass commit,
``effpass._source_digest()`` (effpass's core and built-in passes) at the time and the CPU seconds it took. A plan
whose digest differs from the running tree's is still used and its row says ``plan_stale: true``; no file, or a
file that no longer builds (a pass renamed): the arm plans on the spot as before. Every row says
``plan_source``: ``"precomputed"`` or ``"on the device"``.
"""
from __future__ import annotations

import hashlib
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PLANS = os.path.join(HERE, "plans")


def _digest(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def path(workload: str, key: dict, folder: str | None = None) -> str:
    """``<folder>/<workload>_<device>_<hash of key>.json`` (``key`` must hold ``device``); the folder: ``folder``
    (a script's ``--plans``), else ``EFFPASS_BENCH_PLANS`` (``bench/gpu_proof.py --plans``), else ``bench/plans``."""
    folder = folder or os.environ.get("EFFPASS_BENCH_PLANS") or PLANS
    return os.path.join(folder, f"{workload}_{key['device']}_{_digest(key)}.json")


def plan_record(plan) -> dict:
    """What the arm needs of a ``MemoryPlan``: the pipeline (names and options), the optimizer it builds, the chosen
    candidate, its predicted live peak and device peak (CUDA: reserved segments), the host memory it holds
    (``Candidate.host_bytes``: pinned buffers of offloaded activations, optimizer states on the host; 0 when none),
    whether its transfers outlast the compute, whether it fits."""
    est = plan.chosen.estimate
    return {"plan": plan.chosen.name, "passes": [{"name": p.name, "options": p.options()} for p in plan.passes],
            "optimizer": plan.optimizer, "predicted_bytes": est.peak_bytes if est else None,
            "predicted_device_bytes": plan.peak_bytes, "host_bytes": plan.chosen.host_bytes,
            "transfer_bound": plan.chosen.transfer_bound, "plan_fits": plan.chosen.fits, "budget_bytes": plan.budget}


def host_bytes_of(record: dict) -> int:
    """The plan's predicted host bytes (``plan_record``'s ``host_bytes``). A record saved before plans had a host
    figure: 0 when its pipeline holds no host option (no pass that offloads to the host, AdamW on the device: what
    the planner counts for it), else a ValueError (remake the plan rather than guess)."""
    if "host_bytes" in record:
        return int(record["host_bytes"])
    from effpass.pass_api import registered_passes

    reg = registered_passes()
    if record.get("optimizer", "adamw") in ("adamw", None) and not any(
            getattr(reg.get(p["name"]), "host_offload", False) for p in record["passes"]):
        return 0
    raise ValueError(f"plan {record.get('plan')!r} holds a host option but has no host_bytes: remake it (--make-plans)")


def save(workload: str, key: dict, record: dict, cpu_s: float, folder: str | None = None) -> str:
    """Write one plan file (atomically); its path."""
    import effpass
    import driver

    doc = {"workload": workload, "key": key, "record": record, "commit": driver.git_state()["commit"],
           "dirty": driver.git_state()["dirty"], "source_digest": effpass._source_digest(),
           "made_on": driver.meta(workload, "cpu")["device"], "cpu_s": round(cpu_s, 1),
           "date": driver.meta(workload, "cpu")["date"]}
    out = path(workload, key, folder)
    driver._write_atomic(out, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    return out


def load(workload: str, key: dict, folder: str | None = None) -> tuple[dict, dict] | None:
    """(the saved record, the row's provenance fields) of the plan for exactly ``key``, or None when there is
    none. Provenance: ``plan_source``, ``plan_commit``, ``plan_stale`` (the source digest differs)."""
    p = path(workload, key, folder)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        doc = json.load(f)
    if doc.get("key") != key:  # a hash collision or a hand-edited file: not this shape
        return None
    import effpass

    return doc["record"], {"plan_source": "precomputed", "plan_commit": doc.get("commit"),
                           "plan_stale": doc.get("source_digest") != effpass._source_digest(),
                           "plan_cpu_s": doc.get("cpu_s")}


def passes_of(record: dict) -> list:
    """The saved pipeline as pass objects (``effpass.make_pass``; raises if a pass or option no longer exists)."""
    from effpass.pass_registry import make_pass

    return [make_pass(p["name"], p["options"]) for p in record["passes"]]


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def add_options(ap) -> None:
    """The scripts' ``--make-plans`` and ``--plans DIR`` (``driver.main(extra_args=...)``)."""
    ap.add_argument("--make-plans", action="store_true",
                    help="make this script's planned arms' plans here (for --device's shape) into bench/plans/ and exit")
    ap.add_argument("--plans", default=None, help="the folder of precomputed plans (default bench/plans)")
