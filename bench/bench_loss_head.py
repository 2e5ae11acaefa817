"""The loss head alone: hidden states -> vocabulary logits -> cross-entropy, forward and backward, one step.

The workload users compare fused losses on (issue 37 (a), issue 36): on a GPU, Llama-3-8B widths (hidden 4,096,
vocabulary 128,256, 8,192 tokens, bf16 operands); on a CPU a smaller shape. Arms, each in its own process
(``bench/driver.py``):

* ``eager``: ``F.cross_entropy(h @ W.T, labels)`` as a model computes it (full logits).
* ``compile``: the same under plain ``torch.compile`` (Inductor), unfused.
* ``effpass``: the same module under ``effpass.compile(passes=["fuse_cross_entropy"])``.
* ``effpass_chunked``: the same with ``FuseCrossEntropy(kernel="chunked")`` (the chunked torch kernel; on a GPU the
  default takes the Triton tiles).
* ``torch_lce``: torch's ``F.linear_cross_entropy`` where the installed torch has it.
* ``liger``: Liger's ``LigerFusedLinearCrossEntropyLoss``; ``cce``: Apple's Cut Cross-Entropy.

Each row: median step time (forward + backward of the loss w.r.t. the hidden states and the head weight), the
peak bytes above the start of a step, the loss (compared with the ``eager`` arm's by the caller: an arm whose
loss drifts is not a speed), and the first step's wall time (cold compile included).

    python bench/bench_loss_head.py                  # CPU shape, every arm
    python bench/bench_loss_head.py --device cuda    # hidden 4,096, vocabulary 128,256, 8,192 tokens, bf16
    python bench/bench_loss_head.py --quick          # a smoke run
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

ARMS = ("eager", "compile", "effpass", "effpass_chunked", "torch_lce", "liger", "cce")
GPU_SHAPE = dict(hidden=4096, vocab=128256, tokens=8192, dtype="bfloat16", steps=10, warmup=2, lowering="inductor")
CPU_SHAPE = dict(hidden=256, vocab=16384, tokens=1024, dtype="float32", steps=3, warmup=1, lowering="inductor")
QUICK = dict(hidden=64, vocab=1024, tokens=128, steps=1, warmup=0, lowering="eager")
REQUIRES = {"liger": ("liger_kernel",), "cce": ("cut_cross_entropy",)}


def inputs(cfg: dict, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg["dtype"])
    h = (torch.randn(cfg["tokens"], cfg["hidden"], generator=g) * 0.5).to(device=device, dtype=dtype)
    w = (torch.randn(cfg["vocab"], cfg["hidden"], generator=g) / cfg["hidden"] ** 0.5).to(device=device, dtype=dtype)
    labels = torch.randint(0, cfg["vocab"], (cfg["tokens"],), generator=g)
    labels[:: 17] = -100  # some ignored positions, as padded batches have
    return h.requires_grad_(), torch.nn.Parameter(w), labels.to(device)


def loss_fn(arm: str, w, device: str, lowering: str = "inductor"):
    """``f(h, labels) -> loss`` for the arm (the head weight ``w`` bound in)."""
    import torch
    import torch.nn.functional as F

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = w

        def forward(self, h, labels):
            logits = F.linear(h, self.weight).float()  # as HF's loss upcasts the logits
            return F.cross_entropy(logits, labels, ignore_index=-100)

    head = Head()
    if arm == "eager":
        return head
    if arm == "compile":
        return torch.compile(head)
    if arm in ("effpass", "effpass_chunked"):
        import effpass
        from effpass.passes import FuseCrossEntropy

        fce = FuseCrossEntropy(kernel="chunked" if arm == "effpass_chunked" else "effpass")
        return effpass.compile(head, passes=[fce], lowering=lowering)
    if arm == "torch_lce":
        if not hasattr(F, "linear_cross_entropy"):
            raise ImportError("this torch has no F.linear_cross_entropy")
        return lambda h, labels: F.linear_cross_entropy(h, w, labels, ignore_index=-100)
    if arm == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, labels: loss(w, h, labels)
    if arm == "cce":
        from cut_cross_entropy import linear_cross_entropy

        impl = "cce" if device == "cuda" else "torch_compile"
        return lambda h, labels: linear_cross_entropy(h, w, labels, impl=impl)
    raise ValueError(f"bench_loss_head: unknown arm {arm!r}; choose from {ARMS}")


def worker(arm: str, cfg: dict, device: str) -> dict:
    from effpass.testing.memory import peak_memory

    h, w, labels = inputs(cfg, device)
    try:
        f = loss_fn(arm, w, device, cfg.get("lowering", "inductor"))
    except ImportError as e:
        return {"arm": arm, "status": "not installed", "error": str(e)}
    cuda = device == "cuda"
    losses: list[float] = []

    def step():
        h.grad = None
        w.grad = None
        loss = f(h, labels)
        loss.backward()
        losses.append(loss.detach())  # read back after the timed steps: no host sync inside a step

    from _common import timed as timed_step

    def timed():
        return timed_step(step, cuda)

    from effpass.testing import dynamo_counters

    with dynamo_counters() as counters:  # graph breaks and recompiles over every step
        first = timed()  # cold: compiles included
        driver.partial({"arm": arm, "status": "partial", "first_step_s": round(first, 3)})
        for _ in range(cfg["warmup"]):
            timed()
        times = [timed() for _ in range(cfg["steps"])]
    _, peak = peak_memory(step, device)
    out = {"arm": arm, "median_step_ms": round(1e3 * statistics.median(times), 3),
           "min_step_ms": round(1e3 * min(times), 3), "first_step_s": round(first, 3), "peak_above_start_bytes": peak,
           "peak_above_start_mib": round(peak / 2**20, 1), "loss": float(losses[0]), "steps": len(times),
           "logits_bytes_fp32": cfg["tokens"] * cfg["vocab"] * 4, "graph_breaks": counters["graph_breaks"],
           "recompiles": counters.get("recompiles", 0)}
    if arm in ("effpass", "effpass_chunked"):
        import effpass

        stats = effpass.report(f).stats("fuse_cross_entropy")
        out["fused_sites"] = stats.get("fused", stats.get("sites"))
        out["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    return out


def markdown(run: dict) -> str:
    rows = [r for r in run.get("results", []) if r.get("status") == "ok"]
    ref = next((r for r in rows if r["arm"] == "eager"), None)
    s = run.get("shape", {})
    lines = [f"Loss head alone: hidden {s.get('hidden')}, vocabulary {s.get('vocab')}, {s.get('tokens')} tokens, "
             f"{s.get('dtype')}; forward + backward; median of {s.get('steps')} steps after {s.get('warmup')} "
             "warm-up; peak above the step's start.", "",
             "| arm | median step (ms) | first step (s) | peak above start (MiB) | loss | vs eager loss |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = f"{abs(r['loss'] - ref['loss']) / max(abs(ref['loss']), 1e-12):.1e}" if ref else ""
        lines.append(f"| {r['arm']} | {r['median_step_ms']} | {r['first_step_s']} | {r['peak_above_start_mib']} | "
                     f"{r['loss']:.6g} | {d} |")
    for r in run.get("results", []):
        if r.get("status") != "ok":
            lines.append(f"| {r.get('arm')} | {r.get('status')}: {str(r.get('error', ''))[-100:]} | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    driver.main(__file__, workload="loss_head", arms=ARMS, worker=worker, cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE,
                quick=QUICK, markdown=markdown, requires=REQUIRES, deadline_s=600,
                overrides=("hidden", "vocab", "tokens", "steps", "warmup"))
