"""The memory planner against measurement (CPU), and plans for full-size models (predictions only).

    .venv/bin/python bench/bench_memory_plan.py accuracy   # predicted vs measured peak, 5 families x 3 combos
    .venv/bin/python bench/bench_memory_plan.py budget     # budget = 60% of the plain step's measured peak
    .venv/bin/python bench/bench_memory_plan.py table      # Llama-3-8B, Llama-3.2-1B, Qwen2.5-7B at 24/48/80 GiB
    .venv/bin/python bench/bench_memory_plan.py maxseq     # longest sequence of Llama-3.1-8B per mode and budget
    .venv/bin/python bench/bench_memory_plan.py accuracy --quick --arms llama   # smoke run

Each section is a workload of its own (``memory_plan_<section>``); its arms are the families (accuracy, budget),
the models (table) or the modes (maxseq), each in a fresh process under bench/driver.py (deadline, results
appended per arm to bench/results/memory_plan_<section>_cpu.{json,md}).

Measured = bytes live at the step's start + the profiler's peak during one steady-state step
(``effpass.planning.measure.measure_step``; forward, backward, AdamW step, zero_grad). Results go to
bench/results/memory_plan_<section>_cpu.json and .md, with device, versions, commit and date.
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.planning import estimate_memory, format_bytes, plan_memory  # noqa: E402
from effpass.planning.measure import measure_step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

#: family -> (config class, model class, LoRA targets)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", ["*.query_key_value", "*.attention.dense"]),
    "phi": ("PhiConfig", "PhiForCausalLM", ["*.q_proj", "*.k_proj", "*.v_proj", "*.dense"]),
}


def build(family: str, hidden: int, layers: int, vocab: int, attn: str = "sdpa", seed: int = 0):
    import transformers as tf

    cfg_cls, model_cls, _ = FAMILIES[family]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
              num_attention_heads=hidden // 64, max_position_embeddings=4096)
    if family in ("llama", "qwen2", "gemma"):
        kw["num_key_value_heads"] = max(1, hidden // 256)
    if family == "gemma":
        kw["head_dim"] = 64
    cfg = getattr(tf, cfg_cls)(**kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(cfg)
    model.train()
    return model


def combos(family: str):
    from effpass.passes import CheckpointActivations, InjectLoRA, QuantizeLinear

    targets = FAMILIES[family][2]
    out = {"none": [], "checkpoint": [CheckpointActivations()]}
    if "fuse_cross_entropy" in effpass.registered_passes():
        out = {"none": [], "checkpoint+fused_ce": [CheckpointActivations(), effpass.make_pass("fuse_cross_entropy")]}
    head = "lm_head"  # exclude patterns must match a module (GPT-NeoX's head is lm_head in transformers 5)
    out["lora+nf4+checkpoint"] = [QuantizeLinear(scheme="nf4", exclude=[head]),
                                  InjectLoRA(rank=8, targets=targets), CheckpointActivations()]
    return out


def _emit(rows: list) -> None:
    """The rows so far, as the arm's partial result (kept if the arm is killed at its deadline)."""
    driver.partial({"rows": rows})


def accuracy(families=None, inductor_combos=None, inductor_families=None, hidden=512, layers=4, vocab=32000, seq=512, batch=2,
             lowerings=("eager", "inductor")):
    rows = []
    for fam in families or FAMILIES:
        for combo, passes in combos(fam).items():
            for lowering in lowerings:
                if lowering == "inductor" and ((inductor_combos is not None and combo not in inductor_combos)
                                               or (inductor_families is not None and fam not in inductor_families)):
                    continue
                model = build(fam, hidden, layers, vocab)
                tok = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
                inputs = {"input_ids": tok, "labels": tok}
                t0 = time.perf_counter()
                est = estimate_memory(model, inputs, passes=passes, lowering=lowering)
                t_pred = time.perf_counter() - t0
                torch._dynamo.reset()
                compiled = effpass.compile(model, passes=passes, lowering=lowering)
                meas = measure_step(compiled, model, inputs)
                err = (est.peak_bytes - meas.peak_bytes) / meas.peak_bytes
                row = dict(family=fam, combo=combo, lowering=lowering, predicted=est.peak_bytes,
                           measured=meas.peak_bytes, error_pct=100 * err, predict_s=round(t_pred, 1),
                           load1=round(os.getloadavg()[0], 1),
                           peak_at=f"{est.peak_phase}: {est.peak_node}")
                print(row, flush=True)
                rows.append(row)
                del model, compiled
                torch._dynamo.reset()
                _emit(rows)
    return rows


def md_accuracy(rows, hidden, layers, vocab, seq, batch, **_):
    md = ["# Memory planner: predicted vs measured peak of one training step (CPU)\n",
          f"Shapes: hidden {hidden}, {layers} layers, vocabulary {vocab}, batch {batch} x seq {seq}, "
          f"fp32, SDPA attention, AdamW (for-loop, as on CPU). Prediction: fake-tensor replay with the row's "
          f"lowering (eager: the partitioned graphs op by op; inductor: Inductor's generated wrapper with fake "
          f"allocations and no kernels); measured: live at the step's start + profiler peak during it, same "
          f"lowering. `predict time`: wall seconds on the shared CPU, with the 1-minute load average.\n",
          "| family | passes | lowering | predicted | measured | error | predict time (load) | peak at |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['family']} | {r['combo']} | {r['lowering']} | {format_bytes(r['predicted'])} | "
                  f"{format_bytes(r['measured'])} | {r['error_pct']:+.3f}% | {r['predict_s']} s ({r.get('load1', '-')}) | "
                  f"{r['peak_at'][:60]} |")
    return "\n".join(md) + "\n"


def budget(families=None, hidden=512, layers=4, vocab=32000, seq=2048, batch=1, fraction=0.6):
    """Eager attention (activations matter), passes=[]: the plan for 60% of the plain step's measured peak."""
    from effpass.testing import assert_close_tree

    rows = []
    for fam in families or FAMILIES:
        model = build(fam, hidden, layers, vocab, attn="eager")
        ref = copy.deepcopy(model)
        tok = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": tok, "labels": tok}
        torch._dynamo.reset()
        plain = measure_step(effpass.compile(ref, passes=[], lowering="eager"), ref, inputs, warmup=1, keep_grads=True)
        target = int(fraction * plain.peak_bytes)
        torch._dynamo.reset()
        row = dict(family=fam, plain_measured=plain.peak_bytes, budget=target)
        try:
            compiled = effpass.compile(model, passes=[], lowering="eager", memory_budget=target, example_inputs=inputs)
            plan = effpass.report(compiled).memory_plan
            meas = measure_step(compiled, model, inputs, warmup=1, keep_grads=True)
            try:
                assert_close_tree(meas.grads, plain.grads, atol=1e-6, rtol=1e-5, what="grads")
                same = True
            except AssertionError:
                same = False
            row.update(plan=plan.chosen.name, predicted=plan.peak_bytes, measured=meas.peak_bytes,
                       fits=meas.peak_bytes <= target, grads_equal=same)
        except effpass.MemoryBudgetError as e:
            row.update(plan=f"none fits: {e}", predicted=e.smallest, measured=None, fits=False, grads_equal=None)
        print(row, flush=True)
        rows.append(row)
        torch._dynamo.reset()
        _emit(rows)
    return rows


def md_budget(rows, hidden, layers, vocab, seq, batch, fraction, **_):
    md = [f"# Memory planner: a budget of {fraction:.0%} of the plain step's measured peak (CPU)\n",
          f"Shapes: hidden {hidden}, {layers} layers, vocabulary {vocab}, batch {batch} x seq {seq}, fp32, eager "
          f"(unfused) attention, passes=[] as given, AdamW, lowering='eager'. Gradients compared with the plain "
          f"step's at atol 1e-6, rtol 1e-5.\n",
          "| family | plain (measured) | budget | plan | predicted | measured | fits | gradients equal |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['family']} | {format_bytes(r['plain_measured'])} | {format_bytes(r['budget'])} | {r['plan']} | "
                  f"{format_bytes(r['predicted']) if r['predicted'] else '-'} | "
                  f"{format_bytes(r['measured']) if r['measured'] else '-'} | {r['fits']} | {r['grads_equal']} |")
    return "\n".join(md) + "\n"


CONFIGS = {  # published config.json fields (Hugging Face hub), written out: nothing is downloaded
    "Llama-3-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, head_dim=64,
                         torch_dtype="bfloat16"),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16"),
}


def table(models=None, budgets=(24, 48, 80), batch=1, seq=2048, lora=None):
    from effpass.planning.cli import model_from_config
    from effpass.planning.planner import MemoryBudgetError

    rows = []
    for name in models or CONFIGS:
        cache: dict = {}
        model = model_from_config(dict(CONFIGS[name]))
        tok = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
        pipeline = []
        if lora:
            pipeline = [effpass.make_pass("inject_lora", {"rank": lora, "targets": ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]})]
        for gib in budgets:
            t0 = time.perf_counter()
            try:
                plan = plan_memory(model, inputs, f"{gib}GiB", allow=["nf4", "adamw8bit"], passes=pipeline,
                                   lowering="eager", cache=cache)
                row = dict(model=name, budget_gib=gib, plan=plan.chosen.name, peak=plan.peak_bytes,
                           alternatives={c.name: c.peak_bytes for c in plan.candidates if c.estimate})
            except MemoryBudgetError as e:
                row = dict(model=name, budget_gib=gib, plan=f"nothing fits (smallest: {e.plan.name})", peak=e.smallest,
                           alternatives={c.name: c.peak_bytes for c in e.candidates if c.estimate})
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(row, flush=True)
            rows.append(row)
            _emit(rows)
    return rows


def md_table(rows, batch, seq, lora, **_):
    md = ["# Memory plans for full-size models (predictions only, not measured)\n",
          "bf16 parameters and AdamW states (the configs' dtype), full fine-tuning"
          + (f" with LoRA rank {lora}" if lora else "") + f", batch {batch} x seq {seq}, SDPA, "
          f"allow=['nf4', 'adamw8bit'], predicted for the CPU kernels on fake tensors (no weights).\n",
          "`seconds`: planning time for that budget on the shared 2-core CPU (the first budget of a model replays "
          "every candidate; later ones reuse the replays).\n",
          "| model | budget | plan | predicted peak | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['budget_gib']} GiB | {r['plan']} | {format_bytes(r['peak'])} | {r['seconds']} |")
    md.append("\nAlternatives (predicted peak per plan):\n")
    seen = set()
    for r in rows:
        if r["model"] in seen:
            continue
        seen.add(r["model"])
        md.append(f"- {r['model']}: " + "; ".join(f"{k}: {format_bytes(v)}" for k, v in r["alternatives"].items()))
    return "\n".join(md) + "\n"


LLAMA_31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                   rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                   max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16")

#: published long-context figures on one 80 GB GPU (docs: /work/shared/design/anchors.md, issue 25)
PUBLISHED = {
    "full": "ALST (Snowflake, arXiv 2506.13996): Llama-3-8B at 500K tokens on one 80 GB H100 (tiled MLP and loss, "
            "checkpoints offloaded to host; DeepSpeed); Hugging Face out of memory past 32K",
    "lora": "-",
    "qlora": "Unsloth: 342K-token QLoRA of Llama-3.1-8B on 80 GB (offloaded checkpoints)",
}


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the planner's forked replay workers, once reaped)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def maxseq(modes=("full", "lora", "qlora"), budgets=(24, 48, 80), step=1024, probes=(8192, 12288),
           lossless_pipeline=True, screen=True, min_tiles=None):
    """The longest sequence (batch 1) of Llama-3.1-8B that the planner predicts fits each budget, per mode."""
    from effpass.planning.cli import LORA_TARGETS, model_from_config
    from effpass.planning.planner import MemoryBudgetError, plan_max_seq

    rows = []
    done: set = set()
    for mode in modes:
        if all((mode, gib) in done for gib in budgets):
            continue
        model = model_from_config(dict(LLAMA_31_8B))
        pipeline = []
        if lossless_pipeline:  # the lossless long-sequence passes fixed: the planner varies what is left
            # NOTE(fuse_attention): passes= replaces the default pipeline (fuse_attention + fuse_cross_entropy);
            # without fuse_attention the causal mask SDPA receives is a (1, 1, seq, seq) tensor saved for the
            # backward, a quadratic term (the first full fine-tuning rows of 2026-11-27 had it)
            pipeline = [effpass.make_pass("fuse_attention", {}),
                        effpass.make_pass("checkpoint_activations", {"policy": "full"}),
                        effpass.make_pass("fuse_cross_entropy", {}),
                        effpass.make_pass("tile_sequence", {"tile_rows": 4096})]
        if mode in ("lora", "qlora"):
            pipeline.append(effpass.make_pass("inject_lora", {"rank": 16, "targets": LORA_TARGETS}))
        if mode == "qlora":
            pipeline.append(effpass.make_pass("quantize_linear", {"scheme": "nf4", "exclude": ["lm_head"]}))

        def make_inputs(seq):
            tok = torch.zeros(1, seq, dtype=torch.long, device="meta")
            return {"input_ids": tok, "labels": tok, "use_cache": False}

        cache: dict = {}
        for gib in budgets:
            if (mode, gib) in done:
                continue
            t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
            try:
                res = plan_max_seq(model, make_inputs, f"{gib}GiB", passes=pipeline, step=step, probes=probes,
                                   lowering="eager", screen=screen, cache=cache, min_tiles=min_tiles)
                row = dict(mode=mode, budget_gib=gib, seq=res.seq, plan=res.plan.chosen.name,
                           pipeline=[p.name for p in res.plan.passes], peak=res.plan.peak_bytes,
                           next_peak=res.next_peak, next_peak_bound=res.next_peak_bound, replays=res.replays,
                           fits=[list(f[:4]) for f in res.fits],
                           notes=res.notes)
            except MemoryBudgetError as e:
                row = dict(mode=mode, budget_gib=gib, seq=0, plan=f"nothing fits (smallest {format_bytes(e.smallest)}"
                           f" at {step} tokens with {e.plan.name})", pipeline=[], peak=e.smallest, next_peak=None,
                           replays=[], fits=[], notes=[])
            row["seconds"] = round(time.perf_counter() - t0, 1)
            row["cpu_s"] = round(time.process_time() - c0 + _children_cpu() - k0, 1)  # with the forked workers'
            from effpass.planning.pool import plan_workers

            row["workers"] = plan_workers()
            row["load"] = os.getloadavg()[0]
            row["screen"] = screen
            print(row, flush=True)
            rows.append(row)
            _emit(rows)
    return rows


def md_maxseq(rows, step, probes, **_):
    md = ["# Longest sequence that fits, Llama-3.1-8B, one device (predictions, not measured)\n",
          f"`effpass.planning.plan_max_seq` (what `effpass plan CONFIG --max-seq` runs), batch 1, bf16 parameters, "
          f"AdamW (torch's, bf16 states as for bf16 parameters), SDPA, eager lowering replayed on fake CPU tensors "
          f"(no CUDA caching-allocator rounding; activation offload, a CUDA-only option, is not among the "
          f"candidates of a CPU plan), answer in steps of {step} tokens, probes {list(probes)}. Pipeline given: "
          f"fuse_attention + checkpoint_activations(full) + fuse_cross_entropy + tile_sequence(4096) (+ LoRA r=16 on all 7 "
          f"projections; + NF4 base for QLoRA, head in bf16); the planner adds step_in_backward where it helps. "
          f"`seconds`: wall time of the row's plan_max_seq call (and its CPU seconds where recorded: this process's, "
          f"with its forked replay workers' where the row names the workers; rows without: one process, "
          f"EFFPASS_PLAN_WORKERS=1) on the "
          f"shared 2-core CPU, 1-minute load average in brackets; a mode's first budget replays the probes, later "
          f"ones reuse them; 'screened': search on two-depth figures, the answering pair confirmed at three "
          f"(plan_max_seq(screen=True)), else three depths for every figure; 'at least': extrapolated over the tile "
          f"count, a lower bound (plan_max_seq's next_peak_bound).\n",
          "| mode | budget | longest sequence (predicted) | plan added | predicted peak | at +1 step | published (80 GB) | seconds (load) |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['mode']} | {r['budget_gib']} GiB | {r['seq']:,} | {r['plan']} | {format_bytes(r['peak'])} | "
                  f"{'at least ' * bool(r.get('next_peak_bound'))}"
                  f"{format_bytes(r['next_peak']) if r['next_peak'] else '-'} | "
                  f"{PUBLISHED[r['mode']] if r['budget_gib'] == 80 else ''} | {r['seconds']}"
                  f"{' / ' + str(r['cpu_s']) + ' CPU' if r.get('cpu_s') is not None else ''} "
                  f"({r['load']:.0f}{', screened' if r.get('screen') else ''}"
                  f"{', ' + str(r['workers']) + ' workers' if r.get('workers') else ''}) |")
    return "\n".join(md) + "\n"


#: section -> (arms, its configuration, the --quick overrides, the function, its markdown)
SECTIONS = {
    "accuracy": (tuple(FAMILIES), dict(hidden=512, layers=4, vocab=32000, seq=512, batch=2,
                                        lowerings=["eager", "inductor"]),
                 dict(hidden=128, layers=1, vocab=512, seq=32, batch=1, lowerings=["eager"])),
    "budget": (tuple(FAMILIES), dict(hidden=512, layers=4, vocab=32000, seq=2048, batch=1, fraction=0.6),
               dict(hidden=128, layers=1, vocab=512, seq=64, batch=1)),
    "table": (tuple(CONFIGS), dict(budgets=[24, 48, 80], batch=1, seq=2048, lora=0),
              dict(budgets=[80], seq=256)),
    "maxseq": (("full", "lora", "qlora"), dict(model="Llama-3.1-8B", budgets=[24, 48, 80], step=1024,
                                             probes=[8192, 12288], screen=True,  # the planner's PROBES
                                             min_tiles=12),  # --min_tiles 0: every length replayed
               dict(budgets=[80], probes=[4096], step=4096)),
}


def worker(arm: str, cfg: dict, device: str) -> dict:
    section = cfg["section"]
    if section == "accuracy":
        rows = accuracy(families=[arm], hidden=cfg["hidden"], layers=cfg["layers"], vocab=cfg["vocab"], seq=cfg["seq"],
                        batch=cfg["batch"], lowerings=tuple(cfg["lowerings"]))
    elif section == "budget":
        rows = budget(families=[arm], hidden=cfg["hidden"], layers=cfg["layers"], vocab=cfg["vocab"], seq=cfg["seq"],
                      batch=cfg["batch"], fraction=cfg["fraction"])
    elif section == "table":
        rows = table(models=[arm], budgets=tuple(cfg["budgets"]), batch=cfg["batch"], seq=cfg["seq"],
                     lora=cfg["lora"] or None)
    else:
        rows = maxseq(modes=(arm,), budgets=tuple(cfg["budgets"]), step=cfg["step"], probes=tuple(cfg["probes"]),
                      screen=cfg["screen"], min_tiles=cfg.get("min_tiles") or None)
    return {"arm": arm, "rows": rows}


def markdown(run: dict) -> str:
    cfg = run["shape"]
    rows = driver.result_rows(run)
    md = {"accuracy": md_accuracy, "budget": md_budget, "table": md_table, "maxseq": md_maxseq}[cfg["section"]]
    text = md(rows, **cfg)
    failed = [r for r in run["results"] if r.get("status") != "ok"]
    for r in failed:
        text += (f"\n{r['arm']}: {r.get('status')} ("
                 f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}); its finished rows are above.\n")
    # a run's "remarks": what was measured around the run (the whole command under /usr/bin/time, ...), added to
    # its JSON afterwards by whoever ran it, so that a re-rendering keeps them
    return text + "".join(f"\n{x}\n" for x in run.get("remarks", []))


def main() -> None:
    section = sys.argv.pop(1) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "accuracy"
    if section not in SECTIONS:
        raise SystemExit(f"bench_memory_plan: unknown section {section!r}; choose one of {', '.join(SECTIONS)}")
    arms, cfg, quick = SECTIONS[section]
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "inductor"))
    driver.main(__file__, workload=f"memory_plan_{section}", arms=arms, worker=worker, markdown=markdown,
                cpu_shape=dict(cfg, section=section), quick=quick, overrides=tuple(k for k in cfg if k != "model"),
                deadline_s=4 * 3600,
                meta_extra=lambda cfg: {"argv": ["bench/bench_memory_plan.py", section] + sys.argv[1:]})


if __name__ == "__main__":
    main()
