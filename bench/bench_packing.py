"""pack_sequences benchmark: padded batches vs packed rows at the same token budget, all arms in one run.

Lengths: log-normal (mu = ln 160, sigma = 1.0) clipped to [16, 2048] tokens, a long tail like instruction
data; the same examples feed every arm. Token budget per step: ``--budget`` tokens (batch x padded length
for padded arms, the row length for packed arms).

Arms (a training step = forward + backward + SGD-free gradient accumulation, fp32):
  padded_unsorted   examples in data order, greedy batches with batch x max_len <= budget, padding masked
  padded_sorted     the same after sorting by length (less padding)
  packed_plain_hf   packed rows (DataCollatorWithFlattening layout), plain HF eager model: fast but the
                    examples attend to each other; its per-example logit error is reported
  hf_flattening     the peer as its users run it: transformers' own DataCollatorWithFlattening builds the
                    packed rows (input_ids, position_ids, labels), plain HF eager model with SDPA attention and
                    use_cache=False, so transformers' masking utilities find the packed sequences in the
                    position_ids and mask across examples (with a cache object, as with use_cache=True, they
                    do not look: that is the packed_plain_hf arm's leak)
  packed_effpass    packed rows, effpass.compile with fuse_attention + pack_sequences

The padded arms and packed_effpass run effpass.compile (lowering ``--lowering``); compile time is excluded
(one warm-up step per distinct shape regime). Reported: useful tokens/s, padding fraction, peak memory
(effpass.testing.memory.peak_memory: allocator events, above what is live at the step's start), and the
largest per-example relative logit error against the example run alone.

    python bench/bench_packing.py            # full run, appends to bench/results/packing_<device>.{json,md}
    python bench/bench_packing.py --quick    # small smoke run (24 examples, budget 1,024, eager lowering)

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm); every
arm rebuilds the same examples and weights from the seed.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import effpass  # noqa: E402
from effpass.passes import FuseAttention, PackSequences  # noqa: E402
from effpass.testing.memory import peak_memory  # noqa: E402


def lengths(n: int, seed: int, lo: int = 16, hi: int = 2048, mu: float = math.log(160), sigma: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(mu + sigma * torch.randn(n, generator=g)).round().long().clamp(lo, hi)
    return x.tolist()


def padded_batches(lens: list[int], budget: int, sort: bool) -> list[list[int]]:
    order = sorted(range(len(lens)), key=lambda i: lens[i]) if sort else list(range(len(lens)))
    out, cur = [], []
    for i in order:
        width = max([lens[j] for j in cur] + [lens[i]])
        if cur and (len(cur) + 1) * width > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def packed_rows(lens: list[int], budget: int) -> list[list[int]]:
    """First-fit in data order: each row holds examples whose lengths sum to <= budget."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lens):
        for r, left in enumerate(room):
            if n <= left:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(budget - n)
    return rows


def build_model(args):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(4, args.hidden // 128),
                         num_key_value_heads=max(4, args.hidden // 128) // 2,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    m = tf.LlamaForCausalLM(cfg)
    m.set_attn_implementation("eager")
    return m.train()


def padded_inputs(tokens, idx):
    width = max(len(tokens[i]) for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, :len(tokens[i])] = tokens[i]
        mask[r, :len(tokens[i])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, int(mask.sum()), ids.numel()


def packed_inputs(tokens, idx):
    ids = torch.cat([tokens[i] for i in idx])[None]
    pos = torch.cat([torch.arange(len(tokens[i])) for i in idx])[None]
    labels = ids.clone()
    labels[pos == 0] = -100  # DataCollatorWithFlattening: no prediction across examples
    return {"input_ids": ids, "position_ids": pos, "labels": labels}, ids.numel(), ids.numel()


#: the device the worker runs on (set by ``worker``): inputs are built on the CPU and moved there
DEVICE = "cpu"


def on_device(make_inputs):
    """``make_inputs`` with its tensors moved to ``DEVICE``."""
    def make(tokens, idx):
        inp, r, t = make_inputs(tokens, idx)
        return {k: v.to(DEVICE) for k, v in inp.items()}, r, t

    return make


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_arm(name, model, steps, make_inputs, tokens, warm):
    """Times every step (fwd+bwd) after warm-up calls; returns figures."""
    from effpass.testing import dynamo_counters

    make_inputs = on_device(make_inputs)
    with dynamo_counters() as counters:  # graph breaks and recompiles over the warm-up and every step
        res = _run_steps(name, model, steps, make_inputs, tokens, warm)
    res.update(graph_breaks=counters["graph_breaks"], recompiles=counters["recompiles"])
    return res


def _run_steps(name, model, steps, make_inputs, tokens, warm):
    first = None
    for idx in warm:  # the first warm-up call compiles: its wall time is the arm's first step (compile included)
        inp, _, _ = make_inputs(tokens, idx)
        _sync()
        t0 = time.perf_counter()
        model(**inp).loss.backward()
        _sync()
        first = time.perf_counter() - t0 if first is None else first
    real = total = 0
    seconds = 0.0
    peak = 0
    for k, idx in enumerate(steps):
        inp, r, t = make_inputs(tokens, idx)
        real, total = real + r, total + t
        _sync()
        t0 = time.perf_counter()
        if k == 0:
            _, p = peak_memory(lambda: model(**inp).loss.backward(), DEVICE)
            peak = max(peak, p)
        else:
            model(**inp).loss.backward()
        _sync()
        seconds += time.perf_counter() - t0
    return {"arm": name, "steps": len(steps), "real_tokens": real, "step_tokens": total,
            "padding_fraction": 1 - real / total, "seconds": seconds, "useful_tokens_per_s": real / seconds,
            "peak_bytes_first_step": peak, **({"first_step_s": first} if first is not None else {})}


def peak_over(model, steps, make_inputs, tokens, limit=3):
    """The largest peak over the steps with the most tokens per step (the memory-bound ones)."""
    order = sorted(steps, key=lambda idx: -make_inputs(tokens, idx)[2])[:limit]
    make_inputs = on_device(make_inputs)
    best = 0
    for idx in order:
        inp, _, _ = make_inputs(tokens, idx)
        _, p = peak_memory(lambda: model(**inp).loss.backward(), DEVICE)
        best = max(best, p)
    return best


def per_example_error(model, ref, tokens, idx) -> float:
    inp, _, _ = on_device(packed_inputs)(tokens, idx)
    inp = {k: v for k, v in inp.items() if k != "labels"}
    with torch.no_grad():
        out = model(**inp).logits
        err, s = 0.0, 0
        for i in idx:
            n = len(tokens[i])
            alone = ref(input_ids=tokens[i][None].to(DEVICE)).logits
            err = max(err, ((out[:, s:s + n] - alone).abs().max() / alone.abs().max()).item())
            s += n
    return err


ARMS = ("padded_unsorted", "padded_sorted", "packed_plain_hf", "hf_flattening", "packed_effpass")
CPU_SHAPE = dict(examples=64, budget=2048, hidden=128, layers=2, vocab=1024, lowering="inductor", seed=0,
                 dtype="float32")
#: on a GPU: a Llama-3.2-1B-width model (2 layers), 256 examples, 8,192 tokens per step, bf16
GPU_SHAPE = dict(CPU_SHAPE, examples=256, budget=8192, hidden=2048, layers=2, vocab=32000, dtype="bfloat16")
QUICK = dict(examples=24, budget=1024, lowering="eager")


def worker(arm: str, cfg: dict, device: str) -> dict:
    """One arm: the same examples (from the seed) and weights in every arm's process."""
    global DEVICE
    DEVICE = device
    args = argparse.Namespace(**{k: v for k, v in cfg.items() if k in CPU_SHAPE})
    warnings.filterwarnings("ignore")
    lens = lengths(args.examples, args.seed, hi=min(2048, args.budget))
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = [torch.randint(1, args.vocab, (n,), generator=g) for n in lens]
    base = build_model(args).to(DEVICE, getattr(torch, args.dtype))
    if arm in ("padded_unsorted", "padded_sorted"):
        sort = arm == "padded_sorted"
        steps = padded_batches(lens, args.budget, sort)
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        compiled = effpass.compile(model, passes=[FuseAttention()], lowering=args.lowering)
        res = run_arm(arm, compiled, steps, padded_inputs, tokens, warm=steps[:2])
        res["peak_bytes"] = peak_over(compiled, steps, padded_inputs, tokens)
        res["per_example_rel_error"] = None
        return res
    rows = packed_rows(lens, args.budget)
    if arm == "packed_plain_hf":  # packed, plain Hugging Face (eager model, no pass): the examples attend to each other
        plain = copy.deepcopy(base)
        res = run_arm("packed_plain_hf", plain, rows, packed_inputs, tokens, warm=rows[:1])
        res["peak_bytes"] = peak_over(plain, rows, packed_inputs, tokens)
        res["per_example_rel_error"] = per_example_error(plain, base, tokens, rows[0])
        return res
    if arm == "hf_flattening":  # the peer: Hugging Face's own flattening collator, SDPA, no cache
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening()

        def flattened_inputs(tokens, idx):
            b = collator([{"input_ids": tokens[i].tolist()} for i in idx])
            inp = {k: b[k] for k in ("input_ids", "position_ids", "labels")}
            return inp, inp["input_ids"].numel(), inp["input_ids"].numel()

        hf = copy.deepcopy(base)
        hf.config.use_cache = False
        hf.set_attn_implementation("sdpa")
        res = run_arm("hf_flattening", hf, rows, flattened_inputs, tokens, warm=rows[:1])
        res["peak_bytes"] = peak_over(hf, rows, flattened_inputs, tokens)
        res["per_example_rel_error"] = per_example_error(hf, base, tokens, rows[0])
        return res
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering=args.lowering)
    res = run_arm("packed_effpass", compiled, rows, packed_inputs, tokens, warm=rows[:2])
    res["peak_bytes"] = peak_over(compiled, rows, packed_inputs, tokens)
    res["per_example_rel_error"] = per_example_error(compiled, base, tokens, rows[0])
    res["pack_sequences_stats"] = effpass.report(compiled).stats("pack_sequences")
    return res


def describe(cfg: dict) -> dict:
    """The model and length description of a run (in its meta: bench/peer_table.py quotes them)."""
    lens = lengths(cfg["examples"], cfg["seed"], hi=min(2048, cfg["budget"]))
    return {"model": f"Llama-style hidden {cfg['hidden']}, {cfg['layers']} layers, heads 4/2, ffn {2 * cfg['hidden']}, "
                     f"vocab {cfg['vocab']}, {cfg.get('dtype', 'float32')}, eager attention in the model, lowering {cfg['lowering']}",
            "lengths": f"{cfg['examples']} examples, log-normal(mu=ln 160, sigma=1.0) clipped to [16, "
                       f"{min(2048, cfg['budget'])}]: min {min(lens)}, median {sorted(lens)[len(lens) // 2]}, "
                       f"mean {sum(lens) / len(lens):.0f}, max {max(lens)}",
            "budget_tokens_per_step": cfg["budget"]}


def markdown(run: dict) -> str:
    meta = run["meta"]
    results = [r for r in run["results"] if r.get("status") == "ok"]
    base_tps = results[0]["useful_tokens_per_s"] if results else None
    lines = [f"# pack_sequences benchmark ({meta['device']})", "",
             f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}; load average at the start "
             f"{[round(x, 1) for x in meta['load_average']]}.",
             f"{meta['model']}.", f"Lengths: {meta['lengths']}. Token budget per step: {meta['budget_tokens_per_step']}.",
             "", "| arm | steps | useful tokens/s | vs padded unsorted | padding fraction | peak memory (largest steps) | "
             "per-example rel. error |", "|---|---|---|---|---|---|---|"]
    for r in run["results"]:
        if r.get("status") != "ok":
            why = (str(r.get("error", "")).strip().splitlines() or ["?"])[-1][:160]
            lines.append(f"| {r['arm']} | did not run ({r.get('status')}): {why} ||||||")
            continue
        err = "-" if r["per_example_rel_error"] is None else f"{r['per_example_rel_error']:.1e}"
        lines.append(f"| {r['arm']} | {r['steps']} | {r['useful_tokens_per_s']:.0f} | "
                     f"{r['useful_tokens_per_s'] / base_tps:.2f}x | {r['padding_fraction']:.1%} | "
                     f"{r['peak_bytes'] / 2**20:.1f} MiB | {err} |")
    lines += ["", "Peak memory: effpass.testing.memory.peak_memory (allocator events) of one fwd+bwd step, the "
              "largest over the 3 steps with the most tokens, above what is live at the step's start. CPU times "
              "are noisy (2 cores shared with other jobs): compare ratios within this run only. Ratios are against "
              "the first arm of the run."]
    return "\n".join(lines) + "\n"


def main():
    driver.main(__file__, workload="packing", arms=ARMS, worker=worker, markdown=markdown, cpu_shape=CPU_SHAPE,
                gpu_shape=GPU_SHAPE, quick=QUICK, overrides=tuple(CPU_SHAPE), meta_extra=describe)


if __name__ == "__main__":
    main()
