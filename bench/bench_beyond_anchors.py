"""Llama-3.1-8B beyond the published anchors, predicted for an 80 GiB CUDA GPU with host memory (issue 39.3).

    .venv/bin/python bench/bench_beyond_anchors.py                      # the three rows (hours on a shared CPU)
    .venv/bin/python bench/bench_beyond_anchors.py --arms qlora_344k --set screen=true
    .venv/bin/python bench/bench_beyond_anchors.py --quick              # smoke: 2 x 4,096 tokens

Each arm is one row at a fixed length (predictions only, never measured): the pipeline of the Llama-3.1-8B table
(fuse_attention + checkpoint_activations(full) + fuse_cross_entropy + tile_sequence(4096); + LoRA r=16 on the 7
projections and an NF4 base for QLoRA) with host-memory options, replayed on fake CPU tensors for
``device="cuda"`` (``effpass.planning.estimate_many``: depth extrapolation over 2, 3 and 4 blocks, or 2 and 3
with ``screen``), each variant's device peak (CUDA allocated and reserved), host bytes and estimated H100 step
time (``effpass.planning.host_memory.step_time``). ``adamw on host`` (torchao CPUOffloadOptimizer,
offload_gradients=False) is derived from the AdamW replay, not replayed; ``step_in_backward + adamw on host``
(``adamw_host``: effpass.HostOffloadAdamW, each gradient handed to it inside the compiled backward) is replayed
with that optimizer. Every CUDA row has the reserved bytes of both allocator modes: the default and expandable
segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, ``effpass.planning.cuda_allocator``).

Arms: ``qlora_344k`` (344,064 tokens > Unsloth's 342,733 on 80 GB; ``qlora_344k_stream`` the stream variant), ``full_512k`` (512,000 tokens >= ALST's 500K on
one H100), ``full_24g`` (full fine-tuning at 4,096 tokens against a 24 GiB budget); ``full_512k_host`` and
``full_24g_host``: the same with step_in_backward + AdamW on the host (issue 39.3's follow-up). Results:
bench/results/beyond_anchors_cpu.{json,md} (the file's device is the machine that predicted: CPU).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.planning import format_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from bench_memory_plan import LLAMA_31_8B  # noqa: E402

GIB = 1 << 30
#: arm -> (mode, tokens, device budget GiB, variants: (label, extra passes, optimizer derived from the AdamW replay))
ARMS = {
    "qlora_344k": ("qlora", 344064, 80, [("offload (sync)", [("offload_activations", {"separate_stream": False})], None)]),
    "qlora_344k_stream": ("qlora", 344064, 80, [("offload (stream)", [("offload_activations", {})], None)]),
    "full_512k": ("full", 512000, 80, [("offload (sync) + adamw on host",
                                        [("offload_activations", {"separate_stream": False})], "adamw_offload")]),
    "full_24g": ("full", 4096, 24, [("adamw on host", [], "adamw_offload"),
                                    ("offload (sync) + adamw on host",
                                     [("offload_activations", {"separate_stream": False})], "adamw_offload"),
                                    ("step_in_backward (AdamW on the device)", [("step_in_backward", {})], None)]),
    "full_512k_host": ("full", 512000, 80, [("offload (sync) + step_in_backward + adamw on host",
                                             [("offload_activations", {"separate_stream": False}),
                                              ("step_in_backward", {})], "adamw_host")]),
    "full_24g_host": ("full", 4096, 24, [("step_in_backward + adamw on host", [("step_in_backward", {})], "adamw_host"),
                                         ("offload (sync) + step_in_backward + adamw on host",
                                          [("offload_activations", {"separate_stream": False}),
                                           ("step_in_backward", {})], "adamw_host")]),
}
PUBLISHED = {
    "qlora_344k": "Unsloth: 342,733-token QLoRA of Llama-3.1-8B on one 80 GB GPU (offloaded checkpoints)",
    "qlora_344k_stream": "Unsloth: 342,733-token QLoRA of Llama-3.1-8B on one 80 GB GPU (offloaded checkpoints)",
    "full_512k": "ALST (arXiv 2506.13996): Llama-3-8B full fine-tuning at 500K tokens on one 80 GB H100 (tiled MLP "
                 "and loss, checkpoints offloaded to host)",
    "full_24g": "-",
    "full_512k_host": "ALST (arXiv 2506.13996): Llama-3-8B full fine-tuning at 500K tokens on one 80 GB H100 (tiled "
                      "MLP and loss, checkpoints offloaded to host)",
    "full_24g_host": "-",
}


def base_pipeline(mode: str) -> list:
    from effpass.planning.cli import LORA_TARGETS

    out = [effpass.make_pass("fuse_attention", {}), effpass.make_pass("checkpoint_activations", {"policy": "full"}),
           effpass.make_pass("fuse_cross_entropy", {}), effpass.make_pass("tile_sequence", {"tile_rows": 4096})]
    if mode in ("lora", "qlora"):
        out.append(effpass.make_pass("inject_lora", {"rank": 16, "targets": LORA_TARGETS}))
    if mode == "qlora":
        out.append(effpass.make_pass("quantize_linear", {"scheme": "nf4", "exclude": ["lm_head"]}))
    return out


def row(arm: str, seq: int | None = None, screen: bool = False, gpu: str = "h100", host_budget_gib: int = 256,
        variants: list | None = None, full_depth: bool = False) -> list[dict]:
    """The arm's variants at ``seq`` tokens (default the arm's): one dict per variant. ``full_depth``: every block
    replayed (no depth extrapolation: the reserved bytes simulated on the whole model's allocations)."""
    import effpass.passes  # noqa: F401  (registers adamw_offload, adamw8bit, adamw_host)
    from effpass.devices import DEVICES
    from effpass.memory_options import replayed_optimizer
    from effpass.planning.cli import model_from_config
    from effpass.planning.estimate import estimate_many, with_optimizer
    from effpass.planning.host_memory import step_time

    mode, default_seq, budget, all_variants = ARMS[arm]
    seq = seq or default_seq
    todo = [v for v in all_variants if variants is None or v[0] in variants]
    model = model_from_config(dict(LLAMA_31_8B))
    tok = torch.zeros(1, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    pipelines = [base_pipeline(mode) + [effpass.make_pass(n, o) for n, o in extra] for _, extra, _ in todo]
    # one replay per optimizer the replay runs (AdamW, whose twin the derived optimizers use, or adamw_host)
    replay_opt = ["adamw" if opt is None or not replayed_optimizer(opt) else opt for _, _, opt in todo]
    t0, c0 = time.perf_counter(), time.process_time()
    ests = [None] * len(todo)
    for ro in dict.fromkeys(replay_opt):
        idx = [i for i, r in enumerate(replay_opt) if r == ro]
        for i, e in zip(idx, estimate_many(model, inputs, [pipelines[i] for i in idx], ro, device="cuda",
                                           lowering="eager", screen=screen and not full_depth, workers=1,
                                           extrapolate=False if full_depth else None)):
            ests[i] = e
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = []
    for (label, extra, opt), est in zip(todo, ests):
        r = dict(arm=arm, mode=mode, seq=seq, budget_gib=budget, variant=label, screen=screen and not full_depth,
                 full_depth=full_depth, gpu=gpu,
                 host_budget_gib=host_budget_gib, wall_s=round(wall, 1), cpu_s=round(cpu, 1),
                 load=round(os.getloadavg()[0], 1), published=PUBLISHED[arm])
        if isinstance(est, BaseException):
            r["error"] = f"{type(est).__name__}: {str(est)[:500]}"
            out.append(r)
            continue
        adamw_peak = est.device_peak_bytes
        if opt is not None and not replayed_optimizer(opt):
            try:
                est = with_optimizer(est, opt, device=est.device)
            except Exception as e:  # noqa: BLE001 - the row says why (e.g. a CUDA-only optimizer step on a CPU torch)
                r["error"] = f"{opt}: {type(e).__name__}: {str(e)[:500]}"
                out.append(r)
                continue
        seconds, bound, terms = step_time(est, DEVICES[gpu], True)
        r.update(pipeline=[p.name for p in pipelines[todo.index((label, extra, opt))]], optimizer=opt or "adamw",
                 allocated_peak=est.peak_bytes, device_peak=est.device_peak_bytes, adamw_replay_peak=adamw_peak,
                 device_peak_expandable=max(est.peak_bytes, est.reserved_expandable_bytes or 0),
                 fits_expandable=max(est.peak_bytes, est.reserved_expandable_bytes or 0) <= budget * GIB,
                 optimizer_d2h=est.optimizer_d2h_bytes, optimizer_h2d=est.optimizer_h2d_bytes,
                 start_bytes=est.start_bytes, parameters=est.parameters,
                 gradients=est.gradients, optimizer_states=est.optimizer_states, activations=est.activations,
                 gradients_at_peak=est.gradients_at_peak, largest_transient=est.largest_transient,
                 non_gradient_peak=est.non_gradient_peak, phase_peaks=dict(est.phase_peaks),
                 host_bytes=est.host_bytes, fits=est.device_peak_bytes <= budget * GIB,
                 host_fits=est.host_bytes <= host_budget_gib * GIB,
                 peak_at=f"{est.peak_phase} / {est.peak_graph} / {est.peak_node}", flops=est.flops,
                 forward_flops=est.forward_flops, est_step_s=seconds, transfer_bound=bound,
                 terms={k: round(v, 3) for k, v in terms.items()},
                 provisional=est.provisional,
                 offload_d2h=est.offload_d2h_bytes, offload_h2d=est.offload_h2d_bytes,
                 notes=[n[:300] for n in est.notes])
        print({k: v for k, v in r.items() if k not in ("notes", "published")}, flush=True)
        out.append(r)
    return out


def worker(arm: str, cfg: dict, device: str) -> dict:
    rows = row(arm, seq=cfg.get("seq") or None, screen=bool(cfg.get("screen")), gpu=cfg["gpu"],
               host_budget_gib=cfg["host_budget_gib"], full_depth=bool(cfg.get("full_depth")))
    driver.partial({"rows": rows})
    return {"arm": arm, "rows": rows}


def markdown(run: dict) -> str:
    cfg = run["shape"]
    rows = driver.result_rows(run)
    md = ["# Llama-3.1-8B beyond the anchors: predicted for a CUDA GPU with host memory (not measured)\n",
          f"One row per (arm, variant), batch 1 at a fixed length, predicted on fake CPU tensors for device='cuda' "
          f"(eager lowering, bf16, depth extrapolation; 'screened' = 2 and 3 blocks only, 'all 32 blocks' = no "
          f"extrapolation, else 2, 3 and 4). Device peak = CUDA caching-allocator reserved bytes, default mode "
          f"(allocated beside it); 'expandable' = reserved with expandable segments (each pool's live bytes in "
          f"2 MiB pages; '-': not recorded by that run); host = pinned + plain host bytes; est. step on "
          f"{cfg['gpu'].upper()} = FLOPs at the bf16 matmul ceiling with the host-link transfers "
          f"(effpass.planning.host_memory.step_time; the CPU AdamW step of the host optimizers is not timed). "
          f"Host budget "
          f"stated: {cfg['host_budget_gib']} GiB. Seconds: wall / CPU of the arm's one replay call, one process "
          f"(EFFPASS_PLAN_WORKERS=1), 1-minute load average.\n",
          "| arm | tokens | variant | device peak (allocated) | budget | fits | expandable: reserved, fits | host | "
          "est. step | peak at | seconds | published |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['arm']} | {r['seq']:,} | {r['variant']} | error: {r['error'][:120]} | | | | | | | | |")
            continue
        step = f"{r['est_step_s']:.1f} s" + (" transfer-bound" if r["transfer_bound"] else "")
        exp = (f"{format_bytes(r['device_peak_expandable'])}, {r['fits_expandable']}"
               if r.get("device_peak_expandable") else "-")
        md.append(f"| {r['arm']} | {r['seq']:,} | {r['variant']} | {format_bytes(r['device_peak'])} "
                  f"({format_bytes(r['allocated_peak'])}) | {r['budget_gib']} GiB | {r['fits']} | {exp} | "
                  f"{format_bytes(r['host_bytes'])} | {step} | {r['peak_at'][:70]} | {r['wall_s']} / {r['cpu_s']} CPU "
                  f"({r['load']}{', screened' if r['screen'] else ''}"
                  f"{', all 32 blocks' if r.get('full_depth') else ''}) "
                  f"| {r['published']} |")
    for r in rows:
        if r.get("caveat"):
            md.append(f"\n{r['arm']} ({r['variant']}, {r['seq']:,} tokens): {r['caveat']}")
    return "\n".join(md) + "\n"


def main() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "inductor"))
    os.environ.setdefault("EFFPASS_PLAN_WORKERS", "1")
    cfg = dict(seq=0, screen=False, gpu="h100", host_budget_gib=256, full_depth=False)
    driver.main(__file__, workload="beyond_anchors", arms=tuple(ARMS), worker=worker, markdown=markdown,
                cpu_shape=cfg, quick=dict(seq=4096, screen=True), overrides=tuple(cfg), deadline_s=4 * 3600,
                meta_extra=lambda cfg: {"argv": ["bench/bench_beyond_anchors.py"] + sys.argv[1:]})


if __name__ == "__main__":
    main()
