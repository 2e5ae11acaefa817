"""Tiled MLPs at a long sequence: Arctic Long Sequence Training's ``TiledMLP`` (DeepSpeed) against
effpass's ``TileSequence``, one forward + backward of a Llama-shaped model, all arms in one run, each in a
fresh process.

Arms (same seed, weights and tokens; SDPA attention everywhere; no checkpointing, no optimizer: the MLP
tiling alone is compared):

* ``hf_eager``: Hugging Face eager, untiled (the reference for loss and gradients)
* ``alst_tiled_mlp``: ALST's recipe as its docstring shows it: ``LlamaMLP.forward`` patched to call
  ``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP.apply`` with ``ceil(seq / hidden)`` shards
  (its default; the all-reduce of the shard count across ranks dropped: one process), eager. Needs
  ``pip install deepspeed`` (its pure-Python parts import on a CPU-only machine; it is not in the ``bench``
  extra's mandatory set because it pulls its own build tooling)
* ``effpass_untiled``: ``effpass.compile(model, passes=[FuseAttention()])``: effpass's capture with its attention
  fusion only (without it the captured SDPA call keeps transformers' dense causal mask for backward, 64 MiB at
  4,096 tokens, which Hugging Face eager does not hold: SDPA takes ``is_causal`` there)
* ``effpass_tiled``: ``passes=[FuseAttention(), TileSequence()]`` (default 1,024 rows per tile)
* ``effpass_tiled_alst_rows``: ``TileSequence(tile_rows=ceil(seq / shards))``: the tile size ALST's arm uses

effpass arms use ``--lowering`` (default eager on the CPU: Inductor's cold compiles cost minutes there).

Per arm: the step's peak above what is live before it (CPU: ``effpass.testing.memory.peak_memory``,
allocator events; CUDA: ``max_memory_allocated``), median time of a forward + backward, the loss, and the
largest relative difference of any parameter's gradient from ``hf_eager``'s (tiling is lossless: only the
summation order of the weight gradients changes).

    PYTHONPATH=<deepspeed's folder if not installed> python bench/bench_tiled_mlp.py --seq 8192
    # writes bench/results/tiled_mlp_<device>.{json,md}
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import llama, time_steps, token_batches  # noqa: E402

ARMS = ("hf_eager", "alst_tiled_mlp", "effpass_untiled", "effpass_tiled", "effpass_tiled_alst_rows")
CPU_SHAPE = dict(vocab=2048, hidden=256, ffn=1024, layers=2, heads=4, kv_heads=2, seq=8192, batch=1,
                 dtype="float32", steps=3, warmup=1, lowering="eager")
GPU_SHAPE = dict(vocab=32000, hidden=2048, ffn=8192, layers=4, heads=16, kv_heads=4, seq=65536, batch=1,
                 dtype="bfloat16", steps=10, warmup=2, lowering="inductor")


def build(cfg: dict, device: str):
    return llama(cfg, device), token_batches(cfg, device)[0]


def alst_shards(cfg: dict) -> int:
    return math.ceil(cfg["seq"] / cfg["hidden"])


def patch_alst(shards: int) -> None:
    """ALST's monkey patch of LlamaMLP.forward (DeepSpeed's TiledMLP docstring), for one process."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self, x):
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, shards, compute_params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    from effpass.testing.memory import peak_memory

    extra = {}
    if arm == "alst_tiled_mlp":
        try:
            patch_alst(alst_shards(cfg))
        except Exception as e:  # noqa: BLE001 - recorded as the arm's reason, the other arms still run
            return {"arm": arm, "error": f"ALST's TiledMLP does not import: {type(e).__name__}: {e}"}
        import deepspeed

        extra = {"shards": alst_shards(cfg), "rows_per_tile": math.ceil(cfg["seq"] / alst_shards(cfg)),
                 "deepspeed": deepspeed.__version__}
    model, ids = build(cfg, device)
    run = model
    if arm.startswith("effpass"):
        import effpass
        from effpass.passes import FuseAttention, TileSequence

        passes = [FuseAttention()]
        if arm == "effpass_tiled":
            passes.append(TileSequence())
        elif arm == "effpass_tiled_alst_rows":
            passes.append(TileSequence(tile_rows=math.ceil(cfg["seq"] / alst_shards(cfg))))
        run = effpass.compile(model, passes=passes, lowering=cfg["lowering"])
    losses = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))

    timing = time_steps(step, cfg, device == "cuda")
    model.zero_grad(set_to_none=True)
    _, peak = peak_memory(step, device)
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    out = {"arm": arm, "peak_bytes": peak, **timing,
           "loss": losses[0], "load": os.getloadavg()[0], **extra}
    if arm.startswith("effpass_tiled"):
        import effpass

        st = effpass.report(run).stats("tile_sequence")
        out["effpass_stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
    path = os.environ.get("TILED_MLP_GRADS")
    if path:
        torch.save(grads, f"{path}.{arm}.pt")
    return out


def grad_diff(path: str, arm: str) -> float | None:
    import torch

    try:
        ref = torch.load(f"{path}.hf_eager.pt")
        got = torch.load(f"{path}.{arm}.pt")
    except FileNotFoundError:
        return None
    if set(ref) != set(got):
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n in ref)


def markdown(doc: dict) -> str:
    m, s, rows = doc["meta"], doc["shape"], doc["results"]
    ok = {r["arm"]: r for r in rows if "error" not in r}
    ref = ok.get("hf_eager", {})
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"# Tiled MLPs: ALST vs effpass ({m['device']})", "",
             f"{m['date']}; torch {m['torch']}, transformers {m['transformers']}, deepspeed {m.get('deepspeed')}; "
             f"load average {m.get('load_average')}.",
             f"Llama-shaped: hidden {s['hidden']}, ffn {s['ffn']}, {s['layers']} layers, heads {s['heads']}/"
             f"{s['kv_heads']}, vocab {s['vocab']}, batch {s['batch']} x {s['seq']} tokens, {s['dtype']}, SDPA; "
             f"one forward + backward; effpass lowering {s['lowering']}; {s['steps']} timed steps.", "",
             "| arm | step peak | vs hf_eager | step (median) | CPU time | vs hf_eager | loss | max rel. grad diff | "
             "tiles | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            why = r["error"].strip().splitlines()[-1][:200] if r["error"].strip() else "crashed"
            lines.append(f"| {r['arm']} | did not run: {why} |||||||||")
            continue

        def rat(k):
            return f"{r[k] / ref[k]:.2f}" if ref.get(k) else "-"

        tiles = r.get("shards") or (r.get("effpass_stats") or {}).get("tiles", "-")
        gd = r.get("grad_rel_diff")
        lines.append(f"| {r['arm']} | {mib(r['peak_bytes'])} | {rat('peak_bytes')} | {r['step_s'] * 1e3:,.0f} ms | "
                     f"{r['cpu_s'] * 1e3:,.0f} ms | {rat('cpu_s')} | {r['loss']:.6f} | "
                     f"{'-' if gd is None else f'{gd:.1e}'} | {tiles} | {r['load']:.1f} |")
    lines += ["", "Step peak: allocated during one forward + backward above what is live before it. Tiles: ALST's "
              "shards per MLP call; effpass's total tiles over the model. Max rel. grad diff: the largest "
              "max|g - g_ref| / max|g_ref| over the parameters, against hf_eager. CPU times are noisy on the shared "
              "2-core machine: compare within this run only.", ""]
    return "\n".join(lines)


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        gpath = os.path.join(tmp, "grads")

        def diff(r: dict) -> None:
            r["grad_rel_diff"] = grad_diff(gpath, r["arm"])

        driver.main(__file__, arms=ARMS,
                    quick=dict(vocab=256, hidden=64, ffn=128, layers=1, heads=2, kv_heads=1, seq=512, steps=1, warmup=0),
                    requires={"alst_tiled_mlp": ("deepspeed",)},
                    cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE, worker=worker, markdown=markdown,
                    workload="tiled_mlp", packages=("deepspeed",), overrides=("seq", "steps", "lowering"),
                    env={"TILED_MLP_GRADS": gpath}, after_arm=diff)


if __name__ == "__main__":
    main()
