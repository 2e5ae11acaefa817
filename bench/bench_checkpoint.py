"""Benchmark of ``checkpoint_activations`` against the alternatives, one training step of a Llama-style model.

Arms (each in a fresh subprocess, same seed and batch, interleaved over ``--repeats``):

* ``none``: no checkpointing (effpass backend, no passes)
* ``torch_block_ckpt``: per-block ``torch.utils.checkpoint`` (HF ``gradient_checkpointing_enable``)
* ``torch_sac``: torch's selective activation checkpointing per block
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts`` as the ``context_fn`` of HF's non-reentrant
  gradient checkpointing), policy: save the outputs of matmuls and attention, recompute everything else
  (torchtitan's op-level SAC without its every-other-matmul rule)
* ``torch_budget``: torch's own ``activation_memory_budget=0.5`` (the partitioner's knapsack)
* ``effpass_ops``: ``CheckpointActivations()`` (default policy)
* ``effpass_full``: ``CheckpointActivations(policy="full")``
* ``effpass_budget``: ``CheckpointActivations(budget=0.5)``

Per arm: median step time, bytes saved for backward (summed by a ``saved_tensors_hooks`` pack hook over
every tensor the compiled step saves, each storage once, parameters excluded: the same measure for every
arm), peak memory (GPU: ``torch.cuda.max_memory_allocated``; CPU: not measured), and recompute FLOPs.
Recompute FLOPs of the effpass arms come from the pass's stats; torch's budget arm is analysed on the same
joint graph with ``partition_stats(memory_budget=0.5)``, so the two budget arms are compared like for like.

GPU (when present): a ~1B Llama shape (hidden 2048, 16 layers, GQA 32/8 heads, ffn 8192, one sequence of
4096 tokens), bf16 weights, SDPA attention, Inductor. CPU: a small shape (hidden 256, 4 layers, seq 512),
fp32, eager lowering (Inductor cold compiles cost minutes on the 2-core machines): the CPU numbers are for
the saved-bytes figures; CPU step times are noisy and only comparable as ratios within one run.

    python bench/bench_checkpoint.py                 # all arms, appends to bench/results/checkpoint_<device>.{json,md}
    python bench/bench_checkpoint.py --arms none,effpass_ops --repeats 3 --quick

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import timed  # noqa: E402

ARMS = ("none", "torch_block_ckpt", "torch_sac", "torch_budget", "effpass_ops", "effpass_full", "effpass_budget")


def shape(device: str) -> dict:
    if device == "cuda":
        return dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=32000, seq=4096, batch=1,
                    dtype="bfloat16", lowering="inductor", steps=20, warmup=3)
    return dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=1024, seq=512, batch=1,
                dtype="float32", lowering="eager", steps=5, warmup=1)


def build(cfg: dict, device: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                          bos_token_id=0, eos_token_id=0)
    conf._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(conf).to(device=device, dtype=getattr(torch, cfg["dtype"]))
    model.train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device)
    return model, {"input_ids": tokens, "labels": tokens}


def run_arm(arm: str, device: str, cfg: dict | None = None) -> dict:
    import torch

    import effpass
    from effpass.passes import CheckpointActivations
    from torch._functorch import config as fconfig

    cfg = cfg or shape(device)
    model, inputs = build(cfg, device)
    passes: list = []
    budget = 1.0
    if arm == "torch_block_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif arm == "torch_sac":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": sac_context_fn()})
    elif arm == "torch_budget":
        budget = 0.5
    elif arm == "effpass_ops":
        passes = [CheckpointActivations()]
    elif arm == "effpass_full":
        passes = [CheckpointActivations(policy="full")]
    elif arm == "effpass_budget":
        passes = [CheckpointActivations(budget=0.5)]
    joint = {}
    if arm in ("none", "torch_budget"):
        @effpass.register_pass("capture_joint_for_bench", phase="joint", replace=True)
        def _capture(gm, ctx):
            if ctx.graph_kind == "joint":
                joint["gm"] = gm
                # analyse inside the compile: partitioning a graph with random ops needs its fake mode
                if arm == "torch_budget":
                    joint["analysis"] = analyse_budget(gm, model, budget)
                else:
                    from effpass.passes.checkpoint_activations import partition_stats

                    ps = partition_stats(gm)
                    joint["analysis"] = {"saved_bytes_after": ps["saved_bytes"],
                                         "recompute_flops_after": ps["recompute_flops"]}
        passes = ["capture_joint_for_bench"]
    compiled = effpass.compile(model, passes=passes, lowering=cfg["lowering"], dump_dir=None, detailed_stats=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr:
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    def step():
        out = compiled(**inputs)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    cuda = device == "cuda"
    t0 = time.perf_counter()
    with fconfig.patch(activation_memory_budget=budget):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()  # compiles; measures the saved tensors once
    compile_s = time.perf_counter() - t0
    for _ in range(cfg["warmup"]):
        step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(cfg["steps"]):
        times.append(timed(step, cuda))
    result = {"arm": arm, "step_s_median": statistics.median(times), "step_s_min": min(times),
              "compile_s": compile_s, "saved_bytes_hook": sum(saved.values()),
              "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    st = effpass.report(compiled).stats("checkpoint_activations")
    if st:
        result.update({k: st[k] for k in ("saved_bytes_before", "saved_bytes_after", "recompute_flops_added",
                                          "recompute_flops_after") if k in st})
    result.update(joint.get("analysis", {}))
    return result


def sac_context_fn():
    """torch's selective checkpointing: matmul and attention outputs saved, everything else recomputed."""
    from functools import partial

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def analyse_budget(gm, model, budget: float, compare=(0.3, 0.5, 0.7)) -> dict:
    """torch's knapsack at ``budget`` on this joint graph, and effpass's budget mode given the bytes torch's
    knapsack reached at each fraction in ``compare`` (like for like: same graph, same byte budget)."""
    from torch._functorch import config as fconfig

    from effpass.passes.checkpoint_activations import find_blocks, forward_nodes, partition_stats, plan_budget

    with fconfig.patch(activation_memory_budget=1.0):  # this arm compiles under torch's budget: not for effpass
        return _analyse_budget(gm, model, budget, compare, find_blocks, forward_nodes, partition_stats, plan_budget)


def _analyse_budget(gm, model, budget, compare, find_blocks, forward_nodes, partition_stats, plan_budget) -> dict:
    fwd = [n for n in forward_nodes(gm.graph) if n.op == "call_function"]
    before = partition_stats(gm)["saved_bytes"]
    out = {}
    rows = []
    for frac in sorted(set(compare) | {budget}):
        ps = partition_stats(gm, memory_budget=frac)
        _, met, es = plan_budget(gm, fwd, find_blocks(fwd, (), model), ps["saved_bytes"], None, before_bytes=before)
        rows.append({"fraction": frac, "torch_saved_bytes": ps["saved_bytes"], "torch_recompute_flops": ps["recompute_flops"],
                     "effpass_saved_bytes": es["saved_bytes"], "effpass_recompute_flops": es["recompute_flops"],
                     "budget_met": met})
        if frac == budget:
            out = {"saved_bytes_after": ps["saved_bytes"], "recompute_flops_after": ps["recompute_flops"]}
    out["like_for_like"] = rows
    return out


QUICK = dict(hidden=64, layers=1, heads=2, kv_heads=1, ffn=128, vocab=256, seq=64, steps=1, warmup=0)


def worker(arm: str, cfg: dict, device: str) -> dict:
    return {"arm": arm, **run_arm(arm, device, {k: v for k, v in cfg.items() if not k.startswith("_")})}


def summarize(run: dict) -> dict:
    """The per-arm summary of a run (the median step over its repeats) in the form ``markdown`` reads."""
    rows: dict[str, list[dict]] = {}
    for r in run["results"]:
        if r.get("status") == "ok":
            rows.setdefault(r["arm"], []).append(r)
    summary = {arm: {**rs[0], "step_s_median": statistics.median(r["step_s_median"] for r in rs)}
               for arm, rs in rows.items()}
    base = summary.get("none", {})
    for r in summary.values():
        if base:
            r["saved_vs_none"] = r["saved_bytes_hook"] / max(base["saved_bytes_hook"], 1)
            r["step_vs_none"] = r["step_s_median"] / base["step_s_median"]
    failed = [r for r in run["results"] if r.get("status") != "ok"]
    return {"versions": run["meta"], "shape": run["shape"], "arms": summary, "failed": failed}


def main() -> None:
    driver.main(__file__, workload="checkpoint", arms=ARMS, worker=worker, cpu_shape=shape("cpu"),
                gpu_shape=shape("cuda"), quick=QUICK, markdown=lambda run: markdown(summarize(run)),
                overrides=("steps", "seq", "lowering"))


def markdown(doc: dict) -> str:
    v, s = doc["versions"], doc["shape"]
    lines = [f"# checkpoint_activations benchmark ({v['device']})", "",
             f"{v['date']}; torch {v['torch']}, transformers {v['transformers']}"
             + (f", triton {v['triton']}" if "triton" in v else "") + (f"; load average {v['load_average']}"
                                                                      if v.get("load_average") else "") + ".",
             f"Llama-style: hidden {s['hidden']}, {s['layers']} layers, heads {s['heads']}/{s['kv_heads']}, ffn "
             f"{s['ffn']}, vocab {s['vocab']}, batch {s['batch']} x seq {s['seq']}, {s['dtype']}, lowering "
             f"{s['lowering']}.", "",
             "| arm | saved for backward (hook) | vs none | partitioner saved bytes | recompute FLOPs | step (median) | vs none | peak |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in doc["arms"].items():
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r.get("peak_bytes") else "n/a (CPU)"
        fl = r.get("recompute_flops_after")
        lines.append(f"| {arm} | {r['saved_bytes_hook'] / 2**20:.2f} MiB | {r.get('saved_vs_none', 1):.2f} | "
                     f"{r['saved_bytes_after'] / 2**20:.2f} MiB | " if "saved_bytes_after" in r else
                     f"| {arm} | {r['saved_bytes_hook'] / 2**20:.2f} MiB | {r.get('saved_vs_none', 1):.2f} | - | ")
        lines[-1] += (f"{fl / 1e9:.3f} GFLOP | " if fl is not None else "- | ") + \
            f"{r['step_s_median'] * 1e3:.1f} ms | {r.get('step_vs_none', 1):.2f} | {peak} |"
    rows = doc["arms"].get("torch_budget", {}).get("like_for_like")
    if rows:
        lines += ["", "Like for like on the same joint graph: torch's knapsack at each `activation_memory_budget`, and "
                  "effpass's budget mode given the bytes torch's knapsack reached:", "",
                  "| torch budget | torch saved bytes | torch recompute FLOPs | effpass saved bytes | effpass recompute FLOPs | fewer FLOPs |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['fraction']} | {r['torch_saved_bytes']:,} | {r['torch_recompute_flops']:,} | "
                         f"{r['effpass_saved_bytes']:,} | {r['effpass_recompute_flops']:,} | "
                         f"{'effpass' if r['effpass_recompute_flops'] < r['torch_recompute_flops'] else 'torch'} |")
    for r in doc.get("failed", []):
        why = str(r.get("error", "")).strip().splitlines()[-1:] or ["crashed"]
        lines.append(f"\n{r['arm']} did not run ({r.get('status')}): {why[0][:200]}")
    lines += ["", "Recompute FLOPs: forward ops the backward graph recomputes (torch's FLOP formulas for "
              "matmul/attention, attention by its q/k/v shapes, one per element otherwise); for torch_budget analysed "
              "on the same joint graph. "
              "CPU step times are noisy (2 shared cores): compare ratios within this run only.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
