"""ONNX export figures: accuracy in onnxruntime (CPU) and stored weight bytes, fp32 and int8.

    python bench/bench_export_onnx.py     # appends to bench/results/export_onnx_<device>.{json,md}
    python bench/bench_export_onnx.py --arms llama_fp32     # (--quick: the same, one arm)

Per model (tiny random-weight Hugging Face Llama (GQA) and GPT-2 from configs, 2 layers, hidden 64,
vocabulary 256, batch 2 x 16 tokens): export with ``fuse_attention`` (fp32), with
``quantize_linear(int8, exclude lm_head) + fuse_attention`` (int8), and with torchao's
``Int8WeightOnlyConfig`` weights (Llama only). Reports max relative logit error vs eager
(max |ort - eager| / max |eager|), logit SQNR vs the fp32 eager model, and the arithmetic of stored
bytes: int8 weights (1 B/element) + their fp32 scales (4 B/row) + the rest of the model in fp32
(4 B/element), against the bytes of the file's initializers (not the file size, which adds metadata).
Each (model, arm) runs in a fresh process under bench/driver.py (deadline, results appended per arm).
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

ARMS = ("llama_fp32", "llama_int8", "llama_torchao_int8", "gpt2_fp32")


def _sqnr(ref, approx):
    return 10 * math.log10(ref.float().pow(2).sum().item() / (ref.float() - approx.float()).pow(2).sum().item())


def _ort(path, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return torch.from_numpy(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in feeds.items()})[0])


def measure(name: str, arm: str, d: str) -> dict:
    import effpass
    from effpass.passes import FuseAttention, QuantizeLinear
    from effpass.testing import model_case

    case = model_case(name)
    model = case.model.eval()
    feeds = {"input_ids": case.inputs["input_ids"]}
    with torch.no_grad():
        ref = model(**feeds, use_cache=False).logits
    head = "lm_head"
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != head}
    passes = [FuseAttention()]
    if arm == "int8":
        passes = [QuantizeLinear(scheme="int8", exclude=[head]), FuseAttention()]
    if arm == "torchao_int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != head)
    path = os.path.join(d, f"{name}_{arm}.onnx")
    res = effpass.export_onnx(model, feeds, path, passes=passes)
    got = _ort(path, feeds)
    out = {"model": name, "arm": arm, "max_rel_error_vs_eager": ((got - ref).abs().max() / ref.abs().max()).item(),
           "sqnr_db_vs_fp32_eager": _sqnr(ref, got), "stored_bytes": res.initializer_bytes,
           "file_bytes": os.path.getsize(path), "int8_linears": len(res.int8_linears),
           "ops": {k: v for k, v in res.onnx_ops.items() if k in ("DequantizeLinear", "MatMul", "Gemm", "Softmax", "Attention")}}
    if arm != "fp32":
        # NOTE: GPT-2's Conv1D projections are not nn.Linear: quantize_linear leaves them alone
        q = [m for n, m in linears.items() if n in res.int8_linears]
        int8 = sum(m.in_features * m.out_features for m in q)
        scales = sum(4 * m.out_features for m in q)
        seen = {}
        for t in [*case.model.parameters(), *case.model.buffers()]:
            seen[id(t)] = t
        total_elems = sum(t.numel() for t in seen.values())
        rest = 4 * (total_elems - int8)
        out["arithmetic"] = {"int8_weight_bytes": int8, "fp32_scale_bytes": scales, "fp32_rest_bytes": rest,
                             "implied_total": int8 + scales + rest,
                             "stored_total": sum(res.initializer_bytes.values())}
    out["onnx_fp32_model_bytes_if_all_fp32"] = 4 * sum(t.numel() for t in {id(t): t for t in
                                                                           [*case.model.parameters(), *case.model.buffers()]}.values())
    return out


def worker(arm: str, cfg: dict, device: str) -> dict:
    name, kind = arm.split("_", 1)
    with tempfile.TemporaryDirectory() as d:
        r = measure(name, kind, d)
    r["arm"] = arm
    return r


def markdown(run: dict) -> str:
    lines = ["# ONNX export: onnxruntime (CPU) accuracy and stored bytes", "",
             "| model | arm | max rel. error vs eager | SQNR vs fp32 eager (dB) | int8 linears | stored bytes "
             "(initializers) | implied (int8 + scales + fp32 rest) | file bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['arm']} | {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:160]} ||||||")
            continue
        stored = sum(r["stored_bytes"].values()) if isinstance(r["stored_bytes"], dict) else r["stored_bytes"]
        implied = (r.get("arithmetic") or {}).get("implied_total", "-")
        lines.append(f"| {r['model']} | {r['arm']} | {r['max_rel_error_vs_eager']:.2e} | "
                     f"{r['sqnr_db_vs_fp32_eager']:.1f} | {r['int8_linears']} | {stored:,} | {implied:,} | "
                     f"{r['file_bytes']:,} |" if implied != "-" else
                     f"| {r['model']} | {r['arm']} | {r['max_rel_error_vs_eager']:.2e} | "
                     f"{r['sqnr_db_vs_fp32_eager']:.1f} | {r['int8_linears']} | {stored:,} | - | {r['file_bytes']:,} |")
    return "\n".join(lines) + "\n"


def main():
    driver.main(__file__, workload="export_onnx", arms=ARMS, worker=worker, markdown=markdown, cpu_shape=dict(quick=False),
                quick=dict(quick=True), overrides=(), packages=("onnx", "onnxruntime", "onnxscript", "torchao"),
                requires={a: ("onnx", "onnxruntime", "onnxscript") for a in ARMS},
                jobs=lambda chosen, cfg: [(a, {}) for a in (chosen[:1] if cfg["quick"] else chosen)])


if __name__ == "__main__":
    main()
