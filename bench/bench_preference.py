"""Benchmark of fused log-probabilities (issue 27): peak memory and time of one DPO, GRPO and distillation step
of a Llama-shaped policy with a frozen reference (teacher), written in plain PyTorch the way TRL < 1.16 and
most training loops write them (``log_softmax(logits).gather(-1, labels)``, sums per sequence).

Arms (each in a fresh subprocess, same seed and batch, all in one run):

* ``eager``: the step as written; ``compile``: ``torch.compile`` of the loss module (Inductor), unfused;
* ``effpass``: ``effpass.compile(loss module)`` with the default pipeline (``fuse_cross_entropy`` rewrites the
  policy's and the reference's chosen-token log-probs into the chunked op);
* ``liger``: Liger-Kernel's chunked fused-linear losses (``LigerFusedLinearDPOLoss``, ``...GRPOLoss``
  (``loss_type="grpo"``), ``...JSDLoss`` with ``beta=0``: the forward KL) on the backbones' hidden states: pure
  PyTorch with ``torch.compile`` of the chunk function, so they run on CPU (Liger's Triton kernels do not).
* TRL's trainers: TRL 1.16's DPO/KTO/GRPO trainers compute log-probs with their own chunked op
  (``add_fused_lm_head``); effpass routes it as a custom op (``effpass/integrations/_trl_kernels.py``); not
  benchmarked here.

Losses: ``dpo`` (sigmoid DPO over one chosen/rejected pair), ``grpo`` (per-token ratio x advantage minus
beta x k3-KL to the reference, masked mean), ``distill`` (forward KL between the teacher's and the student's full
distributions: fused by effpass as one row-wise op over both heads).

CPU shape (shared 2-core machine with 23 GB; the issue's 2 x 2,048 tokens at vocabulary 128,256 hold over
8 GB eager, more than this machine can spare): fp32, hidden 64, 1 layer, vocabulary 128,256, 2 x 256 tokens.

    python bench/bench_preference.py                 # all losses and arms -> bench/results/preference_<device>.{json,md}
    python bench/bench_preference.py --arms effpass --loss dpo
    python bench/bench_preference.py --seq 2048      # the issue's 2 x 2,048 tokens (a field of the run)
    python bench/bench_preference.py --quick         # smoke run: vocabulary 1,024, 128 tokens

Each (loss, arm) runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import timed  # noqa: E402

ARMS = ("eager", "compile", "liger", "effpass")
LOSSES = ("dpo", "distill", "grpo")
SHAPE = dict(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=128256, seq=256, rows=2, dtype="float32",
             steps=1)
QUICK = dict(vocab=1024, seq=128)  # a quick check that every arm runs (not a measurement)


def build():
    import torch
    import torch.nn.functional as F
    import transformers as tf

    cfg = SHAPE
    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                          bos_token_id=0, eos_token_id=0)
    policy = tf.LlamaForCausalLM(conf).train()
    ref = tf.LlamaForCausalLM(conf).eval().requires_grad_(False)

    def logps(model, ids, labels):
        logits = model(input_ids=ids).logits[:, :-1]
        t = labels[:, 1:]
        lp = logits.float().log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return lp, (t != -100)

    class DPO(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy, self.ref = policy, ref

        def forward(self, ids, labels):
            lp, m = logps(self.policy, ids, labels)
            with torch.no_grad():
                rp, _ = logps(self.ref, ids, labels)
            pol, rf = (lp * m).sum(-1), (rp * m).sum(-1)
            return -F.logsigmoid(0.1 * ((pol[0] - rf[0]) - (pol[1] - rf[1])))

    class GRPO(DPO):
        def forward(self, ids, labels, adv):
            lp, m = logps(self.policy, ids, labels)
            with torch.no_grad():
                rp, _ = logps(self.ref, ids, labels)
            kl = torch.exp(rp - lp) - (rp - lp) - 1
            per_tok = -(torch.exp(lp - lp.detach()) * adv[:, None] - 0.04 * kl)
            return ((per_tok * m).sum(-1) / m.sum(-1)).mean()

    class Distill(DPO):
        def forward(self, ids, labels):
            s = self.policy(input_ids=ids).logits.float().log_softmax(-1)
            with torch.no_grad():
                t = self.ref(input_ids=ids).logits.float().log_softmax(-1)
            m = (labels != -100).float()
            return ((t.exp() * (t - s)).sum(-1) * m).sum() / m.sum()

    def hidden(model, ids):
        return model.model(input_ids=ids).last_hidden_state

    class LigerDPO(DPO):
        """Liger-Kernel's chunked fused-linear DPO loss (pure PyTorch + torch.compile: runs on CPU) on the
        backbones' hidden states."""

        def __init__(self):
            super().__init__()
            from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
            self.loss = LigerFusedLinearDPOLoss(beta=0.1)

        def forward(self, ids, labels):
            h = hidden(self.policy, ids)[:, :-1]
            with torch.no_grad():
                rh = hidden(self.ref, ids)[:, :-1]
            return self.loss(self.policy.lm_head.weight, h, labels[:, 1:], ref_input=rh,
                             ref_weight=self.ref.lm_head.weight)[0]

    class LigerGRPO(DPO):
        def __init__(self):
            super().__init__()
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
            self.loss = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="grpo")

        def forward(self, ids, labels, adv):
            h = hidden(self.policy, ids)[:, :-1]
            with torch.no_grad():
                rh = hidden(self.ref, ids)[:, :-1]
            t = labels[:, 1:]
            return self.loss(h, self.policy.lm_head.weight, t.clamp(min=0), (t != -100).long(), adv,
                             ref_input=rh, ref_weight=self.ref.lm_head.weight)[0]

    class LigerDistill(DPO):
        def __init__(self):
            super().__init__()
            from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
            # beta 0: the forward KL(teacher || student) of the other arms; no hard (cross-entropy) loss
            self.loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0)

        def forward(self, ids, labels):
            h = hidden(self.policy, ids).reshape(-1, cfg["hidden"])
            with torch.no_grad():
                th = hidden(self.ref, ids).reshape(-1, cfg["hidden"])
            return self.loss(h, self.policy.lm_head.weight, th, self.ref.lm_head.weight, labels.reshape(-1))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["rows"], cfg["seq"]), generator=g)
    labels = ids.clone()
    labels[:, :32] = -100  # prompt
    return policy, {"dpo": DPO, "grpo": GRPO, "distill": Distill, "liger_dpo": LigerDPO, "liger_grpo": LigerGRPO,
                    "liger_distill": LigerDistill}, ids, labels


def run_arm(arm: str, loss: str) -> dict:
    import torch

    import effpass
    from effpass.testing.memory import live_tensor_bytes, peak_memory

    policy, kinds, ids, labels = build()
    mod = kinds[("liger_" if arm == "liger" else "") + loss]()
    args = (ids, labels) + ((torch.tensor([1.0, -1.0]),) if loss == "grpo" else ())
    if arm in ("eager", "liger"):
        f = mod
    elif arm == "compile":
        f = torch.compile(mod)
    else:
        f = effpass.compile(mod)
    losses = []

    def step():
        out = f(*args)
        out.backward()
        policy.zero_grad(set_to_none=True)
        losses.append(float(out.detach()))

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times, cpu, loads = [], [], []
    for _ in range(SHAPE["steps"]):  # wall time and this process's CPU time (user + system) of each step
        loads.append(os.getloadavg()[0])
        c0 = os.times()
        times.append(timed(step, False))
        c1 = os.times()
        cpu.append(c1.user + c1.system - c0.user - c0.system)
    live = live_tensor_bytes(mod.parameters())
    _, peak = peak_memory(step, "cpu")
    stats = {}
    if arm == "effpass":
        st = effpass.report(f).stats("fuse_cross_entropy")
        stats = {k: v for k, v in st.items() if isinstance(v, (int, float))}
    return {"arm": arm, "loss_kind": loss, "peak_bytes": peak, "live_bytes": live, "step_s": statistics.median(times),
            "step_cpu_s": statistics.median(cpu), "load_at_step": loads[0],
            "first_call_s": first, "loss": losses[0], "load": os.getloadavg()[0], "stats": stats}


def worker(arm: str, cfg: dict, device: str) -> dict:
    SHAPE.update({k: v for k, v in cfg.items() if k in SHAPE})
    return run_arm(arm, cfg["loss"])


def main() -> None:
    driver.main(__file__, workload="preference", arms=ARMS, worker=worker, markdown=markdown,
                cpu_shape=dict(SHAPE, loss=list(LOSSES)), quick=QUICK, overrides=("seq", "vocab", "loss"),
                sweep="loss", packages=("liger_kernel",), requires={"liger": ("liger_kernel",)})


def markdown(run: dict) -> str:
    meta = run["meta"]
    shape = {k: v for k, v in run["shape"].items() if k in SHAPE}
    results = [r if r.get("status") == "ok" else {"arm": r["arm"], "loss_kind": r.get("loss"), "error": r.get("error")}
               for r in run["results"]]
    lines = [f"# fused log-probs (issue 27), {meta['device']}, {meta['date'][:16]}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, liger-kernel {meta.get('liger_kernel')}, "
             f"{meta['cpu_count']} CPUs, shape {shape}", "",
             "step s: wall time of one step; step CPU s: the arm's process CPU time (user + system) in that step; "
             "load: 1-minute load average when the step started", "",
             "| loss | arm | peak MiB | x eager | step s | x compile | step CPU s | CPU x compile | first call s | load "
             "| loss value | log-prob sites | row-wise sites (grad in forward) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['loss_kind']} | {r['arm']} | error: {r['error'].splitlines()[-1][:120] if r['error'] else '?'} |")
            continue
        e = next((x for x in results if x.get("loss_kind") == r["loss_kind"] and x["arm"] == "eager" and "peak_bytes" in x), None)
        c = next((x for x in results if x.get("loss_kind") == r["loss_kind"] and x["arm"] == "compile" and "step_s" in x), None)
        lines.append(f"| {r['loss_kind']} | {r['arm']} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / e['peak_bytes'] if e else float('nan'):.2f} | {r['step_s']:.2f} | "
                     f"{r['step_s'] / c['step_s'] if c else float('nan'):.2f} | {r.get('step_cpu_s', float('nan')):.2f} | "
                     f"{r.get('step_cpu_s', float('nan')) / c['step_cpu_s'] if (c and c.get('step_cpu_s')) else float('nan'):.2f} | "
                     f"{r['first_call_s']:.1f} | {r.get('load_at_step', r['load']):.1f} | "
                     f"{r['loss']:.6f} | {r['stats'].get('logprob_sites', '')} | "
                     + (f"{r['stats'].get('rowwise_sites', '')} ({r['stats'].get('rowwise_grad_in_forward', '')})"
                        if r['stats'] else "") + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
