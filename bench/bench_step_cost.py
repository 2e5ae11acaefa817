"""The cost model of one training step (effpass.cost, docs/cost_model.md): estimates, not measurements.

Two workloads (``--head``): the whole step of a Llama-3-8B-width model (2 layers, bf16, fake tensors) for plain
compile, the default pipeline and each pass alone (passes needing torch.distributed left out); or the loss head
alone at hidden 2,048, vocabulary 128,256 (the shape of the one H100 run; ``--head-hidden 4096``: Llama-3-8B's
head at 8,192 tokens): unfused vs fuse_cross_entropy (on a GPU its Triton tiles) vs its chunked torch kernel. FLOPs as FlopCounterMode counts them; bytes, host syncs and kernels by effpass.cost;
times by its roofline on the named GPU (``--gpu h100|h200``). Runs on a CPU (fake tensors).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
#: the head shape of the one H100 run (issue 36): hidden 2,048 (Llama-3.2-1B's width), vocabulary 128,256
HEAD_2048 = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_key_value_heads": 8}
#: passes that need torch.distributed (not replayed by the one-process cost model)
DISTRIBUTED = ("shard_sequence", "wrap_fsdp")
PASSES = ("apply_autocast", "checkpoint_activations", "compress_activations", "fuse_attention", "fuse_cross_entropy",
          "inject_lora", "offload_activations", "pack_sequences", "quantize_linear", "scale_loss", "step_in_backward",
          "tile_sequence")
#: the fused head on its chunked torch kernel (what a CPU runs; on a GPU the default takes the Triton tiles)
CHUNKED = "fuse_cross_entropy_chunked"
ARMS = ("plain", "default") + PASSES + (CHUNKED,)


def worker(arm: str, cfg: dict, device: str) -> dict:
    from effpass.cost import config_step_cost

    head = cfg["workload"] == "head"
    wide = head and cfg.get("head_hidden", 2048) == 4096
    model_cfg = HEAD_2048 if head and not wide else LLAMA3_8B
    passes = [] if arm == "plain" else None if arm == "default" else [arm]
    if arm == CHUNKED:
        from effpass.passes import FuseCrossEntropy

        passes = [FuseCrossEntropy(kernel="chunked")]
    seq = cfg["seq"] or (2048 if head and not wide else 8192)
    t0 = time.process_time()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(model_cfg, f)
    try:
        cost = config_step_cost(f.name, 1, seq, dtype="bfloat16", passes=passes, device=cfg["gpu"],
                                layers=1 if head else 2, tensors="fake", per_pass=arm == "default")
    finally:
        os.unlink(f.name)
    return {"arm": arm, "workload": cfg["workload"], "gpu": cfg["gpu"], "seq": seq,
            "hidden": model_cfg["hidden_size"], "pipeline": cost.pipeline,
            "totals": cost.totals, "head": cost.head, "passes": cost.passes, "notes": cost.notes,
            "cpu_s": round(time.process_time() - t0, 1),
            "top_ops": dict(sorted(cost.ops.items(), key=lambda kv: -kv[1]["est_time_s"])[:15])}


def _table(results: list[dict], part: str) -> str:
    ref = next((r for r in results if r.get("arm") == "plain" and part in r), None)
    rows = ["| arm | passes | FLOPs | bytes | host syncs | kernels | est. time (ms) | vs plain: FLOPs, bytes, syncs, "
            "kernels |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if part not in r:
            rows.append(f"| {r.get('arm')} | {r.get('status', 'error')}: "
                        f"{(str(r.get('error', '?')).strip().splitlines() or ['?'])[-1][:120]} | | | | | | |")
            continue
        t = r[part]
        delta = "" if ref is None or r is ref else ", ".join(
            f"{t[k] - ref[part][k]:+,}" for k in ("flops", "bytes", "host_syncs", "kernels"))
        rows.append(f"| {r['arm']} | {', '.join(r['pipeline']) or '-'} | {t['flops']:.4g} | {t['bytes']:.4g} | "
                    f"{t['host_syncs']} | {t['kernels']} | {t['est_time_s'] * 1e3:.3f} | {delta} |")
    return "\n".join(rows)


def markdown(run: dict) -> str:
    res = run.get("results", [])
    return ("Estimates of the cost model (docs/cost_model.md), not measurements.\n\n## The whole step\n\n"
            f"{_table(res, 'totals')}\n\n## The loss head\n\n{_table(res, 'head')}\n")


def _configure(args, cfg: dict) -> None:
    cfg["workload"] = "head" if args.head or args.head_hidden else "pipeline"
    cfg["head_hidden"] = args.head_hidden or 2048
    cfg["gpu"] = args.gpu


def _extra(ap) -> None:
    ap.add_argument("--head", action="store_true", help="the loss head alone (hidden 2,048, vocabulary 128,256)")
    ap.add_argument("--head-hidden", type=int, choices=(2048, 4096), default=0,
                    help="the loss head alone at this width: 2048 (= --head) or 4096 (Llama-3-8B's head, 8,192 tokens)")
    ap.add_argument("--gpu", default="h100", help="the GPU the roofline estimates for (h100, h200)")


def main():
    sys.path.insert(0, HERE)
    import driver

    driver.main(__file__, workload="step_cost", arms=ARMS, worker=worker, markdown=markdown,
                cpu_shape=dict(seq=0, workload="pipeline", gpu="h100"), quick=dict(seq=512), overrides=("seq",),
                extra_args=_extra, configure=_configure,
                jobs=lambda chosen, cfg: [(a, {}) for a in chosen
                                          if (cfg["workload"] == "pipeline" and a != CHUNKED)
                                          or a in ("plain", "fuse_cross_entropy", CHUNKED)])


if __name__ == "__main__":
    main()
