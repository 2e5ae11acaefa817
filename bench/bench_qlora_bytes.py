"""QLoRA at small scale: predicted (fake-tensor replay) vs analytic (torchao NF4 layout) vs measured
(bytes live at the step's start + the profiler's peak, ``measure_step``) on a Hugging Face Llama.

    .venv/bin/python bench/bench_qlora_bytes.py          # appends to bench/results/qlora_bytes_<device>.{json,md}
    .venv/bin/python bench/bench_qlora_bytes.py --quick  # smoke run: hidden 256, 1 layer, 64 tokens

One arm (``measure``) in a fresh process under bench/driver.py (deadline, results appended).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.passes import CheckpointActivations, InjectLoRA, QuantizeLinear  # noqa: E402
from effpass.planning import estimate_memory, format_bytes  # noqa: E402
from effpass.planning.measure import measure_step  # noqa: E402
from effpass.quantized import storage_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


def nf4_bytes(n: int, elem: int) -> int:
    return n // 2 + n // 64 + elem * (n // (64 * 256)) + elem + 16 * elem


def measure(hidden=512, layers=4, vocab=32000, batch=2, seq=512):
    import transformers as tf

    load0 = os.getloadavg()
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).train()
    tok = torch.randint(0, vocab, (batch, seq))
    inputs = {"input_ids": tok, "labels": tok}
    targets = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]

    def passes():
        return [QuantizeLinear(scheme="nf4", exclude=["lm_head"]), InjectLoRA(rank=8, targets=targets),
                CheckpointActivations()]

    t0 = time.perf_counter()
    est = estimate_memory(model, inputs, passes=passes(), lowering="eager")
    t_pred = time.perf_counter() - t0
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=passes(), lowering="eager")
    meas = measure_step(compiled, model, inputs)
    real_params = storage_bytes(list(model.parameters()) + list(model.buffers()))
    lin = [(m.out_features, m.in_features) for n, m in tf.LlamaForCausalLM(cfg).named_modules()
           if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    others = sum(p.numel() for n, p in tf.LlamaForCausalLM(cfg).named_parameters()
                 if not any(n.endswith(s) for s in ("proj.weight",))) * 4
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    analytic = sum(nf4_bytes(o * i, 4) for o, i in lin) + others + adapters
    row = {"predicted_peak": est.peak_bytes, "measured_peak": meas.peak_bytes,
           "peak_error_pct": 100 * (est.peak_bytes - meas.peak_bytes) / meas.peak_bytes,
           "predicted_start": est.start_bytes, "measured_start": meas.start_bytes,
           "predicted_params": est.parameters + est.buffers, "real_params": real_params, "analytic_params": analytic,
           "predict_seconds": round(t_pred, 1), "load_before": load0, "load_after": os.getloadavg()}
    row["shape"] = (f"Llama hidden {hidden}, {layers} layers, vocab {vocab}, batch {batch} x seq {seq}, fp32, "
                     f"NF4 base (head excluded) + LoRA r=8 q/k/v/o + checkpoint_activations, AdamW, eager lowering")
    return row


def markdown(run: dict) -> str:
    row = next((r for r in reversed(run["results"]) if r.get("status") == "ok"), None)
    if row is None:
        return driver.table(run)
    return "\n".join([
        "# QLoRA at small scale: predicted vs analytic vs measured\n", f"{row['shape']}\n",
        "| quantity | predicted | analytic | measured |", "|---|---|---|---|",
        f"| parameter + buffer bytes | {row['predicted_params']} | {row['analytic_params']} | {row['real_params']} |",
        f"| bytes live at the step's start | {row['predicted_start']} | - | {row['measured_start']} |",
        f"| peak of one step | {format_bytes(row['predicted_peak'])} ({row['predicted_peak']}) | - | "
        f"{format_bytes(row['measured_peak'])} ({row['measured_peak']}) |",
        f"\npeak error {row['peak_error_pct']:+.4f}%; prediction took {row['predict_seconds']:.1f} s "
        f"(load {row['load_before'][0]:.1f})"]) + "\n"


def main() -> None:
    shape = dict(hidden=512, layers=4, vocab=32000, batch=2, seq=512)
    driver.main(__file__, workload="qlora_bytes", arms=("measure",), markdown=markdown,
                worker=lambda arm, cfg, device: {"arm": arm, **measure(**{k: cfg[k] for k in shape})},
                cpu_shape=shape, quick=dict(hidden=256, layers=1, vocab=512, batch=1, seq=64),
                overrides=tuple(shape))


if __name__ == "__main__":
    main()
