"""Benchmark of ``quantize_linear``: before/after the torchao rebuild side by side (issue 12, item 5).

    python bench/bench_quantize.py            # CPU: small shapes (numbers are CPU numbers and say so)
    python bench/bench_quantize.py --gpu      # CUDA: the issue's shapes

Arms (one process; arms interleaved over ``--repeats`` rounds, median reported):

* decode (b): batch 1, one new token per step, KV cache: a Llama-shaped model in fp32 / bf16 (eager and
  ``torch.compile``) vs int8 / nf4 / int4 weight-only, each twice: ``legacy_*`` is the hand-written
  ``QuantizedLinear`` of before the rebuild (kept in ``bench/_legacy_quant.py``), ``new_*`` the torchao-based
  pass. Reports tokens/s, linear-weight bytes and bytes per quantized parameter, achieved GB/s of weight
  traffic (weight bytes x tokens/s) and, on GPU, the fraction of the measured device copy bandwidth.
* accuracy: the same model in fp32, quantized by each implementation: logits SQNR against fp32 and the
  worst per-layer weight SQNR.
* qlora (a, GPU only): TinyLlama-1.1B-shaped, T=2048: bf16 LoRA vs NF4 QLoRA via effpass, and PEFT +
  bitsandbytes when importable: tokens/s and peak memory.

Results go to ``bench/results/quantize_<device>.json`` with device, versions and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

import effpass
from effpass.passes import QuantizeLinear

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _legacy_quant


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
    from _legacy_quant import QuantizedLinear
    from effpass.quantized import is_quantized, storage_bytes

    total = qbytes = qparams = 0
    seen: set = set()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            b = m.weight_nbytes()
            total, qbytes, qparams = total + b, qbytes + b, qparams + m.in_features * m.out_features
        elif isinstance(m, torch.nn.Linear):
            if is_quantized(m.weight):
                b = storage_bytes(m.weight, seen)
                qbytes, qparams = qbytes + b, qparams + m.weight.numel()
            else:
                b = m.weight.numel() * m.weight.element_size()
            total += b
    return total, qbytes, qparams


def quantize(model, impl: str, scheme: str, compiled: bool):
    """Quantize every linear but lm_head with the legacy or the new implementation (in place)."""
    kw = {"group_size": 128} if scheme == "int4" else {}
    if impl == "legacy":
        from _legacy_quant import legacy_prepare

        legacy_prepare(model, scheme, exclude=["lm_head"], **kw)
        return effpass.compile(model, passes=[], lowering="inductor") if compiled else model
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


def bench_decode(args, device):
    if device.type == "cuda":  # Llama-shaped, a few GB in bf16 (~2.7B params)
        shape = dict(hidden=2560, inter=6912, layers=32, heads=20, kv=4, vocab=32000)
        base_dtype = torch.bfloat16
    else:  # small: ~50M matmul params (lm_head excluded from quantization, as usual)
        shape = dict(hidden=1024, inter=2816, layers=4, heads=16, kv=4, vocab=2048)
        base_dtype = torch.bfloat16
    # name: (activation dtype, scheme, implementation, compiled)
    arms = {"fp32_eager": (torch.float32, None, None, False), "bf16_eager": (torch.bfloat16, None, None, False)}
    for scheme in ("int8", "nf4", "int4"):
        for impl in ("legacy", "new"):
            arms[f"{impl}_{scheme}_eager"] = (base_dtype, scheme, impl, False)
    for impl in ("legacy", "new"):
        arms[f"{impl}_int8_fp32act_eager"] = (torch.float32, "int8", impl, False)
    if args.compile:
        arms["bf16_compiled"] = (torch.bfloat16, None, None, True)
        for impl in ("legacy", "new"):
            arms[f"{impl}_int8_compiled"] = (base_dtype, "int8", impl, True)
    if device.type == "cuda":  # the legacy formats' Triton path is not in the bench copy
        arms = {k: v for k, v in arms.items() if not k.startswith("legacy") and "fp32" not in k}
    steps, results = {}, {}
    for name, (dtype, scheme, impl, comp) in arms.items():
        model = llama(dtype=dtype, device=device, **shape)
        if scheme:
            model = quantize(model, impl, scheme, comp)
        elif comp:
            model = torch.compile(model)
        t0 = time.perf_counter()
        step = decode_step_fn(model, device)
        time_steps(step, device, 3)  # warm-up (and compile)
        total, qbytes, qparams = linear_bytes(model)
        results[name] = {"dtype": str(dtype).removeprefix("torch."), "scheme": scheme or "none",
                         "implementation": impl or "-", "compiled": comp,
                         "warmup_s": round(time.perf_counter() - t0, 2), "linear_weight_bytes": total,
                         "bytes_per_quantized_param": round(qbytes / qparams, 4) if qparams else None, "times": []}
        steps[name] = step
    names = list(steps)
    for rnd in range(args.repeats):  # interleave arms; a legacy/new pair runs back to back, order alternating
        order = list(names)
        if rnd % 2:
            for i, n in enumerate(order):
                if n.startswith("legacy_") and i + 1 < len(order) and order[i + 1] == "new_" + n[7:]:
                    order[i], order[i + 1] = order[i + 1], order[i]
        for name in order:
            results[name]["times"].append(time_steps(steps[name], device, args.steps))
    paired = {}  # median over rounds of legacy time / new time, measured back to back in each round
    for name in names:
        if name.startswith("new_") and "legacy_" + name[4:] in results:
            old_t, new_t = results["legacy_" + name[4:]]["times"], results[name]["times"]
            paired[name[4:]] = round(statistics.median(o / n for o, n in zip(old_t, new_t)), 3)
    bw = copy_bandwidth(device)
    for name, r in results.items():
        med = statistics.median(r.pop("times"))
        r["ms_per_token"] = round(med * 1e3, 3)
        r["tokens_per_s"] = round(1 / med, 2)
        r["weight_GB_per_s"] = round(r["linear_weight_bytes"] * r["tokens_per_s"] / 1e9, 3)
        if bw:
            r["fraction_of_copy_bw"] = round(r["weight_GB_per_s"] / bw, 3)
    ref = "bf16_compiled" if "bf16_compiled" in results else "bf16_eager"
    for r in results.values():
        r[f"speedup_vs_{ref}"] = round(r["tokens_per_s"] / results[ref]["tokens_per_s"], 3)
    before_after = {}
    for name, r in results.items():
        old = results.get("legacy_" + name[4:]) if name.startswith("new_") else None
        if old:
            before_after[name[4:]] = {"legacy_tokens_per_s": old["tokens_per_s"], "new_tokens_per_s": r["tokens_per_s"],
                                      "new_over_legacy": round(r["tokens_per_s"] / old["tokens_per_s"], 3),
                                      "new_over_legacy_paired_median": paired.get(name[4:]),
                                      "legacy_bytes_per_param": old["bytes_per_quantized_param"],
                                      "new_bytes_per_param": r["bytes_per_quantized_param"]}
    return {"shape": shape, "copy_bandwidth_GB_per_s": bw, "arms": results, "before_after": before_after}


def bench_accuracy(device):
    """fp32 model quantized by each implementation: logits SQNR vs fp32 and worst per-layer weight SQNR."""
    import _legacy_quant as L
    from effpass.passes.quantize_linear import dequantized_weight, sqnr

    shape = dict(hidden=1024, inter=2816, layers=2, heads=16, kv=4, vocab=2048)
    ids = torch.randint(0, shape["vocab"], (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    ref_model = llama(dtype=torch.float32, device=device, **shape)
    ref_w = {n: m.weight.detach().clone() for n, m in ref_model.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
    out = {}
    for scheme in ("int8", "nf4", "int4"):
        for impl in ("legacy", "new"):
            model = quantize(llama(dtype=torch.float32, device=device, **shape), impl, scheme, False)
            worst = float("inf")
            for n, m in model.named_modules():
                if n in ref_w:
                    w = m.dequantize(torch.float32) if isinstance(m, L.QuantizedLinear) else dequantized_weight(m)
                    worst = min(worst, sqnr(ref_w[n], w))
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            _, qbytes, qparams = linear_bytes(model)
            out[f"{impl}_{scheme}"] = {"logits_sqnr_db": round(sqnr(ref, logits), 2),
                                       "worst_weight_sqnr_db": round(worst, 2),
                                       "bytes_per_param": round(qbytes / qparams, 4)}
    return {"shape": shape, "arms": out}


def bench_qlora(args, device):
    """TinyLlama-1.1B-shaped LoRA vs NF4 QLoRA, T=2048 (GPU only)."""
    shape = dict(hidden=2048, inter=5632, layers=22, heads=32, kv=4, vocab=32000)
    T, bs, steps = 2048, 1, args.steps
    targets = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]
    out = {}
    for arm in ("bf16_lora_effpass", "nf4_qlora_effpass", "peft_bnb_qlora"):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="run on CUDA with the issue's shapes")
    ap.add_argument("--compile", action="store_true", default=None,
                    help="add torch.compile / effpass-compiled arms (default: on with --gpu, off on CPU)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: stable numbers on a shared machine)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu given but CUDA is not available")
    if args.compile is None:
        args.compile = args.gpu
    if not args.gpu:
        torch.set_num_threads(args.threads)
    import transformers
    import triton

    result = {
        "benchmark": "quantize_linear",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        "note": ("GPU numbers at the issue's shapes" if device.type == "cuda" else
                 "CPU numbers at small shapes on a shared 2-core machine: ratios within this run only"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "accuracy": bench_accuracy(device),
        "decode": bench_decode(args, device),
    }
    if device.type == "cuda":
        result["qlora"] = bench_qlora(args, device)
    out = args.out or os.path.join(HERE, "results", f"quantize_{'gpu' if device.type == 'cuda' else 'cpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
