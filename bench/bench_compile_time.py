"""Compile time (issue 36): effpass's first training step against plain torch.compile's, cold and warm.

The same model in both arms, with the time each of effpass's passes takes.

Models: Hugging Face decoders built from configs with random weights (no downloads), per family and size:
``tiny`` (the test size: hidden 64, 2 layers, vocabulary 256, 2 x 64 tokens) and ``medium`` (hidden 256, 4 layers,
vocabulary 8,192, 2 x 128 tokens); fp32, the family's default attention (SDPA; Gemma 2: eager), full
fine-tuning with AdamW.
Arms: ``plain`` = ``torch.compile(model)`` (Inductor, default options); ``effpass`` = ``effpass.compile(model)``
(the default pipeline, Inductor lowering); ``effpass_ckpt``: the default pipeline + ``checkpoint_activations("full")``;
``effpass_lora_ckpt``: + ``inject_lora(rank=16)`` too (the newcomer's fine-tuning path; plain compiles the full
model, so this ratio compares effpass's pass time with a plain compile of the same model, not the same program). The timed span is the compile call and the first step (forward with
labels, backward, ``AdamW.step``): wall seconds and CPU seconds of the process and its waited-for children
(``getrusage`` self + children: g++ runs count; Inductor's pooled compile workers, if any, do not).

Cold: a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR``. Warm: a fresh process reusing the directory the cold
run of the same arm and model just filled (run right after it). Per pass: ``effpass.report(model)`` records' ``ms``
summed per pass name (hooks replayed from the record store on a cache hit did not run and are not counted), and the
backend's ``timing`` (``total_ms - lower_ms``: everything effpass does around Inductor) summed over graphs.

    python bench/bench_compile_time.py                       # -> bench/results/compile_time_<device>.{json,md}
    python bench/bench_compile_time.py --models llama gpt2 --sizes tiny
    python bench/bench_compile_time.py --quick               # llama, tiny, cold only (a smoke run)
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import token_batches  # noqa: E402

#: effpass's arms: the default pipeline; + full activation checkpointing (the training path's costliest pass);
#: + LoRA (r=16 on every projection) and full checkpointing (the newcomer's fine-tuning path)
ARMS = ("plain", "effpass", "effpass_ckpt", "effpass_lora_ckpt")
EFFPASS_ARMS = ARMS[1:]
SIZES = {"tiny": dict(vocab=256, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, seq=64),
         "medium": dict(vocab=8192, hidden=256, ffn=768, layers=4, heads=8, kv_heads=4, seq=128)}
#: family -> (config class, model class, family-specific config keys from a size)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda s: {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda s: {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               lambda s: dict(head_dim=s["hidden"] // s["heads"], query_pre_attn_scalar=s["hidden"] // s["heads"],
                              sliding_window=s["seq"] // 2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  lambda s: dict(head_dim=s["hidden"] // s["heads"], num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=s["ffn"] // 2, decoder_sparse_step=1)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", None),
}
CPU = dict(models=list(FAMILIES), sizes=list(SIZES), caches=["cold", "warm"], batch=2, lr=1e-4)
QUICK = dict(models=["llama"], sizes=["tiny"], caches=["cold"])


def build(family: str, size: dict):
    """The family's causal LM at ``size``, random weights (seed 0), the family's default attention, train mode."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    conf_cls, model_cls, extra = FAMILIES[family]
    if extra is None:  # GPT-2 names its keys differently
        kw = dict(vocab_size=size["vocab"], n_embd=size["hidden"], n_inner=size["ffn"], n_layer=size["layers"],
                  n_head=size["heads"], n_positions=size["seq"])
    else:
        kw = dict(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["ffn"],
                  num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                  num_key_value_heads=size["kv_heads"], max_position_embeddings=size["seq"], **extra(size))
    conf = getattr(tf, conf_cls)(bos_token_id=0, eos_token_id=0, use_cache=False, **kw)
    torch.manual_seed(0)
    return getattr(tf, model_cls)(conf).train()


def cache_dir(cfg: dict) -> str:
    return os.path.join(cfg["_cache_root"], f"{cfg['arm']}-{cfg['model']}-{cfg['size']}")


def worker(arm: str, cfg: dict, device: str) -> dict:
    cache = cache_dir({**cfg, "arm": arm})
    if cfg["cache"] == "cold":  # an empty cache (a repeat's cold run must not find the last round's)
        shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before torch is imported
    import resource

    import torch
    from torch._dynamo.utils import counters

    import effpass

    def cpu_s():
        return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))

    size = {**SIZES[cfg["size"]], "batch": cfg["batch"]}
    model = build(cfg["model"], size)
    (tokens,) = token_batches(size, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])

    def step(m):
        loss = m(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), cpu_s()
    if arm == "plain":
        compiled = torch.compile(model)
    else:
        from effpass.passes import CheckpointActivations, InjectLoRA

        extra = {"effpass": [], "effpass_ckpt": [CheckpointActivations(policy="full")],
                 "effpass_lora_ckpt": [InjectLoRA(rank=16), CheckpointActivations(policy="full")]}[arm]
        passes = effpass.default_pipeline(device="cpu", dtype=torch.float32) + extra if extra else None
        compiled = effpass.compile(model, passes=passes)
    wrap_s = time.perf_counter() - t0
    loss = step(compiled)
    first_s, first_cpu_s = time.perf_counter() - t0, cpu_s() - c0
    t1 = time.perf_counter()
    step(compiled)
    out = {"arm": arm, "model": cfg["model"], "size": cfg["size"], "cache": cfg["cache"],
           "first_step_s": first_s, "first_step_cpu_s": first_cpu_s, "compile_call_s": wrap_s,
           "second_step_s": time.perf_counter() - t1, "loss": loss, "load_at_start": load,
           "params": sum(p.numel() for p in model.parameters()), "attention": model.config._attn_implementation,
           "caches": {f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                      if "cache" in k},
           "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    if arm != "plain":
        rep = effpass.report(model)
        pass_ms: dict[str, float] = {}
        for r in rep.records():
            if not r.from_cache:
                pass_ms[r.name] = pass_ms.get(r.name, 0.0) + r.ms
        timing = {k: sum(g.timing.get(k, 0.0) for g in rep.graphs) for k in ("total_ms", "lower_ms", "late_pass_ms")}
        out.update(pass_ms=pass_ms, passes_ms=sum(pass_ms.values()), timing=timing,
                   effpass_ms=timing["total_ms"] - timing["lower_ms"] + sum(r.ms for r in rep.module.records),
                   pipeline=sorted({r.name for r in rep.records()}),
                   replayed=sum(r.from_cache for r in rep.records()), graph_cache=[g.cache for g in rep.graphs],
                   source=effpass._source_digest()[:16])  # in every cache key: a warm run misses if it differs
    return out


def _jobs(chosen: list[str], cfg: dict) -> list[tuple[str, dict]]:
    """Per model and size: each arm cold, then warm on the cache its cold run filled."""
    return [(arm, {"model": m, "size": s, "cache": c}) for m in cfg["models"] for s in cfg["sizes"]
            for arm in chosen for c in cfg["caches"]]


def _configure(args, cfg: dict) -> None:
    bad = [m for m in cfg["models"] if m not in FAMILIES] + [s for s in cfg["sizes"] if s not in SIZES]
    if bad:
        raise SystemExit(f"bench: unknown model(s)/size(s) {bad}; models {list(FAMILIES)}, sizes {list(SIZES)}")
    if cfg["caches"] not in (["cold"], ["cold", "warm"]):
        raise SystemExit("bench: --caches cold, or cold warm (a warm run reuses the cache its cold run filled)")
    root = tempfile.mkdtemp(prefix="effpass-compile-time-")  # the caches of this run, removed when it ends
    atexit.register(shutil.rmtree, root, True)
    cfg["_cache_root"] = root


def markdown(run: dict) -> str:
    res = [r for r in run["results"] if r.get("status") == "ok"]

    def get(arm, m, s, c):
        return next((r for r in res if (r["arm"], r["model"], r["size"], r["cache"]) == (arm, m, s, c)), None)

    def fmt(r, key, f="{:.1f}"):
        return "-" if r is None or r.get(key) is None else f.format(r[key])

    lines = ["First training step (compile call + forward + backward + AdamW step), seconds: wall (CPU = process + "
             "waited-for children). Cold: an empty Inductor cache; warm: the cache the cold run of the same arm "
             "filled. passes ms: effpass's passes' own time (`record.ms`, summed); effpass ms: everything effpass did "
             "around Inductor (backend `total_ms - lower_ms` + module phase). ratio: passes ms / plain's cold wall "
             "(bound: <= 10%). 'cache miss': a warm run that missed Inductor's caches (for effpass: its source changed "
             "since the cold run, `source` in the JSON). Timings on a shared 2-core machine (load average per arm "
             "below): noisy.", "",
             "| model | size | plain cold | plain warm | effpass cold | effpass warm | passes ms (cold) | "
             "effpass ms (cold) | ratio | <= 10% | slowest pass (cold) |", "|---" * 11 + "|"]
    models = list(dict.fromkeys((r["model"], r["size"]) for r in res))
    rows = [(m, s, arm) for m, s in models for arm in EFFPASS_ARMS if get(arm, m, s, "cold")]
    for m, s, arm in rows:
        pc, pw, ec, ew = (get(a, m, s, c) for a in ("plain", arm) for c in ("cold", "warm"))
        def cell(r):
            if r is None:
                return "-"
            missed = r["cache"] == "warm" and any(v for k, v in r["caches"].items() if k.endswith("_miss"))
            return f"{r['first_step_s']:.1f} ({r['first_step_cpu_s']:.1f}){' cache miss' if missed else ''}"

        ratio = ec["passes_ms"] / 1e3 / pc["first_step_s"] if ec and pc else None
        top = max(ec["pass_ms"].items(), key=lambda kv: kv[1]) if ec and ec["pass_ms"] else None
        lines.append(f"| {m} | {s}{'' if arm == 'effpass' else ', ' + arm} | {cell(pc)} | {cell(pw)} | {cell(ec)} | "
                     f"{cell(ew)} | {fmt(ec, 'passes_ms')} | "
                     f"{fmt(ec, 'effpass_ms')} | {'-' if ratio is None else f'{ratio * 100:.2f}%'} | "
                     f"{'-' if ratio is None else ('yes' if ratio <= 0.10 else 'NO')} | "
                     f"{'-' if top is None else f'{top[0]} {top[1]:.0f} ms'} |")
    lines += ["", "Per arm: load average at the start of the step, caches hit/missed (Inductor FX graph and "
              "AOTAutograd caches), graphs, graph breaks; effpass: ms per pass.", "",
              "| model | size | arm | cache | load | cache counters | graphs | breaks | ms per pass |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        counts = ", ".join(f"{k.split('.')[1]} {v}" for k, v in sorted(r["caches"].items()) if v)
        per = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("pass_ms", {}).items()))
        lines.append(f"| {r['model']} | {r['size']} | {r['arm']} | {r['cache']} | {r['load_at_start']:.1f} | "
                     f"{counts or '-'} | {r['graphs']} | {r['graph_breaks']} | {per or '-'} |")
    for r in run["results"]:
        if r.get("status") != "ok":
            err = (str(r.get("error", "")).strip().splitlines() or ["?"])[-1][:200]
            lines.append(f"\n{r.get('model')} {r.get('size')} {r['arm']} {r.get('cache')}: {r.get('status')}: {err}")
    return "\n".join(lines) + "\n"


def main() -> None:
    import driver

    driver.main(__file__, workload="compile_time", arms=ARMS, worker=worker, markdown=markdown, cpu_shape=CPU,
                quick=QUICK, overrides=("models", "sizes", "caches"), configure=_configure, jobs=_jobs,
                deadline_s=1200)


if __name__ == "__main__":
    main()
