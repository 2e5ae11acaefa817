"""Does ``ApplyAutocast(fp32_routers=True)`` earn its departure from eager ``torch.autocast``? (issue 41, item 4)

For each MoE family (one arm per family, in its own process), three precisions of the same model and data:

* ``fp64``: the reference (the model in float64, no autocast);
* ``autocast``: eager ``torch.autocast(bf16)`` (what effpass's ``fp32_routers=False`` reproduces bit for bit);
* ``fp32_routers``: effpass's default (``effpass.prepare`` with ``ApplyAutocast()``: the routers are fp32 islands
  inside the bf16 region; the eager model so prepared computes what the compiled one does).

Measured against fp64: (1) **router decisions** at fixed weights, over ``batches`` batches: the fraction of
(token, layer) whose top-k expert set differs from fp64's, and the fraction whose *first* expert differs; (2) the
forward loss's mean absolute difference; (3) **training**: ``steps`` AdamW steps from the same start on the same
batches, each precision following its own trajectory: the mean absolute loss difference to fp64's trajectory over
the last quarter of the steps, and the final router-decision disagreement on held-out batches.

    python bench/bench_fp32_routers.py                 # mixtral, qwen3_moe, qwen2_moe, olmoe; 300 steps
    python bench/bench_fp32_routers.py --quick
"""
from __future__ import annotations

import copy
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
CPU_SHAPE = dict(hidden=128, experts=8, top_k=2, layers=2, vocab=512, seq=64, batch=4, batches=32, steps=300,
                 lr=3e-3, seed=0)
QUICK = dict(hidden=32, experts=4, layers=1, vocab=128, seq=16, batch=2, batches=4, steps=4)


def build(family: str, cfg: dict):
    import torch
    import transformers as tf

    common = dict(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=2 * cfg["hidden"],
                  num_hidden_layers=cfg["layers"], num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4 * cfg["seq"], num_experts_per_tok=cfg["top_k"], bos_token_id=0,
                  eos_token_id=0, router_jitter_noise=0.0)
    kinds = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=cfg["experts"])),
             "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(num_experts=cfg["experts"], moe_intermediate_size=cfg["hidden"], decoder_sparse_step=1,
                                head_dim=cfg["hidden"] // 4)),
             "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                           dict(num_experts=cfg["experts"], moe_intermediate_size=cfg["hidden"], decoder_sparse_step=1,
                                shared_expert_intermediate_size=cfg["hidden"])),
             "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=cfg["experts"]))}
    conf_name, model_name, extra = kinds[family]
    conf = getattr(tf, conf_name)(**common, **extra)
    conf._attn_implementation = "eager"
    conf._experts_implementation = "eager"  # the loop over experts: grouped_mm has no float64 kernel
    torch.manual_seed(cfg["seed"])
    return getattr(tf, model_name)(conf).train()


def router_names(model) -> list[str]:
    """The routers: a ``gate``/``router`` child beside an ``experts`` child (as apply_autocast finds them)."""
    out = []
    for name, mod in model.named_modules():
        children = dict(mod.named_children())
        if "experts" in children:
            out += [f"{name}.{c}" for c in ("gate", "router") if c in children]
    return out


def _logits_of(out, n_experts: int):
    import torch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    for t in outs:
        if isinstance(t, torch.Tensor) and t.shape[-1] == n_experts and t.is_floating_point():
            return t.reshape(-1, n_experts)
    raise RuntimeError("bench_fp32_routers: no router logits among the router's outputs")


class Decisions:
    """Forward hooks on the routers recording the top-k expert sets of every call (a list per router)."""

    def __init__(self, model, k: int, n_experts: int):
        self.k, self.n = k, n_experts
        self.calls: list = []
        mods = dict(model.named_modules())
        self.handles = [mods[n].register_forward_hook(self._hook) for n in router_names(model)]
        if not self.handles:
            raise RuntimeError("bench_fp32_routers: no router found")

    def _hook(self, mod, args, out):
        import torch

        logits = _logits_of(out, self.n).detach().double()
        self.calls.append(torch.topk(logits, self.k, dim=-1).indices.sort(dim=-1).values)

    def take(self):
        calls, self.calls = self.calls, []
        return calls

    def remove(self):
        for h in self.handles:
            h.remove()


def batches(cfg: dict, n: int, offset: int = 0):
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 1 + offset)
    return [torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g) for _ in range(n)]


def variants(base, cfg):
    """The three precisions: (name, model, context manager factory)."""
    import contextlib

    import torch

    import effpass
    from effpass.passes import ApplyAutocast

    fp64 = copy.deepcopy(base).double()
    ac = copy.deepcopy(base)
    ours = copy.deepcopy(base)
    effpass.prepare(ours, passes=[ApplyAutocast(dtype=torch.bfloat16)])  # fp32_routers=True: the default
    return [("fp64", fp64, contextlib.nullcontext),
            ("autocast", ac, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
            ("fp32_routers", ours, contextlib.nullcontext)]


def disagreement(ref_calls, calls) -> tuple[float, float]:
    """Fractions of (token, router call) whose top-k set / first expert differs from the reference's."""
    diff_set = diff_first = total = 0
    for a, b in zip(ref_calls, calls):
        diff_set += int((a != b).any(dim=-1).sum())
        diff_first += int((a[:, 0] != b[:, 0]).sum())
        total += a.shape[0]
    return diff_set / max(total, 1), diff_first / max(total, 1)


def evaluate(vs, data, cfg):
    """Per variant: router calls and losses over ``data`` (no grad)."""
    import torch

    out = {}
    for name, model, ctx in vs:
        rec = Decisions(model, cfg["top_k"], cfg["experts"])
        calls, losses = [], []
        with torch.no_grad():
            for ids in data:
                with ctx():
                    losses.append(float(model(input_ids=ids, labels=ids).loss))
                calls += rec.take()
        rec.remove()
        out[name] = (calls, losses)
    return out


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    torch.set_num_threads(1)
    base = build(arm, cfg)
    vs = variants(base, cfg)
    held = batches(cfg, cfg["batches"], offset=1000)
    at_init = evaluate(vs, held, cfg)
    ref_calls, ref_losses = at_init["fp64"]
    res = {"arm": arm, "routers": len(router_names(base)), "init": {}, "trained": {}}
    for name in ("autocast", "fp32_routers"):
        calls, losses = at_init[name]
        s, f = disagreement(ref_calls, calls)
        res["init"][name] = {"topk_set_differs": s, "first_expert_differs": f,
                             "loss_abs_diff": statistics.mean(abs(a - b) for a, b in zip(losses, ref_losses))}
    # training: each precision on its own trajectory, same batches, AdamW
    train = batches(cfg, cfg["steps"])
    traj = {}
    for name, model, ctx in vs:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        ls = []
        for ids in train:
            with ctx():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ls.append(float(loss))
        traj[name] = ls
        driver.partial({"arm": arm, "status": "partial", "trained": name})
    tail = max(1, len(train) // 4)
    after = evaluate(vs, held, cfg)
    for name in ("autocast", "fp32_routers"):
        s, f = disagreement(after["fp64"][0], after[name][0])
        res["trained"][name] = {
            "loss_abs_diff_last_quarter": statistics.mean(abs(a - b) for a, b in zip(traj[name][-tail:],
                                                                                     traj["fp64"][-tail:])),
            "final_loss": traj[name][-1], "topk_set_differs": s, "first_expert_differs": f}
    res["trained"]["fp64_final_loss"] = traj["fp64"][-1]
    return res


def markdown(run: dict) -> str:
    s = run.get("shape", {})
    lines = [f"MoE routers under bf16 autocast against an fp64 reference: hidden {s.get('hidden')}, {s.get('experts')} "
             f"experts, top-{s.get('top_k')}, {s.get('layers')} layers, {s.get('batch')}x{s.get('seq')} tokens; "
             f"{s.get('batches')} held-out batches; {s.get('steps')} AdamW steps (lr {s.get('lr')}).", "",
             "| family | precision | top-k set differs (init) | first expert differs (init) | loss |diff| (init) | "
             "loss |diff| over the last quarter of training | top-k set differs (trained) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in run.get("results", []):
        if r.get("status") != "ok":
            lines.append(f"| {r.get('arm')} | {r.get('status')}: {str(r.get('error', ''))[-120:]} | | | | | |")
            continue
        for name in ("autocast", "fp32_routers"):
            i, t = r["init"][name], r["trained"][name]
            lines.append(f"| {r['arm']} | {name} | {i['topk_set_differs']:.2%} | {i['first_expert_differs']:.2%} | "
                         f"{i['loss_abs_diff']:.2e} | {t['loss_abs_diff_last_quarter']:.2e} | "
                         f"{t['topk_set_differs']:.2%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    driver.main(__file__, workload="fp32_routers", arms=FAMILIES, worker=worker, cpu_shape=CPU_SHAPE, quick=QUICK,
                markdown=markdown, deadline_s=1800, overrides=("steps", "batches"))
