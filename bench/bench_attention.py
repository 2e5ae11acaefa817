"""Benchmark: a naive (hand-written) causal attention block, four ways.

Arms (each in its own subprocess, same seed and inputs):
  naive     the hand-written block run eagerly (matmul, triu mask, fp32 softmax, matmul; K/V repeated for GQA)
  sdpa      F.scaled_dot_product_attention(is_causal=True, enable_gqa=...) eagerly: the hand-fused bar
  compile   plain torch.compile on the naive block (Inductor's own attention patterns)
  effpass   effpass.compile(naive block, passes=[FuseAttention()]) with Inductor

Reported per shape and mode (fwd, fwd+bwd): median time, TFLOP/s with flash-attn's FLOP formula
(4*B*S^2*H*D, halved when causal; fwd+bwd = 3.5x fwd; anchors.md) and, on CUDA, peak memory.

GPU (when present): B*S = 16k tokens, S in 4k/8k/16k, head dim 64 and 128 (hidden 2048), bf16, MHA and GQA
(4 query heads per KV head). CPU (now): small shapes only, fp32 - CPU numbers say nothing about GPU speed.

    python bench/bench_attention.py                 # all arms, appends to bench/results/attention_<device>.{json,md}
    python bench/bench_attention.py --quick         # fewer shapes

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import timed  # noqa: E402

ARMS = ("naive", "sdpa", "compile", "effpass")
HERE = os.path.dirname(os.path.abspath(__file__))


def shapes(device: str, quick: bool):
    """(B, S, H, H_kv, D) tuples."""
    out = []
    if device == "cuda":
        for d in (64, 128):
            h = 2048 // d
            for s in ((4096, 8192) if quick else (4096, 8192, 16384)):
                for hkv in (h, h // 4):
                    out.append((16384 // s, s, h, hkv, d))
    else:
        for s in ((256,) if quick else (256, 512)):
            for hkv in (4, 1):
                out.append((2048 // s // 2, s, 4, hkv, 64))
    return out


def flops(b, s, h, d, causal=True, mode="fwd"):
    f = 4 * b * s * s * h * d // (2 if causal else 1)
    return f if mode == "fwd" else 3.5 * f


def naive_attention(q, k, v):
    import torch
    import torch.nn.functional as F

    b, h, s, d = q.shape
    hkv = k.shape[1]
    if hkv != h:  # GQA: repeat K/V heads, as Hugging Face's repeat_kv does
        k = k[:, :, None].expand(b, hkv, h // hkv, s, d).reshape(b, h, s, d)
        v = v[:, :, None].expand(b, hkv, h // hkv, s, d).reshape(b, h, s, d)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def run_arm(arm: str, device: str, quick: bool, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = []
    for (b, s, h, hkv, d) in shapes(device, quick):
        for mode in ("fwd", "fwd+bwd"):
            torch._dynamo.reset()
            row = dict(arm=arm, B=b, S=s, H=h, H_kv=hkv, D=d, mode=mode, dtype=str(dtype).removeprefix("torch."))
            try:
                if arm == "naive":
                    fn = naive_attention
                elif arm == "sdpa":
                    def fn(q, k, v):
                        kw = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
                elif arm == "compile":
                    fn = torch.compile(naive_attention)
                else:
                    import effpass
                    from effpass.passes import FuseAttention

                    class Block(torch.nn.Module):
                        def forward(self, q, k, v):
                            return naive_attention(q, k, v)

                    fn = effpass.compile(Block(), passes=[FuseAttention()], lowering="eager" if quick else "inductor")
                g = torch.Generator(device=device).manual_seed(0)
                mk = lambda *sh: torch.randn(*sh, generator=g, device=device, dtype=dtype).requires_grad_(mode != "fwd")  # noqa: E731
                q, k, v = mk(b, h, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d)

                def step():
                    if mode == "fwd":
                        with torch.no_grad():
                            return fn(q, k, v)
                    out = fn(q, k, v)
                    out.backward(torch.ones_like(out))
                    return out

                from effpass.testing import dynamo_counters

                with dynamo_counters() as counters:  # graph breaks and recompiles of this shape's compile
                    t0 = time.perf_counter()
                    step()  # warm-up (and compile)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 3)
                    for _ in range(2):
                        step()
                row.update(graph_breaks=counters["graph_breaks"], recompiles=counters["recompiles"])
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(reps):
                    times.append(timed(step, device == "cuda"))
                med = statistics.median(times)
                row.update(median_ms=round(med * 1e3, 3), min_ms=round(min(times) * 1e3, 3),
                           tflops=round(flops(b, s, h, d, True, "fwd" if mode == "fwd" else "fwd+bwd") / med / 1e12, 3))
                if device == "cuda":
                    row["peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
                if arm == "effpass":
                    row["fused"] = effpass.report(fn).stats("fuse_attention").get("fused", 0)
            except torch.OutOfMemoryError:
                row["error"] = "OOM"
            except Exception as e:  # noqa: BLE001 - a failing arm is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            results.append(row)
            driver.partial({"arm": arm, "rows": results})
    return results


def to_markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"# fuse_attention benchmark ({env.get('gpu') or env.get('device')})", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| B | S | H | H_kv | D | mode | arm | median ms | TFLOP/s | peak MiB | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['S']} | {r['H']} | {r['H_kv']} | {r['D']} | {r['mode']} | {r['arm']} | "
                     f"{r.get('median_ms', '-')} | {r.get('tflops', '-')} | {r.get('peak_mem_mib', '-')} | "
                     f"{r.get('error', '') or ('fused=' + str(r['fused']) if 'fused' in r else '')} |")
    return "\n".join(lines) + "\n"


def worker(arm: str, cfg: dict, device: str) -> dict:
    reps = cfg["reps"] or (20 if device == "cuda" else 5)
    return {"arm": arm, "reps": reps, "rows": run_arm(arm, device, cfg["quick"], reps)}


def markdown(run: dict) -> str:
    rows = []
    for res in run["results"]:
        got = res.get("rows") or (res.get("partial") or {}).get("rows")
        rows += got or [dict(arm=res["arm"], B=0, S=0, H=0, H_kv=0, D=0, mode="-",
                             error=str(res.get("error", "")).strip()[-300:])]
    key = lambda r: (r["D"], r["S"], r["H_kv"], r["mode"], ARMS.index(r["arm"]))  # noqa: E731
    m = run["meta"]
    env = {k: m.get(k) for k in ("date", "torch", "triton", "flash_attn", "python", "cpu_count")}
    return to_markdown({"device": m["device"], **env}, sorted(rows, key=key))


def main() -> None:
    driver.main(__file__, workload="attention", arms=ARMS, worker=worker, markdown=markdown,
                cpu_shape=dict(quick=False, reps=0), quick=dict(quick=True), overrides=("reps",),
                packages=("flash_attn",))


if __name__ == "__main__":
    main()
