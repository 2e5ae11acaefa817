"""Benchmark of ``quantize_linear`` (issue 12, item 5): decode speed, weight bytes and accuracy of the pass's
formats (``effpass.passes.quantize_linear``, torchao-based).

    python bench/bench_quantize.py                # CPU: small shapes (numbers are CPU numbers and say so)
    python bench/bench_quantize.py --compile      # also the compiled arms (default on a GPU)
    python bench/bench_quantize.py --quick        # smoke run: accuracy + one scheme, 2 steps

Arms (each in a fresh process under bench/driver.py, interleaved over ``--repeats`` rounds; median reported):

* ``accuracy`` (first round only): the model in fp32, quantized by the pass for int8 / nf4 / int4: logits SQNR
  against fp32 and the worst per-layer weight SQNR.
* decode (b): batch 1, one new token per step, KV cache: a Llama-shaped model in fp32 / bf16 (eager and
  ``torch.compile``) vs int8 / nf4 / int4 weight-only. Reports tokens/s, linear-weight bytes and bytes per
  quantized parameter, achieved GB/s of weight traffic (weight bytes x tokens/s) and, on GPU, the fraction of the
  measured device copy bandwidth.
* qlora (a, GPU only): TinyLlama-1.1B-shaped, T=2048: bf16 LoRA vs NF4 QLoRA via effpass, and PEFT +
  bitsandbytes when importable: tokens/s and peak memory.

The hand-written formats of before the torchao rebuild were measured beside the new ones on 2026-11-21 (the
historical run in ``bench/results/quantize_cpu.json``); their copy is gone from the tree, so the ``legacy_*`` arms
are no longer run. Results are appended to ``bench/results/quantize_<device>.{json,md}``.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import effpass
from effpass.passes import QuantizeLinear

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import driver  # noqa: E402


def llama(hidden, inter, layers, heads, kv, vocab, dtype, device):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def linear_bytes(model) -> tuple[int, int, int]:
    """(bytes of every linear weight, bytes of the quantized ones, parameters of the quantized ones)."""
    from effpass.quantized import is_quantized, storage_bytes

    total = qbytes = qparams = 0
    seen: set = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            if is_quantized(m.weight):
                b = storage_bytes(m.weight, seen)
                qbytes, qparams = qbytes + b, qparams + m.weight.numel()
            else:
                b = m.weight.numel() * m.weight.element_size()
            total += b
    return total, qbytes, qparams


def quantize(model, scheme: str, compiled: bool):
    """Quantize every linear but lm_head with the pass (in place)."""
    kw = {"group_size": 128} if scheme == "int4" else {}
    passes = [QuantizeLinear(scheme=scheme, exclude=["lm_head"], **kw)]
    if compiled:
        return effpass.compile(model, passes=passes, lowering="inductor")
    effpass.prepare(model, passes=passes)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_step_fn(model, device, prompt=8, max_new=256):
    """A closure that decodes one token (batch 1) with a static KV cache primed by a short prompt."""
    import transformers as tf

    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device)
    cache = tf.StaticCache(config=model.config, max_cache_len=prompt + max_new)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    state = {"pos": prompt}
    tok = ids[:, -1:]

    def step():
        pos = state["pos"]
        cache_position = torch.tensor([pos], device=device)
        out = model(input_ids=tok, past_key_values=cache, cache_position=cache_position, use_cache=True)
        state["pos"] = pos + 1 if pos + 1 < prompt + max_new else prompt
        return out.logits

    return step


def time_steps(step, device, n):
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(n):
            step()
    sync(device)
    return (time.perf_counter() - t0) / n


def copy_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * 20 / (time.perf_counter() - t0) / 1e9  # read + write GB/s


#: decode arms: name -> (activation dtype, scheme, compiled); the bf16 base of the quantized arms as before
DECODE = {"fp32_eager": ("float32", None, False), "bf16_eager": ("bfloat16", None, False),
          "int8_eager": ("bfloat16", "int8", False), "nf4_eager": ("bfloat16", "nf4", False),
          "int4_eager": ("bfloat16", "int4", False), "int8_fp32act_eager": ("float32", "int8", False),
          "bf16_compiled": ("bfloat16", None, True), "int8_compiled": ("bfloat16", "int8", True)}
QLORA = ("qlora_bf16_lora_effpass", "qlora_nf4_qlora_effpass", "qlora_peft_bnb_qlora")
ARMS = ("accuracy",) + tuple(DECODE) + QLORA


def decode_shape(device) -> dict:
    if device.type == "cuda":  # Llama-shaped, a few GB in bf16 (~2.7B params)
        return dict(hidden=2560, inter=6912, layers=32, heads=20, kv=4, vocab=32000)
    return dict(hidden=1024, inter=2816, layers=4, heads=16, kv=4, vocab=2048)  # ~50M matmul params


def bench_decode_arm(name: str, steps: int, device) -> dict:
    """One decode arm: build, quantize, warm up (and compile), then the median of ``steps`` decoded tokens."""
    dtype_name, scheme, comp = DECODE[name]
    dtype = getattr(torch, dtype_name)
    shape = decode_shape(device)
    model = llama(dtype=dtype, device=device, **shape)
    if scheme:
        model = quantize(model, scheme, comp)
    elif comp:
        model = torch.compile(model)
    t0 = time.perf_counter()
    step = decode_step_fn(model, device)
    time_steps(step, device, 3)  # warm-up (and compile)
    total, qbytes, qparams = linear_bytes(model)
    r = {"arm": name, "dtype": dtype_name, "scheme": scheme or "none", "compiled": comp,
         "warmup_s": round(time.perf_counter() - t0, 2), "linear_weight_bytes": total,
         "bytes_per_quantized_param": round(qbytes / qparams, 4) if qparams else None, "decode_shape": shape}
    med = time_steps(step, device, steps)
    r["ms_per_token"] = round(med * 1e3, 3)
    r["tokens_per_s"] = round(1 / med, 2)
    r["weight_GB_per_s"] = round(r["linear_weight_bytes"] * r["tokens_per_s"] / 1e9, 3)
    bw = copy_bandwidth(device)
    if bw:
        r["copy_bandwidth_GB_per_s"] = bw
        r["fraction_of_copy_bw"] = round(r["weight_GB_per_s"] / bw, 3)
    return r


def bench_accuracy(device, schemes=("int8", "nf4", "int4")):
    """fp32 model quantized by the pass: logits SQNR vs fp32 and worst per-layer weight SQNR."""
    from effpass.passes.quantize_linear import dequantized_weight, sqnr

    shape = dict(hidden=1024, inter=2816, layers=2, heads=16, kv=4, vocab=2048)
    ids = torch.randint(0, shape["vocab"], (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    ref_model = llama(dtype=torch.float32, device=device, **shape)
    ref_w = {n: m.weight.detach().clone() for n, m in ref_model.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
    out = {}
    for scheme in schemes:
        model = quantize(llama(dtype=torch.float32, device=device, **shape), scheme, False)
        worst = float("inf")
        for n, m in model.named_modules():
            if n in ref_w:
                worst = min(worst, sqnr(ref_w[n], dequantized_weight(m)))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        _, qbytes, qparams = linear_bytes(model)
        out[scheme] = {"logits_sqnr_db": round(sqnr(ref, logits), 2), "worst_weight_sqnr_db": round(worst, 2),
                       "bytes_per_param": round(qbytes / qparams, 4)}
    return {"arm": "accuracy", "accuracy_shape": shape, "schemes": out}


def bench_qlora(args, device):
    """TinyLlama-1.1B-shaped LoRA vs NF4 QLoRA, T=2048 (GPU only)."""
    shape = dict(hidden=2048, inter=5632, layers=22, heads=32, kv=4, vocab=32000)
    T, bs, steps = 2048, 1, args.steps
    targets = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]
    out = {}
    for arm in ("bf16_lora_effpass", "nf4_qlora_effpass", "peft_bnb_qlora"):
        if args.only and arm != args.only:
            continue
        try:
            out[arm] = _qlora_arm(arm, shape, T, bs, steps, targets, device)
        except Exception as e:  # one failing arm (e.g. a bitsandbytes build problem) must not lose the rest
            out[arm] = {"error": f"{type(e).__name__}: {e}"[:500]}
        torch.cuda.empty_cache()
    return out


def _qlora_arm(arm, shape, T, bs, steps, targets, device):
    from effpass.passes import InjectLoRA

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = llama(dtype=torch.bfloat16, device=device, **shape).train()
    if arm == "peft_bnb_qlora":
        try:
            import bitsandbytes  # noqa: F401
            import peft
            from transformers import BitsAndBytesConfig  # noqa: F401
        except ImportError as e:
            return {"skipped": f"not importable: {e}"}
        import bitsandbytes as bnb

        for name, mod in list(model.named_modules()):  # replace linears with bnb 4-bit
            for cname, child in list(mod.named_children()):
                if isinstance(child, torch.nn.Linear) and cname != "lm_head":
                    new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                            compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.uint8)
                    new.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                    setattr(mod, cname, new.to(device))
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=[t[2:] for t in targets]))
    else:
        passes = [InjectLoRA(rank=16, alpha=32, targets=targets)]
        if arm.startswith("nf4"):
            passes.insert(0, QuantizeLinear(scheme="nf4", exclude=["lm_head"]))
        model = effpass.compile(model, passes=passes, lowering="inductor")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, shape["vocab"], (bs, T), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    sync(device)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(steps):
        loss = step()
    ev1.record()
    sync(device)
    s = ev0.elapsed_time(ev1) / 1e3 / steps
    return {"tokens_per_s": round(bs * T / s, 1), "ms_per_step": round(s * 1e3, 2),
            "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 3), "final_loss": float(loss)}


def worker(arm: str, cfg: dict, device_name: str) -> dict:
    import argparse

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    if arm == "accuracy":
        return bench_accuracy(device, tuple(cfg["schemes"]))
    if arm in DECODE:
        return bench_decode_arm(arm, cfg["steps"], device)
    if device.type != "cuda":
        return {"arm": arm, "status": "skipped", "error": "the QLoRA arms run on a GPU only"}
    only = arm.removeprefix("qlora_")
    r = bench_qlora(argparse.Namespace(steps=cfg["steps"], only=only), device)[only]
    return {"arm": arm, **r}


def default_arms(device: str, compiled: bool, schemes) -> list[str]:
    arms = ["accuracy"] + [a for a, (dt, sc, comp) in DECODE.items() if (sc is None or sc in schemes)
                           and (compiled or not comp) and not (device == "cuda" and dt == "float32")]
    return arms + (list(QLORA) if device == "cuda" else [])


def markdown(run: dict) -> str:
    ok = [r for r in run["results"] if r.get("status") == "ok"]
    acc = next((r for r in ok if r["arm"] == "accuracy"), None)
    lines = [f"# quantize_linear benchmark ({run['meta']['device']}, {run['shape']['threads']} CPU thread(s))", ""]
    if acc:
        lines += [f"Accuracy (fp32 model {acc['accuracy_shape']}, the pass's formats):", "",
                  "| scheme | bytes / param | logits SQNR vs fp32 (dB) | worst weight SQNR (dB) |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['bytes_per_param']} | {v['logits_sqnr_db']} | {v['worst_weight_sqnr_db']} |"
                  for k, v in acc["schemes"].items()]
        lines.append("")
    dec = {}
    for r in ok:
        if r["arm"] in DECODE:
            dec.setdefault(r["arm"], []).append(r)
    if dec:
        ref = next((a for a in ("bf16_compiled", "bf16_eager") if a in dec), None)
        med = {a: statistics.median(x["ms_per_token"] for x in rs) for a, rs in dec.items()}
        lines += [f"Decode (batch 1, KV cache; {next(iter(dec.values()))[0]['decode_shape']}; median over "
                  f"{run['meta'].get('repeats')} round(s) of {run['shape']['steps']} tokens):", "",
                  f"| arm | ms / token | tokens/s | x {ref} | linear weight bytes | bytes / quantized param | "
                  "weight GB/s |", "|---|---|---|---|---|---|---|"]
        for a, rs in dec.items():
            lines.append(f"| {a} | {med[a]:.2f} | {1e3 / med[a]:.1f} | "
                         f"{med[ref] / med[a] if ref else float('nan'):.2f} | {rs[0]['linear_weight_bytes']:,} | "
                         f"{rs[0]['bytes_per_quantized_param'] or '-'} | "
                         f"{rs[0]['linear_weight_bytes'] * 1e3 / med[a] / 1e9:.3f} |")
    q = [r for r in ok if r["arm"] in QLORA]
    if q:
        lines += ["", "QLoRA (TinyLlama-1.1B shape, T=2048):", "", driver.table({"results": q})]
    bad = [r for r in run["results"] if r.get("status") != "ok"]
    for r in bad:
        lines.append(f"\n{r['arm']}: {r.get('status')}: "
                     f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}")
    return "\n".join(lines) + "\n"


def main():
    def extra_args(ap):
        ap.add_argument("--compile", action="store_true", default=None,
                        help="add torch.compile / effpass-compiled arms (default: on a GPU)")

    def configure(args, cfg):
        cfg["compile"] = args.compile

    def jobs(chosen, cfg):
        if chosen == list(ARMS):  # no --arms: the device's default set
            compiled = cfg["compile"] if cfg["compile"] is not None else cfg["_device"] == "cuda"
            chosen = default_arms(cfg["_device"], compiled, cfg["schemes"])
        return [(a, {}) for a in chosen]

    driver.main(__file__, workload="quantize", arms=ARMS, worker=worker, markdown=markdown, repeats=5,
                cpu_shape=dict(steps=20, threads=1, schemes=["int8", "nf4", "int4"]),
                quick=dict(steps=2, schemes=["int8"]), overrides=("steps", "threads", "schemes"),
                extra_args=extra_args, configure=configure, jobs=jobs, once=("accuracy",), alternate=True,
                packages=("torchao", "peft", "bitsandbytes"))


if __name__ == "__main__":
    main()
