"""QLoRA against its peers: one training step of a Llama-shaped model whose linear weights are NF4 and
whose projections carry LoRA adapters, all arms in one run, each in a fresh process.

Arms (same seed, same weights, same batch; LoRA r=16, alpha=32 on q/k/v/o/gate/up/down; every linear
except ``lm_head`` quantized; AdamW on the adapters):

* ``peft_lora``: PEFT LoRA on the unquantized fp32 base (the reference: its loss is the lossless one)
* ``peft_torchao_nf4``: torchao's ``to_nf4`` on each linear weight (QLoRA NF4, block 64, double
  quantization), then ``peft.get_peft_model``: the torchtune-style recipe, eager
* ``peft_bnb_nf4``: the Hugging Face recipe: ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
  load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True))`` (the model saved to a
  temporary folder first), ``prepare_model_for_kbit_training``, ``get_peft_model``, eager. bitsandbytes
  >= 0.48 has a CPU backend for 4-bit (this arm runs on the CPU too; on CUDA it uses bnb's kernels)
* ``effpass_nf4``: ``effpass.compile(model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"]),
  InjectLoRA(...)])`` on the unmodified model (``--lowering``: eager on CPU by default, where Inductor's
  cold compiles cost minutes; inductor on GPU)

Per arm: bytes of the base projection weights as storage holds them (``effpass.quantized.storage_bytes``;
for bitsandbytes also every tensor of each weight's ``quant_state``: absmax, nested absmax, code tables),
bytes live at the step's start (parameters, buffers, quant states, optimizer states), the step's peak
above them (CPU: ``effpass.testing.memory.peak_memory``, allocator events; CUDA: ``max_memory_allocated``),
median step time and process CPU time (forward, backward, ``opt.step()``), the first loss and its
relative difference from ``peft_lora``'s (NF4 is lossy), trainable parameters; tokens/s, MFU of the layers measured
and extrapolated to 32 layers (``mfu_32``, ``tokens_per_s_32``: ``bench/_common.py`` ``extrapolate_layers``; on a
GPU only).

    python bench/bench_qlora_peers.py              # all arms; writes bench/results/qlora_peers_<device>.{json,md}
    python bench/bench_qlora_peers.py --arms effpass_nf4,peft_bnb_nf4 --steps 2
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import llama, time_steps, token_batches  # noqa: E402

ARMS = ("peft_lora", "peft_torchao_nf4", "peft_bnb_nf4", "effpass_nf4")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: NF4 (torchao) needs numel divisible by 64 * 256: every projection here is
CPU_SHAPE = dict(vocab=8192, hidden=512, ffn=1536, layers=4, heads=8, kv_heads=2, seq=512, batch=1,
                 dtype="float32", steps=3, warmup=1, lowering="eager")
GPU_SHAPE = dict(vocab=128256, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, seq=2048, batch=1,
                 dtype="bfloat16", steps=20, warmup=3, lowering="inductor")


def build(cfg: dict, device: str):
    """The model built on ``device`` in its dtype (no host or fp32 copy; the bitsandbytes arm saves and reloads
    it) and one batch."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg["dtype"]))
    try:
        with torch.device(device):
            model = llama(cfg, device, tie=False, train=False)
    finally:
        torch.set_default_dtype(default)
    return model, token_batches(cfg, device)[0]


def _bnb_state_tensors(model) -> list:
    """Every tensor of the bitsandbytes quant states (absmax, nested absmax, code tables, offset)."""
    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            out += [t for t in (qs.absmax, qs.code, getattr(qs, "offset", None)) if t is not None]
            qs = getattr(qs, "state2", None)
    return out


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    from effpass.quantized import storage_bytes
    from effpass.testing.memory import peak_memory

    model, ids = build(cfg, device)
    rank = 16
    if arm == "peft_bnb_nf4":
        import transformers as tf

        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            del model
            qc = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=getattr(torch, cfg["dtype"]))
            model = tf.AutoModelForCausalLM.from_pretrained(d, quantization_config=qc, dtype=getattr(torch, cfg["dtype"]),
                                                            device_map=device, attn_implementation="sdpa")
    model = model.to(device)
    ids = ids.to(device)
    if arm == "peft_torchao_nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight = torch.nn.Parameter(to_nf4(mod.weight.detach()), requires_grad=False)
    if arm.startswith("peft"):
        import peft

        if arm == "peft_bnb_nf4":
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules=TARGETS))
        run = model
    else:
        import effpass
        from effpass.passes import InjectLoRA, QuantizeLinear

        run = effpass.compile(model, passes=[QuantizeLinear(scheme="nf4", exclude=["lm_head"]),
                                             InjectLoRA(rank=rank, alpha=2 * rank, targets=[f"*.{t}" for t in TARGETS])],
                              lowering=cfg["lowering"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    losses = []

    def step():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read after the timed steps: no host sync inside a step

    from effpass.testing import dynamo_counters

    with dynamo_counters() as counters:
        timing = time_steps(step, cfg, device == "cuda")
    named = dict(model.named_parameters())
    base = [p for n, p in named.items() if "_proj" in n and "lora_" not in n]
    qstate = _bnb_state_tensors(model)
    base_bytes = storage_bytes(base) + storage_bytes(qstate)
    opt_states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    live = storage_bytes(list(model.parameters()) + list(model.buffers()) + qstate + opt_states)
    _, peak = peak_memory(step, device)
    losses = [float(x) for x in losses]
    from _common import PEAK_BF16_FLOPS, extrapolate_layers, llama_flops

    tokens = cfg["batch"] * cfg["seq"]
    n_adapter = sum(p.numel() for p in params)
    rest, layer = llama_flops(cfg, trained="adapters", adapter_params_per_layer=n_adapter // cfg["layers"])
    flops = {"tokens_per_s": tokens / timing["step_s"], **extrapolate_layers(timing["step_s"], tokens, rest, layer,
                                                                                cfg["layers"])}
    flops["mfu"] = tokens / timing["step_s"] * (rest + cfg["layers"] * layer) / PEAK_BF16_FLOPS
    if device != "cuda":  # a GPU's peak says nothing of a CPU: the arithmetic runs, MFU is not claimed
        flops["mfu"] = flops["mfu_32"] = None
    out = {**flops, "arm": arm, "base_weight_bytes": base_bytes, "base_weights": len(base),
           "base_weight_types": sorted({type(p).__name__ for p in base}), "live_bytes": live, "peak_bytes": peak,
           **timing,
           "loss_first": losses[0], "loss_last": losses[-1], "trainable_params": sum(p.numel() for p in params),
           "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"],
           "load": os.getloadavg()[0]}
    if arm == "effpass_nf4":
        import effpass

        st = effpass.report(run).stats("quantize_linear")
        out["effpass_stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
        out["effpass_skipped"] = st.get("skipped")
    return out


def markdown(doc: dict) -> str:
    m, s, rows = doc["meta"], doc["shape"], doc["results"]
    ok = {r["arm"]: r for r in rows if "error" not in r}
    ref = ok.get("peft_lora", {})
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    lines = [f"# QLoRA vs peers ({m['device']})", "",
             f"{m['date']}; torch {m['torch']}, transformers {m['transformers']}, peft {m.get('peft')}, torchao "
             f"{m.get('torchao')}, bitsandbytes {m.get('bitsandbytes')}; load average {m.get('load_average')}.",
             f"Llama-shaped: hidden {s['hidden']}, {s['layers']} layers, heads {s['heads']}/{s['kv_heads']}, ffn "
             f"{s['ffn']}, vocab {s['vocab']}, batch {s['batch']} x {s['seq']} tokens, {s['dtype']}; LoRA r=16 on "
             f"{', '.join(TARGETS)}; effpass lowering {s['lowering']}; {s['steps']} timed steps after "
             f"{s['warmup']} warm-up.", "",
             "| arm | base weight bytes | vs fp32 | live at step start | step peak | high-water | vs effpass | "
             "step (median) | CPU time | vs effpass | loss (first) | vs fp32 loss | trainable | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ours = ok.get("effpass_nf4", {})
    for r in rows:
        if "error" in r:
            why = r["error"].strip().splitlines()[-1][:160] if r["error"].strip() else "crashed"
            lines.append(f"| {r['arm']} | did not run: {why} |||||||||||| ")
            continue

        def rat(k, o):
            return f"{r[k] / o[k]:.2f}" if o.get(k) else "-"

        lines.append(f"| {r['arm']} | {mib(r['base_weight_bytes'])} | {rat('base_weight_bytes', ref)} | "
                     f"{mib(r['live_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['live_bytes'] + r['peak_bytes'])} | "
                     + (f"{(r['live_bytes'] + r['peak_bytes']) / (ours['live_bytes'] + ours['peak_bytes']):.2f} | "
                        if ours else "- | ") +
                     f"{r['step_s'] * 1e3:,.0f} ms | {r['cpu_s'] * 1e3:,.0f} ms | {rat('cpu_s', ours)} | "
                     f"{r['loss_first']:.5f} | "
                     f"{abs(r['loss_first'] - ref['loss_first']) / ref['loss_first']:.1e} | "
                     f"{r['trainable_params']:,} | {r['load']:.1f} |" if ref else "")
    lines += ["", "Base weight bytes: the q/k/v/o/gate/up/down weights as storage holds them (bitsandbytes: plus "
              "their quant states). Step peak: allocated during one step (forward, backward, AdamW step) above "
              "what is live at its start; high-water: the two added. \"vs effpass\": the arm's figure over "
              "effpass_nf4's (above 1: effpass lower). CPU times are noisy on the shared 2-core machine: compare within this run only.", ""]
    return "\n".join(lines)


def main() -> None:
    driver.main(__file__, arms=ARMS,
                quick=dict(vocab=512, hidden=128, ffn=256, layers=1, heads=2, kv_heads=1, seq=32, steps=1, warmup=0),
                requires={"peft_lora": ("peft",), "peft_torchao_nf4": ("peft", "torchao"),
                          "peft_bnb_nf4": ("peft", "bitsandbytes"), "effpass_nf4": ("torchao",)},
                cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE, worker=worker, markdown=markdown,
                workload="qlora_peers", packages=("peft", "torchao", "bitsandbytes"), overrides=("steps", "lowering"))


if __name__ == "__main__":
    main()
