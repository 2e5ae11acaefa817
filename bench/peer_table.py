"""Regenerate README's "effpass vs peers" table from the results under bench/results/.

Every row comes from one result file written by one bench script in one run (all arms of a workload in the
same run, each in a fresh process where the script does so): the peer arm and the effpass arm, the ratio
effpass / peer of memory and of time, the device, the date and the load where the script recorded them.
Workloads whose result file is absent are listed as "not measured yet" rather than left out.

    python bench/peer_table.py            # rewrites the table between the markers in README.md
    python bench/peer_table.py --print    # prints it only
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import driver  # noqa: E402

RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
BEGIN, END = "<!-- peers:begin (bench/peer_table.py) -->", "<!-- peers:end -->"


def _load(stem, label="", has=()):
    """The newest run of ``bench/results/<stem>.json`` with this ``label`` (a label or a tuple of labels; the
    driver's default run is ``""``) and, if ``has`` names arms, with one of them; None if there is none."""
    labels = (label,) if isinstance(label, str) else tuple(label)
    for run in reversed(driver.runs(os.path.join(RESULTS, stem))):
        if (run.get("label") or "") not in labels:
            continue
        arms = {r.get("arm") for r in run.get("results", []) if isinstance(r, dict)} | set(run.get("arms") or ())
        if has and not arms & set(has):
            continue
        return run
    return None


def _best_arms(run):
    """A run's arms: the historical ``arms`` summary, or per arm its best round (lowest median step)."""
    if "arms" in run:
        return run["arms"]
    best = {}
    for r in run.get("results", []):
        if r.get("status", "ok") == "ok" and (r["arm"] not in best or
                                              r["median_step_s"] < best[r["arm"]]["median_step_s"]):
            best[r["arm"]] = r
    return best


def _r(x, y):
    return f"{x / y:.2f}x" if x and y else "-"


def fused_loss(rows):
    peers = ("cce", "liger", "trl_chunked")
    _fused_loss_file(rows, "cross_entropy_cpu", _load("cross_entropy_cpu", ("", "peers"), has=peers))
    _fused_loss_file(rows, "cross_entropy_cuda-h100", _load("cross_entropy_cuda-h100", ("", "peers"), has=peers))


def _fused_loss_file(rows, name, d):
    if d is None:
        if name.endswith("_cpu"):
            rows.append(("fused linear + cross-entropy", "Liger, Cut Cross-Entropy, TRL chunked, torch chunked",
                         "not measured yet", "", "", "bench/bench_cross_entropy.py"))
        return
    meta = d["meta"]
    cuda = "cuda" in name
    tkey, tlabel = ("step_s", " step time") if cuda else ("cpu_s", " CPU time")
    for vocab in sorted({r["vocab"] for r in d["results"]}):
        arms = {r["arm"]: r for r in d["results"] if r["vocab"] == vocab}
        ours = arms.get("effpass")
        eager = arms.get("eager")
        if ours is None or eager is None:
            continue
        for peer, label in (("eager", "HF eager"), ("compile", "torch.compile"), ("torch_lce", "torch F.linear_cross_entropy (chunked)"),
                            ("cce", "Cut Cross-Entropy"), ("trl_chunked", "TRL ChunkedLogProbFunction"),
                            ("liger", "Liger-Kernel fused linear CE")):
            p = arms.get(peer)
            if p is None:
                continue
            where = f"{meta['device']}, {meta['date'][:10]}, V={vocab:,}" + (f", load {p['load']:.0f}" if p.get('load') else "")
            if "error" in p:
                why = p["error"].strip().splitlines()[-1][:90]
                if "active drivers" in why:
                    why = "Triton kernels, no GPU here (triton: 0 active drivers)"
                rows.append(("fused linear + cross-entropy", label, "did not run: " + why,
                             "", where, "bench/bench_cross_entropy.py"))
                continue
            mem = f"{_r(ours['peak_bytes'], p['peak_bytes'])} ({ours['peak_bytes'] / 2**20:,.0f} vs {p['peak_bytes'] / 2**20:,.0f} MiB; peer {_r(p['peak_bytes'], eager['peak_bytes'])} of eager)"
            rows.append(("fused linear + cross-entropy", label, mem, _r(ours[tkey], p[tkey]) + tlabel, where,
                         "bench/bench_cross_entropy.py"))


def lora(rows):
    d = _load("lora_cpu")
    if d is None:
        return
    a, v = _best_arms(d), d.get("versions") or d["meta"]
    for peer, label in (("peft_eager", "PEFT (eager)"), ("peft_compile", "PEFT + torch.compile")):
        rows.append(("LoRA", label, _r(a["effpass"]["peak_rss_gib"], a[peer]["peak_rss_gib"]) + " peak RSS",
                     _r(a["effpass"]["median_step_s"], a[peer]["median_step_s"]) + " step",
                     f"{v['device']}, {v['date'][:10]}", "bench/bench_lora.py"))


def checkpointing(rows):
    d = _load("checkpoint_cpu")
    sac = _load("checkpoint_cpu", "arms none, torch_sac, effpass_ops")  # a run of those arms alone
    if d is None and sac is None:
        return
    for peer, ours, label in (("torch_budget", "effpass_budget", "torch activation_memory_budget"),
                              ("torch_sac", "effpass_ops", "torch selective checkpointing (save matmuls/attention)"),
                              ("torch_block_ckpt", "effpass_full", "torch.utils.checkpoint per block")):
        run = next((x for x in (d, sac) if x and peer in _checkpoint_arms(x) and ours in _checkpoint_arms(x)), None)
        if run is None:
            rows.append(("activation checkpointing", label, "not measured yet (arm absent from the results)", "", "",
                         "bench/bench_checkpoint.py"))
            continue
        p, o = _checkpoint_arms(run)[peer], _checkpoint_arms(run)[ours]
        mem = (f"{_r(o['saved_bytes_hook'], p['saved_bytes_hook'])} saved for backward ({o['saved_bytes_hook'] / 2**20:,.1f}"
               f" vs {p['saved_bytes_hook'] / 2**20:,.1f} MiB, saved-tensor hook)")
        rows.append(("activation checkpointing", label, mem, _r(o["step_s_median"], p["step_s_median"]) + " step (wall)",
                     _where(run.get("versions") or run["meta"]), "bench/bench_checkpoint.py"))


def _checkpoint_arms(run):
    """Per arm: the historical summary, or the first round with the median step over the rounds."""
    if "arms" in run:
        return run["arms"]
    import statistics

    out = {}
    for arm in {r["arm"] for r in run["results"] if r.get("status") == "ok"}:
        rs = [r for r in run["results"] if r["arm"] == arm and r.get("status") == "ok"]
        out[arm] = {**rs[0], "step_s_median": statistics.median(r["step_s_median"] for r in rs)}
    return out


def packing(rows):
    runs = [x for x in (_load("packing_cpu"), _load("packing_cpu", "quick"), _load("packing_cpu", "idle")) if x]
    # the run with the peer as its users run it (transformers' collator, correct masks) first
    d = next((x for x in runs if any(r["arm"] == "hf_flattening" for r in x["results"])), runs[0] if runs else None)
    if d is None:
        return
    a = {r["arm"]: r for r in d["results"] if r.get("status", "ok") == "ok"}
    p, o = a.get("hf_flattening"), a.get("packed_effpass")
    label = "HF DataCollatorWithFlattening + SDPA (use_cache=False)"
    if p is None:
        p, label = a.get("packed_plain_hf"), "HF DataCollatorWithFlattening layout (plain HF; examples attend to each other)"
    if p and o:
        rows.append(("padding-free packing", label,
                     _r(o["peak_bytes"], p["peak_bytes"]) + " peak",
                     f"{o['useful_tokens_per_s'] / p['useful_tokens_per_s']:.2f}x useful tokens/s (higher is better)",
                     _where(d["meta"]) + f", {d['meta']['lengths'].split(',')[0]}, {d['meta']['model'].split(', ')[-1]}",
                     "bench/bench_packing.py"))


def moe(rows):
    d = _load("moe_cpu")
    if d is None:
        return rows.append(("MoE LoRA (experts)", "PEFT target_parameters", "not measured yet", "", "", "bench/bench_moe.py"))
    arms = d.get("arms") or {r["arm"]: r for r in d.get("results", [])}
    ours = arms.get("effpass")
    meta = d.get("meta") or d.get("versions") or {}
    for peer, label in (("peft_eager", "PEFT target_parameters (eager)"), ("peft_compile", "PEFT target_parameters + torch.compile")):
        p = arms.get(peer)
        if not p or not ours:
            continue
        pk = next((k for k in ("peak_bytes", "peak_step_bytes", "peak") if k in p), None)
        tk = next((k for k in ("median_step_s", "step_s", "cpu_s") if k in p), None)
        rows.append(("MoE LoRA (experts)", label, _r(ours.get(pk), p.get(pk)) + " peak" if pk else "-",
                     _r(ours.get(tk), p.get(tk)) + " step" if tk else "-",
                     f"{meta.get('device', '?')}, {str(meta.get('date', '?'))[:10]}", "bench/bench_moe.py"))


def _where(meta, load=None):
    load = load if load is not None else (meta.get("load_average") or [None])[0]
    return f"{meta['device']}, {meta['date'][:10]}" + (f", load {load:.0f}" if load else "")


def _failed(p):
    why = p["error"].strip().splitlines()[-1][:90] if p["error"].strip() else "crashed"
    return "did not run: " + why


def qlora(rows):
    d = _load("qlora_peers_cpu")
    script = "bench/bench_qlora_peers.py"
    if d is None:
        return rows.append(("QLoRA", "PEFT + torchao NF4, PEFT + bitsandbytes NF4", "not measured yet", "", "", script))
    arms = {r["arm"]: r for r in d["results"]}
    ours = arms.get("effpass_nf4")
    for peer, label in (("peft_torchao_nf4", "PEFT + torchao NF4 (to_nf4)"),
                        ("peft_bnb_nf4", "PEFT + bitsandbytes 4-bit NF4 (BitsAndBytesConfig)")):
        p = arms.get(peer)
        if p is None or ours is None:
            continue
        if "error" in p or "error" in ours:
            rows.append(("QLoRA", label, _failed(p if "error" in p else ours), "", _where(d["meta"]), script))
            continue
        hw_o, hw_p = ours["live_bytes"] + ours["peak_bytes"], p["live_bytes"] + p["peak_bytes"]
        mem = (f"{_r(hw_o, hw_p)} high-water ({hw_o / 2**20:,.0f} vs {hw_p / 2**20:,.0f} MiB; step peak "
               f"{_r(ours['peak_bytes'], p['peak_bytes'])}), {_r(ours['base_weight_bytes'], p['base_weight_bytes'])} "
               f"base weight bytes")
        where = _where(d["meta"], p.get("load")) + (f"; {d['meta']['note']}" if d["meta"].get("note") else "")
        rows.append(("QLoRA", label, mem, _r(ours["cpu_s"], p["cpu_s"]) + " CPU time", where, script))


def optim8bit(rows):
    d = _load("optim8bit_cpu")
    script = "bench/bench_optim8bit.py"
    if d is None:
        return rows.append(("8-bit optimizer states", "torchao AdamW8bit, bitsandbytes AdamW8bit", "not measured yet",
                            "", "", script))
    arms = {r["arm"]: r for r in d["results"]}
    ours = arms.get("effpass_adamw8bit")
    for peer, label in (("torchao_adamw8bit", "torchao AdamW8bit"), ("bnb_adamw8bit", "bitsandbytes AdamW8bit")):
        p = arms.get(peer)
        if p is None or ours is None:
            continue
        if "error" in p or "error" in ours:
            rows.append(("8-bit optimizer states", label, _failed(p if "error" in p else ours), "", _where(d["meta"]),
                         script))
            continue
        hw_o, hw_p = ours["live_bytes"] + ours["peak_bytes"], p["live_bytes"] + p["peak_bytes"]
        mem = (f"{_r(ours['state_bytes'], p['state_bytes'])} state bytes (effpass builds torchao's AdamW8bit), "
               f"{_r(hw_o, hw_p)} high-water ({hw_o / 2**20:,.0f} vs {hw_p / 2**20:,.0f} MiB; + step_in_backward)")
        rows.append(("8-bit optimizer states", label, mem, _r(ours["cpu_s"], p["cpu_s"]) + " CPU time",
                     _where(d["meta"], p.get("load")), script))


def tiled(rows):
    d = _load("tiled_mlp_cpu")
    script = "bench/bench_tiled_mlp.py"
    if d is None:
        return rows.append(("tiled MLP (long sequence)", "ALST TiledMLP (DeepSpeed)", "not measured yet", "", "", script))
    arms = {r["arm"]: r for r in d["results"]}
    p = arms.get("alst_tiled_mlp")
    seq = d["shape"]["seq"]
    for ours_arm, label in (("effpass_tiled", "ALST TiledMLP (DeepSpeed), effpass at its default tile"),
                            ("effpass_tiled_alst_rows", "ALST TiledMLP (DeepSpeed), effpass at ALST's tile size")):
        o = arms.get(ours_arm)
        if p is None or o is None:
            continue
        if "error" in p or "error" in o:
            rows.append(("tiled MLP (long sequence)", label, _failed(p if "error" in p else o), "",
                         _where(d["meta"]), script))
            continue
        mem = (f"{_r(o['peak_bytes'], p['peak_bytes'])} step peak ({o['peak_bytes'] / 2**20:,.0f} vs "
               f"{p['peak_bytes'] / 2**20:,.0f} MiB; T={seq:,}; losses equal: {o['loss']:.6f} vs {p['loss']:.6f})")
        rows.append(("tiled MLP (long sequence)", label, mem, _r(o["cpu_s"], p["cpu_s"]) + " CPU time",
                     _where(d["meta"], p.get("load")), script))


#: where committed GPU proof runs live: bench/results/gpu_proof/<device tag>/proof.jsonl (scripts/gpu_proof.sh's OUTDIR)
PROOF_DIR = os.path.join(RESULTS, "gpu_proof")
#: the code a GPU row measures: a row taken before a change under these paths is marked stale
MEASURED_CODE = ("effpass", "passes")
_TIME_KEYS = (("median_step_ms", 1e-3), ("median_step_s", 1.0), ("step_s", 1.0))
_MEM_KEYS = (("peak_above_start_bytes", 1), ("peak_mem_gib", 2**30), ("peak_bytes", 1))


def stale(commit: str, paths=MEASURED_CODE) -> str | None:
    """``None`` when the code under ``paths`` is the same at ``commit`` and in the working tree; else why not."""
    import subprocess

    root = os.path.dirname(HERE)
    try:
        p = subprocess.run(["git", "-C", root, "diff", "--quiet", commit, "--", *paths], capture_output=True, timeout=60)
    except Exception as e:  # noqa: BLE001 - no git: unknown, said so
        return f"unknown ({type(e).__name__})"
    if p.returncode == 0:
        return None
    return f"stale: {'/'.join(paths)} changed since {commit[:10]}" if p.returncode == 1 else f"unknown commit {commit[:10]}"


def proof_lines(folder: str = PROOF_DIR) -> list[dict]:
    """Every line of every committed ``proof.jsonl`` (real runs only: dry runs are rehearsals, not measurements)."""
    import json

    out = []
    for dirpath, _, files in sorted(os.walk(folder)):
        if "proof.jsonl" in files:
            with open(os.path.join(dirpath, "proof.jsonl")) as f:
                out += [ln for ln in (json.loads(x) for x in f if x.strip())
                        if ln.get("device_tag", "cpu") != "cpu" and ln.get("phase") != "prewarm"]
    return out


def _figure(row, keys):
    return next((row[k] * scale for k, scale in keys if isinstance(row.get(k), (int, float))), None)


def gpu_proof(rows, lines=None):
    """One row per (section, peer arm) of the newest GPU proof run of each device: effpass's arm against the peer's
    in the same run, memory and time; rows whose loss drifted or that did not run say so; stale rows are marked."""
    lines = proof_lines() if lines is None else lines
    if not lines:
        rows.append(("GPU proof (scripts/gpu_proof.sh)", "every peer", "not run on a GPU yet", "", "",
                     "bench/gpu_proof.py"))
        return
    newest = {}
    for ln in lines:  # the newest run per device: its lines share a commit and a start date
        key = ln.get("device_tag")
        if key not in newest or ln.get("date", "") > newest[key]:
            newest[key] = ln.get("date", "")
    for dev, date in sorted(newest.items()):
        run = [ln for ln in lines if ln.get("device_tag") == dev and ln.get("date", "") == date]
        commit = str(run[0].get("commit", "?"))
        flag = stale(commit) if commit != "?" else "unknown commit"
        where = f"{run[0].get('device')}, {date[:10]}, commit {commit[:10]}" + (f" ({flag})" if flag else "")
        for key in dict.fromkeys(ln["section"] for ln in run):
            sec = [ln for ln in run if ln["section"] == key]
            ours = next((ln for ln in sec if str(ln.get("arm", "")).startswith("effpass")), None)
            for p in sec:
                if p is ours or str(p.get("arm", "")).startswith("effpass") or p.get("S") is not None:
                    continue
                title = f"({key}) {p.get('section_title', '')}"
                if ours is None or ours.get("status") != "ok" or p.get("status") != "ok":
                    bad = ours if ours is None or ours.get("status") != "ok" else p
                    why = "no effpass arm" if bad is None else f"{bad.get('arm')} {bad.get('status')}"
                    rows.append((title, p.get("arm"), f"did not run: {why}", "", where, "bench/gpu_proof.py"))
                    continue
                if ours.get("loss_drift") or p.get("loss_drift"):
                    rows.append((title, p.get("arm"), "loss drifts from the reference arm: not compared", "", where,
                                 "bench/gpu_proof.py"))
                    continue
                mo, mp = _figure(ours, _MEM_KEYS), _figure(p, _MEM_KEYS)
                to, tp = _figure(ours, _TIME_KEYS), _figure(p, _TIME_KEYS)
                mem = f"{_r(mo, mp)} ({mo / 2**20:,.0f} vs {mp / 2**20:,.0f} MiB)" if mo and mp else "-"
                rows.append((title, p.get("arm"), mem, _r(to, tp) + " step time" if to and tp else "-", where,
                             "bench/gpu_proof.py"))


def table() -> str:
    rows: list[tuple] = []
    for fn in (gpu_proof, fused_loss, lora, qlora, optim8bit, checkpointing, packing, tiled, moe):
        fn(rows)
    out = ["| workload | peer (as its users install it) | effpass memory vs peer | effpass time vs peer | measured on | script |",
           "|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    out += ["", "Ratios below 1 favour effpass (except tokens/s). CPU figures come from the shared 2-core machine; "
            "compare within a row only. GPU rows: one H100 run (2026-11-27, bench/results/gpu_check_cuda-h100.md), taken "
            "before the fused head stopped keeping an fp32 weight-sized gradient buffer on bf16 models (not rerun on a "
            "GPU since; docs/passes/fuse_cross_entropy.md); the "
            "other scripts' GPU arms are written and have not run. bitsandbytes (0.50) and DeepSpeed's TiledMLP ran on "
            "the CPU."]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args()
    text = table()
    if args.print:
        print(text)
        return
    with open(README) as f:
        readme = f.read()
    if BEGIN not in readme:
        raise SystemExit(f"README.md has no {BEGIN!r} marker")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(README, "w") as f:
        f.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    print(text)


if __name__ == "__main__":
    main()
