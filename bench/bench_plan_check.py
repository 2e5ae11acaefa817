"""The planner against the device: the measured peak of a planned QLoRA step at 2-3 lengths against the planner's
prediction, and the longest length that fits a cap (issue 37 (g)).

The step: QLoRA as a user writes it (``QuantizeLinear(scheme="nf4")`` on every linear but the head, LoRA r=16 on
every projection), AdamW over the adapters, and **the planner's plan** for the memory cap ``cap_gib``
(``effpass.plan_memory``: it adds checkpointing, the fused loss or what else fits the step into the cap with the
least extra compute). Arms (each in its own process, ``bench/driver.py``):

* ``predict_measure`` (a sweep over ``seq``): ``plan_memory`` on the model as it sits on the device (the
  replay of the step on fake tensors, for the device's allocator on CUDA), then the measured peak of the step
  compiled with the plan's passes (``effpass.planning.measure.measure_step``: allocator peak); relative error of
  the predicted live peak; the plan and its predicted device peak (CUDA: reserved segments) on the row too.
* ``cpu_replay`` (the same sweep): the same plan made from a meta copy of the model, as on a machine without a
  GPU, predicted for the run's device (``device="cuda"`` on a GPU run); compare with the measured rows above.
* ``maxseq``: ``effpass.plan_max_seq`` under ``cap_gib`` for the same QLoRA step, then the measured peak at the
  length it answers (the answer must fit the cap).
* ``host_plan`` (the same sweep, issue 39.6): a plan that holds host memory, measured. The user's passes are
  QLoRA plus the passes of the planner's ``plan_max_seq`` plan (``HOST_USER_PASSES``: full checkpointing, the
  fused loss, sequence tiles), the cap ``host_cap_gib`` below what that pipeline reaches, so the planner adds a host
  option (offloaded activations, AdamW on the host); then measured as ``predict_measure`` is.

Every measuring arm (``predict_measure``, ``host_plan``) records the device peak (predicted and measured, their
ratio) and the host side (``effpass.testing.memory.HostMeter``): ``predicted_host_bytes`` (the plan's
``host_bytes``: pinned buffers of offloaded activations, optimizer states on the host, as the planner counts them),
``measured_host_bytes`` (the pinned ``CachingHostAllocator``'s ``allocated_bytes.peak`` over the measured step,
``torch.cuda.host_memory_stats()``, feature-tested: else "not measurable with this torch"), ``rss_growth_bytes``
(coarse: the process's peak RSS over the measured step less its RSS before the optimizer and the warm-up) and
``host_ratio`` (measured/predicted). On a CPU run every measured host figure is "n/a on CPU" (the device is the
host), never a number.

``--set qlora=false``: the LoRA step on the unquantized base instead (bf16 on a GPU).

    python bench/bench_plan_check.py --device cuda        # Llama-3-8B widths, 2 layers, 4k/8k tokens, cap 12 GiB
    python bench/bench_plan_check.py --quick              # a smoke run on the CPU
    python bench/bench_plan_check.py --device cuda --seq 4096 8192 --cap_gib 12 --make-plans
                                                          # the arms' CUDA plans made here (bench/plans.py)
    python bench/bench_plan_check.py --device cuda --seq 4096 8192 --arms host_plan --make-plans
                                                          # the host arm's plans (cap host_cap_gib)

With a plan made ahead for the arm's shape (``bench/plans/``) the arms plan nothing on the device:
``predict_measure`` and ``maxseq`` compile the saved pipeline and measure, ``cpu_replay`` reports the saved
figures (``plan_source: "precomputed"``); without one they plan on the spot (``"on the device"``).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
import plans  # noqa: E402

ARMS = ("predict_measure", "cpu_replay", "maxseq", "host_plan")
#: the host arm's caps on a GPU (GiB, per length): under the predicted reserved peak of its pipeline without host
#: memory (3.416 GiB at 4,096 tokens, 3.906 GiB at 8,192) and above that with AdamW's states on the host (3.397,
#: 3.887 GiB): made on this CPU with effpass.estimate_memory(device="cuda") (docs/gpu_proof.md, section g)
HOST_CAP_GPU = {"4096": 3.4, "8192": 3.9}
GPU_SHAPE = dict(hidden=4096, ffn=14336, layers=2, heads=32, kv_heads=8, vocab=128256, seq=[4096, 8192, 16384],
                 dtype="bfloat16", rank=16, cap_gib=12.0, step=1024, lowering="eager", qlora=True,
                 host_cap_gib=HOST_CAP_GPU)
CPU_SHAPE = dict(hidden=256, ffn=688, layers=2, heads=8, kv_heads=4, vocab=8192, seq=[512, 1024], dtype="float32",
                 rank=16, cap_gib=0.25, step=256, lowering="eager", qlora=True, host_cap_gib=0.25)
QUICK = dict(hidden=64, ffn=128, layers=1, heads=4, kv_heads=2, vocab=1024, seq=[128], cap_gib=0.03, step=64,
             host_cap_gib=0.03)
#: the host arm's user passes besides QLoRA: the passes of the planner's own ``plan_max_seq`` plan under 12 GiB (full
#: checkpointing, the fused loss, sequence tiles; tiles of 1,024 rows, its option at these lengths), so that the
#: planner's candidates are the host options (offloaded activations, AdamW on the host) and step_in_backward
HOST_USER_PASSES = ({"name": "checkpoint_activations", "options": {"policy": "full"}},
                    {"name": "fuse_cross_entropy", "options": {}}, {"name": "tile_sequence", "options": {"tile_rows": 1024}})
TARGETS = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]


def build(cfg: dict, device: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=max(_seqs(cfg)) * 4,
                          bos_token_id=0, eos_token_id=0)
    conf.use_cache = False
    with torch.device(device):
        model = tf.LlamaForCausalLM(conf).to(getattr(torch, cfg["dtype"]))
    return model.train()


def _seqs(cfg):
    return cfg["seq"] if isinstance(cfg["seq"], (list, tuple)) else [cfg["seq"]]


def passes(cfg):
    """The user's passes (the planner adds to them): QLoRA (NF4 base, LoRA adapters), or LoRA alone."""
    from effpass import make_pass
    from effpass.passes import InjectLoRA, QuantizeLinear

    lora = [InjectLoRA(rank=cfg["rank"], targets=TARGETS)]
    extra = [make_pass(p["name"], p["options"]) for p in HOST_USER_PASSES] if cfg.get("_host") else []
    return ([QuantizeLinear(scheme="nf4", exclude=["lm_head"])] if cfg.get("qlora", True) else []) + lora + extra


def host_cfg(cfg: dict, seq: int) -> dict:
    """The host arm's configuration at ``seq`` tokens: the user's passes with HOST_USER_PASSES, the cap
    ``host_cap_gib`` (one for every length, or ``{"<seq>": GiB}``: a cap per length)."""
    cap = cfg["host_cap_gib"]
    if isinstance(cap, dict) and str(seq) not in cap:
        raise ValueError(f"host_plan: no host cap for {seq} tokens (host_cap_gib {cap}); --set host_cap_gib=GIB")
    return {**cfg, "cap_gib": cap[str(seq)] if isinstance(cap, dict) else cap, "_host": True}


def plan(model, inputs, cfg, device=None):
    """The planner's plan for the cap (``effpass.plan_memory``); its chosen candidate's estimate."""
    from effpass.planning import plan_memory

    p = plan_memory(model, inputs, int(cfg["cap_gib"] * 2**30), passes=passes(cfg), lowering=cfg["lowering"],
                    device=device)
    return p, _figures(plans.plan_record(p))


def _figures(rec: dict) -> dict:
    """A plan record's figures as the rows show them."""
    return {"plan": rec["plan"], "predicted_bytes": rec["predicted_bytes"], "predicted_gib": rec["predicted_bytes"] / 2**30,
            "predicted_device_bytes": rec["predicted_device_bytes"], "plan_fits": rec["plan_fits"],
            "optimizer": rec.get("optimizer") or "adamw", "predicted_host_bytes": plans.host_bytes_of(rec),
            "transfer_bound": rec.get("transfer_bound", False)}


def host_figures(got: dict, host: dict) -> dict:
    """The row's host columns: the plan's predicted host bytes against the measured ones (``HostMeter``: the pinned
    allocator's peak; the RSS growth as a second, coarser figure), and the ratio measured/predicted. A figure
    that cannot be measured (a CPU run: the device is the host; a torch without host stats) is the reason, never
    a number."""
    pred, pinned = got["predicted_host_bytes"], host["pinned_peak_bytes"]
    if not isinstance(pinned, int):
        ratio = pinned
    elif not pred:
        ratio = "n/a: the plan predicts no host memory"
    else:
        ratio = pinned / pred
    return {"measured_host_bytes": pinned, "measured_host_active_bytes": host["pinned_active_peak_bytes"],
            "rss_growth_bytes": host["rss_growth_bytes"], "host_ratio": ratio, "host_measure": host["host_measure"]}


def plan_key(cfg: dict, device: str, seq: int | None = None) -> dict:
    """What a plan depends on (``bench/plans.py``): the model, the user's passes, the cap; the length (one
    plan per ``seq``), or for ``plan_max_seq`` (``seq=None``) its step and the model's position limit."""
    keys = ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "dtype", "rank", "cap_gib", "lowering", "qlora")
    key = {"device": device, **{k: cfg.get(k, True if k == "qlora" else None) for k in keys}}
    if cfg.get("_host"):  # the host arm's plan: its user passes are part of what it depends on
        key["user_passes"] = [dict(p) for p in HOST_USER_PASSES]
    return {**key, "seq": seq} if seq is not None else {**key, "maxseq_step": cfg["step"],
                                                          "max_position": max(_seqs(cfg)) * 4}


def _saved(cfg: dict, device: str, seq: int | None = None):
    """(record, provenance, the saved pipeline) of the precomputed plan, or (None, provenance, None) when the arm
    plans on the spot (no file, or one whose passes no longer build: said on the row)."""
    got = plans.load("plan_check", plan_key(cfg, device, seq), cfg.get("_plans"))
    if got is None:
        return None, {"plan_source": "on the device"}, None
    try:
        return got[0], got[1], plans.passes_of(got[0])
    except Exception as e:  # noqa: BLE001 - a pass renamed since the plan was made
        return None, {"plan_source": "on the device", "plan_load_error": f"{type(e).__name__}: {e}"[:300]}, None


def make_plans(cfg: dict, device: str, folder: str | None = None, arms=ARMS) -> list[str]:
    """The plans ``arms`` need for ``device``, made here on a meta model (a CUDA plan is the same on any
    machine): one per length (predict_measure compiles it; cpu_replay reports it), and ``plan_max_seq``'s answer."""
    from effpass.planning import plan_max_seq

    out = []
    todo = [(cfg, s) for s in (_seqs(cfg) if {"predict_measure", "cpu_replay"} & set(arms) else [])]
    todo += [(host_cfg(cfg, s), s) for s in (_seqs(cfg) if "host_plan" in arms else [])]
    for c, seq in todo:
        c0 = plans.cpu_seconds()
        p, _ = plan(build({**c, "seq": seq}, "meta"), make_inputs(seq, "meta", c["vocab"]), c, device=device)
        out.append(plans.save("plan_check", plan_key(c, device, seq), plans.plan_record(p),
                              plans.cpu_seconds() - c0, folder))
        print(f"wrote {out[-1]}", flush=True)
    if "maxseq" not in arms:
        return out
    c0 = plans.cpu_seconds()
    res = plan_max_seq(build(cfg, "meta"), lambda s: make_inputs(s, "meta", cfg["vocab"]), int(cfg["cap_gib"] * 2**30),
                       passes=passes(cfg), step=cfg["step"], probes=tuple(cfg["step"] * k for k in (2, 4, 8)),
                       lowering=cfg["lowering"], device=device)
    rec = {**plans.plan_record(res.plan), "max_seq": res.seq}
    out.append(plans.save("plan_check", plan_key(cfg, device), rec, plans.cpu_seconds() - c0, folder))
    print(f"wrote {out[-1]}", flush=True)
    return out


def configure(args, cfg: dict) -> None:
    cfg["_plans"] = args.plans
    if args.make_plans:
        import torch

        make_plans(cfg, args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"),
                   args.plans, [a for a in args.arms.split(",") if a])
        raise SystemExit(0)


def make_inputs(seq: int, device: str, vocab: int):
    import torch

    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    import effpass
    from effpass.planning.measure import measure_step

    seq = cfg["seq"]
    t0 = time.perf_counter()
    if arm == "cpu_replay":  # the plan made where there is no GPU: a meta model, predicted for the run's device
        rec, prov, _ = _saved(cfg, device, seq)
        if rec is not None:  # made ahead on a CPU (bench/plans.py): what this arm exists to show
            return {"arm": arm, "seq": seq, **_figures(rec), "predicted_for": device, **prov,
                    "predict_s": round(time.perf_counter() - t0, 2)}
        model = build(cfg, "meta")
        _, got = plan(model, make_inputs(seq, "meta", cfg["vocab"]), cfg, device=device)
        return {"arm": arm, "seq": seq, **got, "predicted_for": device, **prov,
                "predict_s": round(time.perf_counter() - t0, 2)}
    model = build(cfg, device)
    if arm == "host_plan":  # the same measurement, for the plan with host memory (the host arm's passes and cap)
        cfg = host_cfg(cfg, seq)
    if arm in ("predict_measure", "host_plan"):
        inputs = make_inputs(seq, device, cfg["vocab"])
        rec, prov, pipeline = _saved(cfg, device, seq)
        if rec is not None:  # the plan made ahead for this device (a CUDA plan is the same on any machine)
            got = {**_figures(rec), **prov}
        else:
            p, got = plan(model, inputs, cfg)
            pipeline, got = p.passes, {**got, **prov}
        t1 = time.perf_counter()
        driver.partial({"arm": arm, "seq": seq, **got, "status": "partial"})
        torch._dynamo.reset()
        from effpass.testing import dynamo_counters

        with dynamo_counters() as counters:
            compiled = effpass.compile(model, passes=pipeline, lowering=cfg["lowering"])
            meas = measure_step(compiled, model, inputs, optimizer=got["optimizer"], warmup=1, host=True)
        err = (got["predicted_bytes"] - meas.peak_bytes) / meas.peak_bytes
        return {"arm": arm, "seq": seq, **got, "measured_bytes": meas.peak_bytes, "measured_gib": meas.peak_bytes / 2**30,
                "rel_error": err, "device_ratio": meas.peak_bytes / got["predicted_bytes"],
                **host_figures(got, meas.host), "cap_gib": cfg["cap_gib"], "fits_cap": meas.peak_bytes <= cfg["cap_gib"] * 2**30,
                "loss": meas.loss, "predict_s": round(t1 - t0, 2), "measure_s": round(time.perf_counter() - t1, 2),
                "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"]}
    if arm == "maxseq":
        cap = int(cfg["cap_gib"] * 2**30)
        from effpass.planning import plan_max_seq

        rec, prov, pipeline = _saved(cfg, device)
        if rec is None:
            res = plan_max_seq(model, lambda s: make_inputs(s, device, cfg["vocab"]), cap, passes=passes(cfg),
                               step=cfg["step"], probes=tuple(cfg["step"] * k for k in (2, 4, 8)),
                               lowering=cfg["lowering"])
            rec, pipeline = {**plans.plan_record(res.plan), "max_seq": res.seq}, res.plan.passes
        length = rec["max_seq"]
        t1 = time.perf_counter()
        driver.partial({"arm": arm, "max_seq": length, "status": "partial", "plan_s": round(t1 - t0, 2), **prov})
        torch._dynamo.reset()  # the check: the plan's own pipeline, measured at the length it answers
        compiled = effpass.compile(model, passes=pipeline, lowering=cfg["lowering"])
        from effpass.testing import dynamo_counters

        with dynamo_counters() as counters:
            meas = measure_step(compiled, model, make_inputs(length, device, cfg["vocab"]),
                                optimizer=rec.get("optimizer") or "adamw", warmup=1)
        return {"arm": arm, "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"], "cap_gib": cfg["cap_gib"], "max_seq": length, "plan": rec["plan"],
                "predicted_bytes_at_max_seq": rec["predicted_device_bytes"], **prov, "measured_bytes_at_max_seq": meas.peak_bytes,
                "measured_gib_at_max_seq": meas.peak_bytes / 2**30, "fits": meas.peak_bytes <= cap,
                "plan_s": round(t1 - t0, 2), "measure_s": round(time.perf_counter() - t1, 2)}
    raise ValueError(f"bench_plan_check: unknown arm {arm!r}; choose from {ARMS}")


def jobs(chosen, cfg):
    out = []
    for a in chosen:
        out += [(a, {})] if a == "maxseq" else [(a, {"seq": s}) for s in _seqs(cfg)]  # host_plan: per length too
    return out


def _mib(v) -> str:
    """Bytes as MiB; a host figure that was not measured is its reason (``n/a on CPU ...``)."""
    return f"{v / 2**20:.1f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else ("" if v is None else str(v))


def markdown(run: dict) -> str:
    rows = run.get("results", [])
    cpu = {r["seq"]: r for r in rows if r.get("arm") == "cpu_replay" and r.get("status") == "ok"}
    meas = [r for r in rows if r.get("arm") in ("predict_measure", "host_plan") and r.get("status") == "ok"]
    s = run.get("shape", {})
    lines = [f"Planner vs device: Llama hidden {s.get('hidden')}, {s.get('layers')} layers, vocabulary {s.get('vocab')}, "
             f"{s.get('dtype')}, {'QLoRA (NF4 base)' if s.get('qlora', True) else 'LoRA'} r={s.get('rank')}, AdamW, "
             f"plus the planner's plan for {s.get('cap_gib')} GiB (host_plan: the user's passes with "
             f"{', '.join(p['name'] for p in HOST_USER_PASSES)}, the plan for the row's cap {s.get('host_cap_gib')}); lowering "
             f"{s.get('lowering')}. Host: predicted = the plan's host bytes; measured = the pinned allocator's peak "
             f"(torch.cuda.host_memory_stats allocated_bytes.peak over the measured step); RSS growth: coarse.", "",
             "| arm | tokens | cap (GiB) | plan | predicted on the device (GiB) | CPU replay (GiB) | measured (GiB) | "
             "error (device) | error (CPU) | predicted host (MiB) | measured host: pinned peak (MiB) | "
             "host measured/predicted | RSS growth (MiB, coarse) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    seen = {r["seq"] for r in meas if r["arm"] == "predict_measure"}
    for m in sorted(meas, key=lambda r: (r["arm"] != "predict_measure", r["seq"])) + [
            {"arm": "cpu_replay", "seq": q} for q in sorted(set(cpu) - seen)]:
        c = cpu.get(m["seq"], {}) if m["arm"] != "host_plan" else {}
        mb = m.get("measured_bytes")
        ce = f"{(c['predicted_bytes'] - mb) / mb:+.2%}" if c and mb else ""
        ratio = m.get("host_ratio", "")
        lines.append(f"| {m['arm']} | {m['seq']} | {m.get('cap_gib', '')} | {m.get('plan', c.get('plan', ''))} | "
                     f"{m.get('predicted_gib', float('nan')):.4g} | {c.get('predicted_gib', float('nan')):.4g} | "
                     f"{m.get('measured_gib', float('nan')):.4g} | "
                     f"{(format(m['rel_error'], '+.2%') if 'rel_error' in m else '')} | {ce} | "
                     f"{_mib(m.get('predicted_host_bytes', c.get('predicted_host_bytes')))} | "
                     f"{_mib(m.get('measured_host_bytes'))} | {format(ratio, '.4f') if isinstance(ratio, float) else ratio} | "
                     f"{_mib(m.get('rss_growth_bytes'))} |")
    for r in rows:
        if r.get("arm") == "maxseq" and r.get("status") == "ok":
            lines += ["", f"Longest length under {r['cap_gib']} GiB (plan_max_seq): {r['max_seq']} tokens; measured there "
                      f"{r['measured_gib_at_max_seq']:.4g} GiB ({'fits' if r['fits'] else 'DOES NOT FIT'}), plan {r['plan']}."]
        elif r.get("status") not in ("ok", None):
            lines += ["", f"- {r.get('arm')} {r.get('seq', '')}: {r.get('status')}: {str(r.get('error', ''))[-160:]}"]
    return "\n".join(lines)


if __name__ == "__main__":
    driver.main(__file__, workload="plan_check", arms=ARMS, worker=worker, cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE,
                quick=QUICK, markdown=markdown, jobs=jobs, deadline_s=900, overrides=("seq", "cap_gib", "qlora", "host_cap_gib"),
                extra_args=plans.add_options, configure=configure)
