"""step_in_backward with tile_sequence at a small size: the whole-step peak (profiler, as bench_long_sequence.py) of
a tiled step with and without ``StepInBackward``, the same structure as the long-sequence bench at 4,096 tokens.

    python bench/bench_long_sequence_step.py            # arms tiled, step -> bench/results/long_sequence_step_<device>.*
    python bench/bench_long_sequence_step.py --quick    # smoke run: 512 tokens, tiles of 128 rows

Model: Llama hidden 128, intermediate 352, 2 layers, vocabulary 4,096, fp32, batch 1, ``lowering="eager"``, the
default CPU pipeline + ``CheckpointActivations(policy="full")`` + ``TileSequence(tile_rows=512)`` (+
``StepInBackward()`` in arm ``step``), AdamW(lr=1e-4) with its states prefilled (the first step is already the
steady state). Peak = bytes live at the step's start + the profiler's peak of one step; losses over two steps.
To compare code before and after a change, run it from each tree (the row records the commit).
Each arm runs in a fresh process under bench/driver.py (deadline, results appended per arm).
"""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch
    import transformers as tf

    import effpass
    from effpass.passes import CheckpointActivations, StepInBackward, TileSequence
    from effpass.testing.memory import live_tensor_bytes, peak_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    conf._attn_implementation = "sdpa"
    m = tf.LlamaForCausalLM(conf).train()
    seq = cfg["seq"]
    passes = list(effpass.default_pipeline("cpu", torch.float32)) + [CheckpointActivations(policy="full"),
                                                                     TileSequence(tile_rows=cfg["tile_rows"])]
    if arm != "tiled":
        passes.append(StepInBackward())
    effpass.compile(m, passes=passes, lowering="eager")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (1, seq), generator=g) for _ in range(2)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    if arm != "tiled":
        from effpass.passes.step_in_backward import attach

        attach(opt)
    for p in m.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def step(ids):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    gc.collect()
    start = live_tensor_bytes(list(m.parameters()) + list(m.buffers()) + [batches[0]] +
                              [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    l0, peak = peak_memory(lambda: step(batches[0]))
    l1 = step(batches[1])
    return {"arm": arm, "start": start, "step_peak": peak, "peak": start + peak, "losses": [l0, l1],
            "load": os.getloadavg()}


def markdown(run: dict) -> str:
    cfg = run["shape"]
    ok = {r["arm"]: r for r in run["results"] if r.get("status") == "ok"}
    ref = ok.get("tiled")
    lines = [f"# step_in_backward + tile_sequence, whole-step peak ({cfg['seq']} tokens, tiles of {cfg['tile_rows']})",
             "", "| arm | peak | x tiled | start | step peak | losses |", "|---|---|---|---|---|---|"]
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['arm']} | {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:160]} |||||")
            continue
        lines.append(f"| {r['arm']} | {r['peak']:,} B | {r['peak'] / ref['peak'] if ref else float('nan'):.3f} | "
                     f"{r['start']:,} B | {r['step_peak']:,} B | {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    driver.main(__file__, workload="long_sequence_step", arms=("tiled", "step"), worker=worker, markdown=markdown,
                cpu_shape=dict(seq=4096, tile_rows=512), quick=dict(seq=512, tile_rows=128),
                overrides=("seq", "tile_rows"))
