"""QLoRA at small scale: predicted (fake-tensor replay) vs analytic (torchao NF4 layout) vs measured
(bytes live at the step's start + the profiler's peak, ``measure_step``) on a Hugging Face Llama.

    .venv/bin/python bench/bench_qlora_bytes.py      # writes bench/results/qlora_bytes.json and .md
"""
from __future__ import annotations

import datetime
import json
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


def nf4_bytes(n: int, elem: int) -> int:
    return n // 2 + n // 64 + elem * (n // (64 * 256)) + elem + 16 * elem


def main(hidden=512, layers=4, vocab=32000, batch=2, seq=512):
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
    import transformers

    head = {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": "CPU (2 shared cores)",
            "shape": f"Llama hidden {hidden}, {layers} layers, vocab {vocab}, batch {batch} x seq {seq}, fp32, "
                     f"NF4 base (head excluded) + LoRA r=8 q/k/v/o + checkpoint_activations, AdamW, eager lowering"}
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(here, exist_ok=True)
    with open(os.path.join(here, "qlora_bytes.json"), "w") as f:
        json.dump({"header": head, "row": row}, f, indent=1)
    md = ["# QLoRA at small scale: predicted vs analytic vs measured\n", f"{head}\n",
          "| quantity | predicted | analytic | measured |", "|---|---|---|---|",
          f"| parameter + buffer bytes | {row['predicted_params']} | {analytic} | {real_params} |",
          f"| bytes live at the step's start | {est.start_bytes} | - | {meas.start_bytes} |",
          f"| peak of one step | {format_bytes(est.peak_bytes)} ({est.peak_bytes}) | - | "
          f"{format_bytes(meas.peak_bytes)} ({meas.peak_bytes}) |",
          f"\npeak error {row['peak_error_pct']:+.4f}%; prediction took {t_pred:.1f} s (load {load0[0]:.1f})"]
    with open(os.path.join(here, "qlora_bytes.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
