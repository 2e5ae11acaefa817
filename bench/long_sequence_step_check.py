"""Small same-structure check of step_in_backward with tile_sequence: whole-step peak (profiler, as bench_long_sequence). Usage: python bench/long_sequence_step_check.py tiled|step (run /work/main's venv for the code before a change)."""
import gc, json, os, sys, time
import torch
import effpass
from effpass.testing.memory import live_tensor_bytes, peak_memory
import transformers as tf
from effpass.passes import CheckpointActivations, TileSequence, StepInBackward
torch.set_num_threads(1)
arm = sys.argv[1]
torch.manual_seed(0)
cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
cfg._attn_implementation = "sdpa"
m = tf.LlamaForCausalLM(cfg).train()
seq = 4096
passes = list(effpass.default_pipeline("cpu", torch.float32)) + [CheckpointActivations(policy="full"), TileSequence(tile_rows=512)]
if arm != "tiled":
    passes.append(StepInBackward())
effpass.compile(m, passes=passes, lowering="eager")
g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 4096, (1, seq), generator=g) for _ in range(2)]
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
if arm != "tiled":
    from effpass.passes.step_in_backward import attach; attach(opt)
for p in m.parameters():
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
def step(ids):
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return float(loss.detach())
gc.collect()
start = live_tensor_bytes(list(m.parameters()) + list(m.buffers()) + [batches[0]] +
                          [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
l0, peak = peak_memory(lambda: step(batches[0]))
l1 = step(batches[1])
print(json.dumps({"arm": arm, "effpass": os.path.dirname(effpass.__file__), "start": start, "step_peak": peak,
                  "peak": start + peak, "losses": [l0, l1], "load": os.getloadavg()}), flush=True)
