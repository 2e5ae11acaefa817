"""wrap_fsdp: FSDP2 per block on CPU with gloo (2 ranks, 4 in a slow test), DCP checkpoints, estimates.

Distributed tests spawn ranks with ``torch.multiprocessing``; each rank writes its results to a file the
test reads back. Every spawned scenario checks several things at once to keep the file fast on 2 cores.
"""
from __future__ import annotations

import math
import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import effpass
import effpass.testing
from effpass.passes import WrapFSDP
from effpass.passes.wrap_fsdp import estimate, estimate_table, find_units, load_checkpoint, max_model_params, \
    save_checkpoint

from _paths import ROOT  # noqa: E402  (the repository's root)
from _docs import undocumented_statistics  # noqa: E402
from _ranks import spawn_ranks  # noqa: E402  (ranks forked from a preloaded fork server)
STEPS = 3
LR = 1e-3


@effpass.register_pass("count_unit_linears")
def count_unit_linears(gm, ctx):
    """Test pass: counts the linears each graph holds and the units (model.layers.N) they come from."""
    units, linears = set(), 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and "linear" in str(n.target) and ctx.allows(n):
            linears += 1
            path = effpass.scope.module_path_of_node(n)
            units.add(".".join(path.split(".")[:3]))
    return effpass.PassResult(stats={"graphs": 1, "linears": linears, "units": sorted(units),
                                     "per_graph": [f"{'+'.join(sorted(units))}:{linears}"]})


# ------------------------------------------------------------------------------------------------------
# spawning ranks
# ------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world, out_dir)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(scenario: str, world: int, tmp_path) -> list[dict]:
    # a crash in native code is retried once (with a warning); the killed-rank job's deliberate exit never is
    spawn_ranks(_worker, lambda: (world, _free_port(), scenario, str(tmp_path)), world,
                crash_retries=int(scenario != "killed"))
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _llama(world: int, layers: int = 2):
    case = effpass.testing.model_case("llama", layers=layers, batch=2 * world, seq=16, use_cache=False)
    case.model.train()
    return case


def _adamw(params):
    # NOTE: eps=1e-4 keeps AdamW's update linear in tiny gradients; with the default 1e-8 an entry whose
    # gradient is ~0 turns a 1e-9 reduction-order difference into a ~1e-6 weight difference.
    return torch.optim.AdamW(params, lr=LR, eps=1e-4)


def _local_batch(tokens, rank, world):
    per = tokens.shape[0] // world
    return tokens[rank * per:(rank + 1) * per]


def _train(model, opt, tokens, steps):
    losses = []
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------------
# scenarios (run on every rank)
# ------------------------------------------------------------------------------------------------------
def scenario_train(rank, world, out_dir):
    """2 ranks vs one process on the full batch; memory vs estimate; checkpoint + resume."""
    case = _llama(world)
    tokens = case.inputs["input_ids"]
    init = copy.deepcopy(case.model)

    ref = copy.deepcopy(init)
    ref_losses = _train(ref, _adamw(ref.parameters()), tokens, STEPS)

    model = effpass.compile(case.model, passes=[WrapFSDP(), count_unit_linears()], lowering="eager",
                            dump_dir=None)
    opt = _adamw(model.parameters())
    local = _local_batch(tokens, rank, world)
    losses = _train(model, opt, local, 1)
    param_bytes = _local_bytes(model.parameters())
    opt_bytes = _local_bytes(v for st in opt.state.values() for k, v in st.items() if k != "step")
    losses += _train(model, opt, local, STEPS - 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=512.0)
    save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt, extra={"step": STEPS - 1, "scaler": scaler})
    losses += _train(model, opt, local, 1)
    final = _full_params(model)

    # resume: a fresh model and optimizer load the checkpoint and take the last step
    torch._dynamo.reset()
    model2 = effpass.compile(copy.deepcopy(init), passes=[WrapFSDP()], lowering="eager", dump_dir=None)
    opt2 = _adamw(model2.parameters())
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    extra = load_checkpoint(os.path.join(out_dir, "ckpt"), model2, opt2, extra={"step": 0, "scaler": scaler2})
    _train(model2, opt2, local, 1)
    resumed = _full_params(model2)

    est = estimate(init, batch=local.shape[0], seq=local.shape[1], world_size=world, mixed_precision=False)
    rep = effpass.report(model)
    return {
        "ref": {n: p.detach() for n, p in ref.named_parameters()}, "final": final, "resumed": resumed,
        "losses": [float(x) for x in losses], "ref_losses": [float(x) for x in ref_losses],
        "param_bytes": param_bytes, "opt_bytes": opt_bytes, "estimate": est,
        "fsdp_stats": rep.stats("wrap_fsdp"), "count_stats": rep.stats("count_unit_linears"),
        "resumed_step": extra["step"], "resumed_scale": scaler2.get_scale(),
        "is_model": model is case.model, "dtensor": type(next(model.parameters())).__name__,
    }


def _other_passes():
    """The other built-in passes that exist now, with options that act on the tiny Llama."""
    import effpass.passes as P

    return [P.FuseAttention(), P.ApplyAutocast(dtype=torch.bfloat16), P.CheckpointActivations(),
            P.InjectLoRA(rank=4, targets=["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.v_proj"])]


def scenario_passes(rank, world, out_dir):
    """Every other pass inside the sharded units; with LoRA only the adapters train."""
    case = _llama(world)
    tokens = _local_batch(case.inputs["input_ids"], rank, world)
    others = _other_passes()
    model = effpass.compile(case.model, passes=[*others, WrapFSDP(), count_unit_linears()], lowering="eager",
                            dump_dir=None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen_before = {n: _full_params(model)[n] for n, p in model.named_parameters() if not p.requires_grad}
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    before = _full_params(model)
    losses = _train(model, opt, tokens, 2)
    after = _full_params(model)
    rep = effpass.report(model)
    grads_frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    names = {id(p): n for n, p in model.named_parameters()}
    state_names = sorted(names[id(p)] for p in opt.state)
    return {
        "passes": [p.name for p in others], "trainable": sorted(trainable),
        "changed": sorted(n for n in after if not torch.equal(after[n], before[n])),
        "frozen_unchanged": all(torch.equal(after[n], v) for n, v in frozen_before.items()),
        "grads_frozen": grads_frozen, "state_names": state_names, "losses": [float(x) for x in losses],
        "stats": {p.name: rep.stats(p.name) for p in others},
        "graph_records": {p.name: sorted({r.graph for r in rep.records(p.name)}) for p in others},
        "failures": [f"{r.name}: {r.error}" for r in rep.failures()],
        "fsdp_stats": rep.stats("wrap_fsdp"), "count_stats": rep.stats("count_unit_linears"),
    }


def scenario_inductor(rank, world, out_dir):
    case = _llama(world)
    tokens = case.inputs["input_ids"]
    ref = copy.deepcopy(case.model)
    ref_losses = _train(ref, _adamw(ref.parameters()), tokens, 2)
    model = effpass.compile(case.model, passes=[WrapFSDP(reshard_after_forward=False)], lowering="inductor",
                            dump_dir=None)
    losses = _train(model, _adamw(model.parameters()), _local_batch(tokens, rank, world), 2)
    return {"ref": {n: p.detach() for n, p in ref.named_parameters()}, "final": _full_params(model),
            "losses": [float(x) for x in losses], "ref_losses": [float(x) for x in ref_losses],
            "fsdp_stats": effpass.report(model).stats("wrap_fsdp")}


def scenario_hsdp(rank, world, out_dir):
    """4 ranks as 2 replica groups x 2 shards (HSDP) vs one process. The units run eagerly (compile_units=False):
    what the mesh changes is FSDP's collectives, which run outside a unit's graph (a compiled unit sees the gathered
    parameters, as under the 2-rank tests' 1-D mesh); a compile on each of 4 ranks cost ~2 CPU-s a rank."""
    case = _llama(world)
    tokens = case.inputs["input_ids"]
    ref = copy.deepcopy(case.model)
    _train(ref, _adamw(ref.parameters()), tokens, 2)
    model = effpass.compile(case.model, passes=[WrapFSDP(replicate=2, compile_units=False)], lowering="eager",
                            dump_dir=None)
    _train(model, _adamw(model.parameters()), _local_batch(tokens, rank, world), 2)
    p = next(model.parameters())
    return {"ref": {n: p.detach() for n, p in ref.named_parameters()}, "final": _full_params(model),
            "placements": [x.__class__.__name__[0] + (f"({x.dim})" if hasattr(x, "dim") else "") for x in p.placements], "local_numel": p.to_local().numel(), "numel": p.numel(),
            "fsdp_stats": effpass.report(model).stats("wrap_fsdp")}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def scenario_fused_head(rank, world, out_dir):
    """fuse_cross_entropy on the sharded root: head + loss in the root's compiled graph, after the blocks."""
    import warnings

    from effpass.passes import FuseCrossEntropy

    case = _llama(world)
    tokens = case.inputs["input_ids"]
    init = copy.deepcopy(case.model)
    ref = copy.deepcopy(init)
    ref_out = ref(input_ids=tokens, labels=tokens)
    ref_out.loss.backward()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = effpass.compile(case.model, passes=[FuseCrossEntropy(), WrapFSDP(), count_unit_linears()],
                            lowering="eager", dump_dir=None)
    local = _local_batch(tokens, rank, world)
    losses, grads = [], []
    for _ in range(2):  # the second step: no recompile, no new graph break
        out = model(input_ids=local, labels=local)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append(_grads(model))
        model.zero_grad(set_to_none=True)
        if not grads[1:]:
            breaks_first = dict(counters["graph_break"])
    rep = effpass.report(model)

    # the limit, explicit: no submodule around the blocks (effpass's DemoLM iterates its ModuleList itself)
    demo = effpass.testing.model_case("demo").model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        effpass.compile(demo, passes=[FuseCrossEntropy(), WrapFSDP()], lowering="eager", dump_dir=None)
        effpass.compile(copy.deepcopy(init), passes=[FuseCrossEntropy(), WrapFSDP(compile_root=False)],
                        lowering="eager", dump_dir=None)
        effpass.compile(copy.deepcopy(init), passes=[WrapFSDP(compile_root=False)], lowering="eager", dump_dir=None)
    return {
        "ref_grads": _grads(ref), "ref_loss": float(ref_out.loss), "grads": grads, "losses": losses,
        "logits": out.logits, "local_tokens": local.numel(), "vocab": init.config.vocab_size,
        "fce": rep.stats("fuse_cross_entropy"), "fsdp_stats": rep.stats("wrap_fsdp"),
        "count_stats": rep.stats("count_unit_linears"),
        "breaks_first": breaks_first, "breaks": dict(counters["graph_break"]),
        "unique_graphs": counters["stats"]["unique_graphs"], "recompiles": dict(counters["recompiles"]),
        "warnings": [str(w.message) for w in caught if "wrap_fsdp" in str(w.message)],
        "demo_stats": effpass.report(demo).stats("wrap_fsdp"),
    }


def scenario_tiled(rank, world, out_dir):
    """tile_sequence inside the sharded units: one step with and without tiles from the same weights."""
    from effpass.passes import TileSequence

    case = _llama(world)
    tokens = _local_batch(case.inputs["input_ids"], rank, world)  # 2 x 16 = 32 rows per rank: 4 tiles of 8
    init = copy.deepcopy(case.model)
    out = {"rows": tokens.numel()}
    for name, extra in (("untiled", []), ("tiled", [TileSequence(tile_rows=8)])):
        torch._dynamo.reset()
        model = effpass.compile(copy.deepcopy(init), passes=[*extra, WrapFSDP()], lowering="eager", dump_dir=None)
        o = model(input_ids=tokens, labels=tokens)
        o.loss.backward()
        rep = effpass.report(model)
        out[name] = {"loss": float(o.loss.detach()), "grads": _grads(model), "fsdp_stats": rep.stats("wrap_fsdp"),
                     "tile_stats": rep.stats("tile_sequence") if extra else None,
                     "failures": [f"{r.name}: {r.error}" for r in rep.failures()]}
    return out


def scenario_fused_losses(rank, world, out_dir):
    """Preference / RL losses over a policy and a frozen reference, both sharded (tests/_vocab_losses.py: TRL's
    log_softmax -> gather -> masked sum per sequence): DPO on Hugging Face Llama, GRPO on a self-written model. Each
    rank takes its half of the examples; the full batch runs unfused and eagerly in one process as the reference."""
    import warnings

    from _families import VOCAB, family_case
    from _vocab_losses import Distill, SelfLM, examples, packed, padded, pair
    from effpass.passes import FuseAttention, FuseCrossEntropy, PackSequences

    out = {}
    for name, kind, make in (("llama_dpo", "dpo", lambda: family_case("llama", attn="sdpa").model),
                             ("self_grpo", "grpo", lambda: SelfLM(VOCAB))):
        model = pair(make(), kind)
        n = 4 * world   # examples: DPO's chosen ones then their rejected ones; GRPO's completions
        exs = examples([6 + (i % 5) for i in range(n)], VOCAB, seed=3)
        adv = torch.linspace(0.25, 1.0, n)
        eager = copy.deepcopy(model)
        want, want_sums = eager(*padded(exs), n, advantages=adv)
        want.backward()
        half = n // 2 // world   # this rank's pairs (DPO) / completions in each half (GRPO)
        mine = [i for h in (0, n // 2) for i in range(h + rank * half, h + (rank + 1) * half)]
        units = len(find_units(model))
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = effpass.compile(model, passes=[FuseCrossEntropy(), WrapFSDP()], lowering="eager",
                                       dump_dir=None)
        loss, sums = compiled(*padded([exs[i] for i in mine]), len(mine), advantages=adv[mine])
        loss.backward()
        rep = effpass.report(compiled)
        recs = [r for r in rep.records("fuse_cross_entropy") if r.phase == "torch_ir"]
        out[name] = {"loss": float(loss.detach()), "want": float(want.detach()), "sums": sums.detach(),
                     "want_sums": want_sums.detach()[mine], "grads": _grads(model), "ref_grads": _grads(eager),
                     "fce": rep.stats("fuse_cross_entropy"), "fsdp_stats": rep.stats("wrap_fsdp"), "units": units,
                     "skipped": [s for r in recs for s in r.skipped], "ops": [r.ops_after for r in recs],
                     "warnings": [str(w.message) for w in caught if "effpass" in str(w.message)]}

    # packed rows (pack_sequences) inside the sharded models: GRPO on Llama, each rank one packed row of its 4
    # completions per step, 3 steps of other lengths; the reference: all 8 completions padded, eagerly, unfused
    model = pair(family_case("llama", attn="sdpa").model, "grpo")
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(), FuseCrossEntropy(), WrapFSDP()],
                               lowering="eager", dump_dir=None)
    steps = []
    for step in range(3):
        exs = examples([5 + (i + 3 * step) % 7 for i in range(4 * world)], VOCAB, seed=10 + step)
        adv = torch.linspace(0.25, 1.0, len(exs))
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        want, want_sums = eager(*padded(exs), len(exs), advantages=adv)
        want.backward()
        mine = list(range(4 * rank, 4 * rank + 4))
        ids, labels, pos = packed([exs[i] for i in mine])
        loss, sums = compiled(ids, labels, 4, position_ids=pos, advantages=adv[mine])
        loss.backward()
        steps.append({"loss": float(loss.detach()), "want": float(want.detach()), "sums": sums.detach(),
                      "want_sums": want_sums.detach()[mine], "grads": _grads(model), "ref_grads": _grads(eager),
                      "length": ids.shape[1]})
    rep = effpass.report(compiled)
    recs = [r for r in rep.records("fuse_cross_entropy") if r.phase == "torch_ir"]
    out["llama_grpo_packed"] = {"steps": steps, "fce_graphs": [r.stats["logprob_sites"] for r in recs if r.changed],
                                "skipped": [s for r in recs for s in r.skipped], "fsdp_stats": rep.stats("wrap_fsdp"),
                                "pack": rep.stats("pack_sequences")}

    # distillation (forward KL, two heads) across the teacher's boundary: the student's head is fused when the
    # teacher runs first (its logits, computed before the break, are a per-row input of the student's graph); with
    # the student first its logits cross the break (they need a gradient): skipped with the reason
    for order in ("teacher_first", "student_first"):
        p = pair(family_case("qwen3", attn="sdpa").model, "dpo")
        model = Distill(p.policy, p.ref, order == "teacher_first")
        ids = torch.randint(3, VOCAB, (2 * world, 10), generator=torch.Generator().manual_seed(5))
        eager = copy.deepcopy(model)
        want = eager(ids)
        want.backward()
        torch._dynamo.reset()
        compiled = effpass.compile(model, passes=[FuseCrossEntropy(), WrapFSDP()], lowering="eager", dump_dir=None)
        loss = compiled(ids[2 * rank:2 * rank + 2])
        loss.backward()
        rep = effpass.report(compiled)
        recs = [r for r in rep.records("fuse_cross_entropy") if r.phase == "torch_ir"]
        out[f"kl_{order}"] = {"loss": float(loss.detach()), "want": float(want.detach()), "grads": _grads(model),
                              "ref_grads": _grads(eager), "fce": rep.stats("fuse_cross_entropy"),
                              "skipped": [s for r in recs for s in r.skipped]}
    return out


#: the killed-rank test's run: 5 AdamW steps under FSDP2, checkpoints after steps 2 and 4
KILLED_ARGS = ["--steps", "5", "--ckpt-every", "2", "--seq", "16"]


def scenario_resume_reference(rank, world, out_dir):
    """The uninterrupted run of the killed-rank test: the example's main() in this job (the same 2 ranks, gloo,
    1 thread each, as its torchrun launches), instead of a torchrun launch of its own."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_fsdp", os.path.join(ROOT, "examples", "train_fsdp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, printed = os.path.join(out_dir, "ref.pt"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        mod.main([*KILLED_ARGS, "--out", out])
    return {"out": out, "stdout": printed.getvalue()}


def scenario_killed(rank, world, out_dir):
    """The killed-rank test's first job: the example's main() on ranks forked from the fork server (the same code
    torchrun's ranks run, in an initialised job, as ``resume_reference``): rank 1 dies at step 3 (``os._exit``),
    after the step-2 checkpoint. What each rank printed goes to ``out_dir/stdout<rank>``."""
    import contextlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_fsdp", os.path.join(ROOT, "examples", "train_fsdp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(out_dir, f"stdout{rank}"), "w", buffering=1) as f, contextlib.redirect_stdout(f):
        mod.main([*KILLED_ARGS, "--ckpt-dir", os.path.join(out_dir, "ckpt"), "--fail-at-step", "3"])
    return {}


SCENARIOS = {"killed": scenario_killed, "fused_losses": scenario_fused_losses, "fused_head": scenario_fused_head, "train": scenario_train, "passes": scenario_passes, "inductor": scenario_inductor,
             "hsdp": scenario_hsdp, "tiled": scenario_tiled, "resume_reference": scenario_resume_reference}
#: the 2-rank scenarios and the tests that read them: one spawn runs all that the session selected (process
#: start, imports and the process group cost more than most scenarios), each writing its own result files
TWO_RANK_TESTS = {"test_wrap_fsdp_two_ranks_match_one_process_and_resume_exactly": "train",
                  "test_wrap_fsdp_other_passes_act_inside_sharded_units": "passes",
                  "test_wrap_fsdp_fuses_the_sharded_head_and_loss": "fused_head",
                  "test_wrap_fsdp_fuses_logprob_losses_of_a_policy_and_a_reference": "fused_losses",
                  "test_wrap_fsdp_fuses_logprob_losses_on_packed_rows": "fused_losses",
                  "test_wrap_fsdp_distillation_fuses_the_head_after_the_teachers_boundary": "fused_losses",
                  "test_wrap_fsdp_inductor_lowering_matches_one_process": "inductor",
                  "test_wrap_fsdp_with_tile_sequence_equals_untiled": "tiled",
                  "test_wrap_fsdp_killed_rank_relaunch_reaches_uninterrupted_weights": "resume_reference"}


def scenario_many(rank, world, out_dir):
    """Runs the scenarios named in ``out_dir/scenarios`` one after the other, each from a reset Dynamo; one whose
    results every rank wrote (an earlier attempt, before a crash) is not run again."""
    with open(os.path.join(out_dir, "scenarios")) as f:
        names = f.read().split()
    names = [n for n in names if not all(os.path.exists(os.path.join(out_dir, n, f"rank{r}.pt")) for r in range(world))]
    for name in names:
        torch._dynamo.reset()
        sub = os.path.join(out_dir, name)
        os.makedirs(sub, exist_ok=True)
        result = SCENARIOS[name](rank, world, sub)
        torch.save(result, os.path.join(sub, f"rank{rank}.pt"))
        dist.barrier()
    return {"ran": names}


SCENARIOS["many"] = scenario_many


@pytest.fixture(scope="module")
def two_rank_runs(request, tmp_path_factory):
    """Spawns 2 ranks once for every selected 2-rank test; returns ``scenario -> [rank results]`` (a scenario
    that raised, or never ran because an earlier one raised, maps to the exception)."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    names = list(dict.fromkeys(s for t, s in TWO_RANK_TESTS.items() if t in selected))  # a scenario once
    tmp = tmp_path_factory.mktemp("fsdp2ranks")
    (tmp / "scenarios").write_text(" ".join(names))
    error = None
    try:
        spawn_ranks(_worker, lambda: (2, _free_port(), "many", str(tmp)), 2, crash_retries=1)
    except Exception as e:  # noqa: BLE001  (reported by each test whose scenario has no result)
        error = e
    runs = {}
    for name in names:
        files = [tmp / name / f"rank{r}.pt" for r in range(2)]
        if all(f.exists() for f in files):
            runs[name] = [torch.load(f, weights_only=False) for f in files]
        else:
            runs[name] = error or RuntimeError(f"scenario {name!r} wrote no results")
    return runs


def _two_rank_results(runs, name):
    r = runs[name]
    if isinstance(r, BaseException):
        raise r
    return r


# ------------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------------
def _fsdp_stat_names(result) -> set[str]:
    """wrap_fsdp's statistic names in one scenario's result (top level, or per tiled/untiled run)."""
    names = set(result.get("fsdp_stats") or ())
    for v in result.values():
        if isinstance(v, dict) and isinstance(v.get("fsdp_stats"), dict):
            names |= set(v["fsdp_stats"])
    return names


def _assert_matches_reference(res, atol=1e-6):
    for n, ref in res["ref"].items():
        torch.testing.assert_close(res["final"][n], ref, atol=atol, rtol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_two_ranks_match_one_process_and_resume_exactly(two_rank_runs):
    results = _two_rank_results(two_rank_runs, "train")
    for r in results:
        # numerical oracle: 2 ranks on half batches == 1 process on the full batch (fp32)
        _assert_matches_reference(r, atol=1e-6)
        # resume from the DCP checkpoint (model + optimizer + scaler + step) repeats the last step exactly
        for n, v in r["final"].items():
            assert torch.equal(r["resumed"][n], v), n
        assert r["resumed_step"] == STEPS - 1 and r["resumed_scale"] == 512.0
        # structural oracle: sharded (DTensor), every block compiled, the root returned
        assert r["is_model"] and r["dtensor"] == "DTensor"
        s = r["fsdp_stats"]
        assert s["units"] == 2 and s["compiled_units"] == 2 and s["world_size"] == 2 and s["replicate"] == 1
        assert s["local_params"] * 2 == s["params"]
        # the graph pass ran inside each sharded unit, one graph per unit, 7 linears each, full paths;
        # and on the root's graph after the blocks: the head only (nothing traced into the units)
        c = r["count_stats"]
        assert c["graphs"] == 3 and c["linears"] == 15, c
        assert sorted(c["per_graph"]) == ["lm_head:1", "model.layers.0:7", "model.layers.1:7"], c
        assert s["compiled_root"] == 1 and s["root_boundary"] == "model"
        # memory: measured parameter and optimizer bytes per rank within 5% of the estimate
        est = r["estimate"]["zero3"]
        assert abs(r["param_bytes"] - est["params"]) / est["params"] < 0.05, (r["param_bytes"], est)
        assert abs(r["opt_bytes"] - est["optimizer"]) / est["optimizer"] < 0.05, (r["opt_bytes"], est)
    # every statistic the pass reports (here, and beside other passes, a fused head, tiles: the scenarios this
    # session ran) is defined in its docs page (issue 38.2)
    runs = [r for name in ("train", "passes", "fused_head", "tiled") if isinstance(two_rank_runs.get(name), list)
            for r in two_rank_runs[name]]
    reported = set().union(*map(_fsdp_stat_names, runs))
    assert {"units", "world_size"} <= reported and not undocumented_statistics("wrap_fsdp", reported), (
        undocumented_statistics("wrap_fsdp", reported))
    # the two ranks hold different halves of the batch; their mean loss is the full batch's loss
    assert results[0]["losses"] != results[1]["losses"]
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert max(abs(a - b) for a, b in zip(mean, results[0]["ref_losses"])) < 1e-6, (mean, results[0]["ref_losses"])


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_other_passes_act_inside_sharded_units(two_rank_runs):
    others = [p.name for p in _other_passes()]
    results = _two_rank_results(two_rank_runs, "passes")
    for r in results:
        assert not r["failures"], r["failures"]
        assert set(others) <= set(r["passes"]), (others, r["passes"])  # every other pass was in the pipeline
        for name in r["passes"]:
            # graph passes ran on the units' graphs, not only on the (uncompiled) root
            assert set(r["graph_records"][name]) - {"module"}, (name, r["graph_records"][name])
            assert r["stats"][name], name
        if "fuse_attention" in r["passes"]:
            assert r["stats"]["fuse_attention"].get("fused") == 2, r["stats"]["fuse_attention"]
        if "apply_autocast" in r["passes"]:
            assert r["stats"]["apply_autocast"].get("regions") == 2, r["stats"]["apply_autocast"]
            assert r["fsdp_stats"]["param_dtype"] == "bfloat16"  # the FSDP policy follows apply_autocast
        if "checkpoint_activations" in r["passes"]:
            assert r["stats"]["checkpoint_activations"].get("blocks") == 2, r["stats"]["checkpoint_activations"]
        assert sorted(r["count_stats"]["units"]) == ["lm_head", "model.layers.0", "model.layers.1"]
        if "inject_lora" in r["passes"]:
            assert r["stats"]["inject_lora"].get("adapters_in_graph") == 4, r["stats"]["inject_lora"]
            assert r["trainable"] and all("lora" in n for n in r["trainable"]), r["trainable"]
            assert set(r["changed"]) == set(r["trainable"])          # only adapters moved
            assert r["frozen_unchanged"] and not r["grads_frozen"]   # no grads on the frozen base
            assert set(r["state_names"]) == set(r["trainable"])      # no optimizer state for it
        assert all(math.isfinite(x) for x in r["losses"]), r["losses"]  # no NaN and no inf


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_fuses_the_sharded_head_and_loss(two_rank_runs):
    results = _two_rank_results(two_rank_runs, "fused_head")
    for r in results:
        # numerical oracle: the mean of the 2 ranks' gradients (FSDP's reduce-scatter) equals one process's
        # unfused eager gradients on the full batch; the ranks' mean loss its loss
        for grads in r["grads"]:
            assert grads.keys() == r["ref_grads"].keys()
            for n, g in grads.items():
                torch.testing.assert_close(g, r["ref_grads"][n], atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
        # structural oracle: fused once, in the root's graph, from inside the sharded run; the logits are
        # never materialised (returned as None)
        f = r["fce"]
        assert f["fused"] == 1 and f["skipped"] == 0, f
        assert f["logits_bytes_avoided"] == r["local_tokens"] * r["vocab"] * 4, f
        assert r["logits"] is None
        s = r["fsdp_stats"]
        assert s["compiled_units"] == 2 and s["compiled_root"] == 1 and s["root_boundary"] == "model", s
        # three graphs: one per unit and the root's head + loss, whose one "linear" is the fused op (it has no
        # module path); nothing of the units or FSDP's hooks traced into the root's graph
        per = sorted(r["count_stats"]["per_graph"])
        assert per[0] in (":1", "lm_head:1") and per[1:] == ["model.layers.0:7", "model.layers.1:7"], per
        assert r["unique_graphs"] == 3, r["unique_graphs"]
        # graph breaks: only the deliberate one, at the disabled boundary (Dynamo counts it once per Python
        # frame it unwinds: the root's compiled forward, transformers' two decorators, LlamaForCausalLM.forward);
        # the second step adds none and recompiles nothing
        assert r["breaks"] and all("torch.compiler.disable" in k for k in r["breaks"]), r["breaks"]
        assert r["breaks"] == r["breaks_first"] and not r["recompiles"], (r["breaks"], r["recompiles"])
        # the limit is explicit where the root cannot be compiled around its blocks
        w = r["warnings"]
        assert r["demo_stats"]["compiled_root"] == 0 and r["demo_stats"]["compiled_units"] == 2
        assert len(w) == 2 and all("fuse_cross_entropy" in m and "head runs unfused" in m for m in w), w
        assert "ModuleList 'layers'" in w[0] and "compile_root=False" in w[1], w
    mean = (results[0]["losses"][0] + results[1]["losses"][0]) / 2
    assert abs(mean - results[0]["ref_loss"]) < 1e-6, (mean, results[0]["ref_loss"])


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_fuses_logprob_losses_of_a_policy_and_a_reference(two_rank_runs):
    """DPO (Hugging Face Llama) and GRPO (a self-written model) over a sharded policy and a sharded frozen reference
    in one loss module, 2 gloo ranks: every log-prob site is fused, and the mean of the ranks' losses and gradients
    equals one process's unfused eager step on all examples (fp32, 1e-5 relative)."""
    results = _two_rank_results(two_rank_runs, "fused_losses")
    for name in ("llama_dpo", "self_grpo"):
        rs = [r[name] for r in results]
        # numerical oracle: per-example log-prob sums of this rank's examples, the mean loss, every gradient
        for r in rs:
            rel = float((r["sums"] - r["want_sums"]).abs().max() / r["want_sums"].abs().max())
            assert rel <= 1e-5, (name, r["sums"], r["want_sums"])
            assert r["grads"].keys() == r["ref_grads"].keys() and len(r["grads"]) > 0, name
            for n, g in r["grads"].items():
                ref = r["ref_grads"][n]
                assert float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) <= 1e-5, (name, n)
        mean = sum(r["loss"] for r in rs) / len(rs)
        assert abs(mean - rs[0]["want"]) <= 1e-5 * abs(rs[0]["want"]), (name, mean, rs[0]["want"])
        # structural oracle: both models' blocks sharded and compiled; the root compiled around one boundary per
        # model; the policy's and the reference's log-prob sites fused, none skipped, no log_softmax left
        for r in rs:
            s, f = r["fsdp_stats"], r["fce"]
            boundary = "body" if name.startswith("self") else "model"
            assert s["units"] == s["compiled_units"] == r["units"] >= 2 and s["compiled_root"] == 1, s
            assert s["root_boundary"] == f"policy.{boundary},ref.{boundary}", s
            assert f["logprob_sites"] == 2 and f["skipped"] == 0, (f, r["skipped"])
            assert sum(o.get("effpass.linear_cross_entropy_rows", 0) for o in r["ops"]) == 2, r["ops"]
            assert not any(k.endswith("log_softmax") for o in r["ops"] for k in o), r["ops"]
            assert not r["warnings"], r["warnings"]


def _assert_step_matches(r, what):
    assert r["grads"].keys() == r["ref_grads"].keys() and len(r["grads"]) > 0, what
    for n, g in r["grads"].items():
        ref = r["ref_grads"][n]
        assert float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) <= 1e-5, (what, n)


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_fuses_logprob_losses_on_packed_rows(two_rank_runs):
    """pack_sequences inside the sharded policy and reference (GRPO, Llama, 2 gloo ranks, one packed row of 4
    completions per rank, 3 lengths): per-example sums, the mean loss and every gradient equal one process's unfused
    eager step on all completions as padded rows; both log-prob sites are fused in every step. The logits' rows come
    from the hidden states the FSDP boundary returns (a size of their own) and the index's from the labels: equal in
    the trace, they are guarded equal, so the root's graphs are compiled twice (static, then with automatic dynamic
    shapes), not once per length."""
    results = [r["llama_grpo_packed"] for r in _two_rank_results(two_rank_runs, "fused_losses")]
    for step in range(3):
        rs = [r["steps"][step] for r in results]
        for r in rs:
            rel = float((r["sums"] - r["want_sums"]).abs().max() / r["want_sums"].abs().max())
            assert rel <= 1e-5, (step, r["sums"], r["want_sums"])
            _assert_step_matches(r, f"packed step {step}")
        mean = sum(r["loss"] for r in rs) / len(rs)
        assert abs(mean - rs[0]["want"]) <= 1e-5 * abs(rs[0]["want"]), (step, mean, rs[0]["want"])
    assert len({r["length"] for r in results[0]["steps"]}) == 3   # three packed lengths
    for r in results:
        # the policy's site in the root's graph after its blocks, the reference's after its own: each graph compiled
        # twice (the first call's static shapes, then dynamic ones), one fused site in each
        assert r["fce_graphs"] == [1, 1, 1, 1], r["fce_graphs"]
        assert not r["skipped"], r["skipped"]
        assert r["pack"]["packed_examples"] == 12 and r["pack"]["boundary_from_context"] >= 1, r["pack"]
        assert r["fsdp_stats"]["root_boundary"] == "policy.model,ref.model", r["fsdp_stats"]


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_distillation_fuses_the_head_after_the_teachers_boundary(two_rank_runs):
    """Forward KL between a sharded student and a sharded frozen teacher (Qwen3), 2 gloo ranks: equal to
    one process's eager step either way; the student's head is fused (one row-wise site) when the teacher runs first,
    and with the student first the site is skipped with its reason (the student's logits cross the teacher's
    boundary, so they exist, with a gradient, before the KL's graph)."""
    for order, fused in (("teacher_first", True), ("student_first", False)):
        rs = [r[f"kl_{order}"] for r in _two_rank_results(two_rank_runs, "fused_losses")]
        mean = sum(r["loss"] for r in rs) / len(rs)
        assert abs(mean - rs[0]["want"]) <= 1e-5 * abs(rs[0]["want"]), (order, mean, rs[0]["want"])
        for r in rs:
            _assert_step_matches(r, order)
            f = r["fce"]
            if fused:
                assert f["rowwise_sites"] == 1 and f["two_head_sites"] == 0 and f["skipped"] == 0, (f, r["skipped"])
            else:
                assert f.get("rowwise_sites", 0) == 0 and f["skipped"] == 1, f
                assert "needs a gradient" in r["skipped"][0]["reason"], r["skipped"]


def test_wrap_fsdp_fuses_a_tied_sharded_head_at_world_size_1(tmp_path):
    """GPT-2 (head tied to the embedding, boundary ``transformer``) in this process, world size 1."""
    from effpass.passes import FuseCrossEntropy

    case = effpass.testing.model_case("gpt2")
    case.model.train()
    ref = copy.deepcopy(case.model)
    ref(**case.inputs).loss.backward()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        model = effpass.compile(case.model, passes=[FuseCrossEntropy(), WrapFSDP()], lowering="eager", dump_dir=None)
        out = model(**case.inputs)
        out.loss.backward()
        grads = _grads(model)
        rep = effpass.report(model)
    finally:
        dist.destroy_process_group()
    assert grads.keys() == _grads(ref).keys()
    for n, g in _grads(ref).items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    assert out.logits is None
    f, s = rep.stats("fuse_cross_entropy"), rep.stats("wrap_fsdp")
    assert f["fused"] == 1 and f["logits_bytes_avoided"] == case.inputs["input_ids"].numel() * 256 * 4, f
    assert s["compiled_root"] == 1 and s["root_boundary"] == "transformer" and s["world_size"] == 1, s


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
@pytest.mark.inductor
@pytest.mark.slow
def test_wrap_fsdp_inductor_lowering_matches_one_process(two_rank_runs):
    for r in _two_rank_results(two_rank_runs, "inductor"):
        _assert_matches_reference(r, atol=1e-5)
        assert r["fsdp_stats"]["compiled_units"] == 2 and r["fsdp_stats"]["reshard_after_forward"] is False


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_with_tile_sequence_equals_untiled(two_rank_runs):
    """TileSequence inside FSDP2 units (issue 25): loss and every (all-gathered) gradient equal the untiled
    FSDP run within 1e-6 relative (fp32), and the tiles are reported."""
    for r in _two_rank_results(two_rank_runs, "tiled"):
        u, t = r["untiled"], r["tiled"]
        assert not u["failures"] and not t["failures"], (u["failures"], t["failures"])
        assert t["fsdp_stats"]["units"] == u["fsdp_stats"]["units"] == 2, t["fsdp_stats"]
        assert abs(t["loss"] - u["loss"]) <= 1e-6 * abs(u["loss"])
        assert u["grads"].keys() == t["grads"].keys() and len(u["grads"]) > 0
        worst = max(((t["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in u["grads"].items())
        assert worst <= 1e-6, worst
        # as in one process: each layer's MLP region and the root's norm + lm_head (no fuse_cross_entropy
        # here), each in its own unit's graph: 3 regions of 32 rows per rank, 4 tiles of 8 rows each
        st = t["tile_stats"]
        assert st["regions"] == 3 and st["tiles"] == 3 * r["rows"] // 8 == 12, st


@pytest.mark.slow
def test_wrap_fsdp_four_ranks_hybrid_mesh(tmp_path):
    for r in spawn("hsdp", 4, tmp_path):
        _assert_matches_reference(r, atol=1e-6)
        assert r["placements"] == ["R", "S(0)"]  # (replicate, shard) mesh
        assert r["local_numel"] * 2 == r["numel"]
        assert r["fsdp_stats"]["replicate"] == 2 and r["fsdp_stats"]["world_size"] == 4, r["fsdp_stats"]
        assert r["fsdp_stats"]["units"] == 2 and r["fsdp_stats"]["compiled_units"] == 0, r["fsdp_stats"]


def _torchrun(args, env=None, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "train_fsdp.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.xdist_group("wrap_fsdp_2ranks")
def test_wrap_fsdp_killed_rank_relaunch_reaches_uninterrupted_weights(two_rank_runs, tmp_path):
    """A rank dies mid-run; the relaunched job resumes from the last checkpoint and ends bit-identical to the
    uninterrupted run (the example's main() in the shared 2-rank spawn). The job that dies runs the example's main()
    on 2 ranks forked from the preloaded fork server (its process starts and imports cost more than its 3 steps);
    the relaunch is the documented torchrun command, the one torchrun launch of the example in the suite."""
    ref = _two_rank_results(two_rank_runs, "resume_reference")[0]
    common = KILLED_ARGS
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Exception, match="exit code 17|terminated with|Connection|connection"):
        spawn("killed", 2, tmp_path)   # rank 1 exits with 17; rank 0, waiting for it, fails or is terminated
    assert "rank 1: simulated crash at step 3" in (tmp_path / "stdout1").read_text()
    assert (ckpt / "failed_once").exists() and (ckpt / "step_2" / ".metadata").exists()
    assert not (ckpt / "step_4").exists() and not (tmp_path / "rank1.pt").exists()
    resumed = _torchrun([*common, "--ckpt-dir", str(ckpt), "--fail-at-step", "3", "--out", str(tmp_path / "b.pt")])
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout
    a, b = torch.load(ref["out"]), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the losses printed after the resume are those of the uninterrupted run
    tail = lambda out: [l for l in out.splitlines() if l.startswith("step 4 ")]  # noqa: E731
    assert tail(ref["stdout"]) == tail(resumed.stdout) and len(tail(resumed.stdout)) == 1


# ------------------------------------------------------------------------------------------------------
# single-process tests (no process group)
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,first,count", [("llama", "model.layers.0", 2), ("gpt2", "transformer.h.0", 2),
                                              ("bert", "bert.encoder.layer.0", 2), ("demo", "layers.0", 2)])
def test_find_units_finds_the_repeated_blocks(name, first, count):
    case = effpass.testing.model_case(name)
    units = find_units(case.model)
    assert len(units) == count and units[0][0] == first
    assert len({type(m) for _, m in units}) == 1


def test_find_units_ignores_a_modulelist_of_mixed_layers():
    m = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()]))
    assert find_units(m) == []


def test_wrap_fsdp_without_process_group_names_init_process_group():
    assert not dist.is_initialized()
    case = effpass.testing.model_case("llama")
    with pytest.raises(Exception, match="init_process_group"):
        effpass.compile(case.model, passes=[WrapFSDP()], lowering="eager", dump_dir=None)


def test_wrap_fsdp_rejects_bad_replicate():
    with pytest.raises(ValueError, match="replicate must be >= 1, got 0"):
        WrapFSDP(replicate=0)
    with pytest.raises(TypeError):
        WrapFSDP(reshard_after_forward="yes")


def test_wrap_fsdp_mixed_precision_policy_from_apply_autocast():
    import effpass.passes as P

    assert WrapFSDP().mixed_precision().param_dtype is None
    mp_ = WrapFSDP(param_dtype=torch.bfloat16).mixed_precision()
    assert mp_.param_dtype == torch.bfloat16 and mp_.reduce_dtype == torch.float32
    # the mixed-precision policy follows the MixedPrecision fact apply_autocast declares in the pipeline
    from effpass.manager import PassContext
    from effpass.pass_api import Phase
    from effpass.scope import Scope

    def ctx_of(*pipeline):
        return PassContext(pass_name="wrap_fsdp", phase=Phase.MODULE, graph_kind="module", scope=Scope("wrap_fsdp"),
                           pipeline=pipeline)

    ctx = ctx_of(P.ApplyAutocast(dtype=torch.float16), WrapFSDP())
    mp_ = WrapFSDP().mixed_precision(ctx)
    assert mp_.param_dtype == torch.float16 and mp_.reduce_dtype == torch.float32
    assert WrapFSDP(param_dtype="float32").mixed_precision(ctx).param_dtype == torch.float32
    assert WrapFSDP().mixed_precision(ctx_of(WrapFSDP(), P.ScaleLoss())).param_dtype is None


def test_estimate_divides_16_bytes_per_param_as_zero_does():
    case = effpass.testing.model_case("llama")
    n = sum(p.numel() for p in case.model.parameters())
    est = estimate(case.model, batch=2, seq=16, world_size=4)
    assert est["none"]["params"] == 2 * n and est["none"]["grads"] == 2 * n and est["none"]["optimizer"] == 12 * n
    assert est["zero1"]["optimizer"] == 3 * n and est["zero1"]["params"] == 2 * n
    assert est["zero2"]["grads"] == n // 2 and est["zero2"]["params"] == 2 * n
    assert est["zero3"]["params"] + est["zero3"]["grads"] + est["zero3"]["optimizer"] == 4 * n
    assert est["zero3"]["gathered"] > 0 and est["zero3"]["activations"] == est["none"]["activations"]
    assert est["hsdp"]["params"] == est["zero3"]["params"]  # replicate=1: one shard group
    hsdp = estimate(case.model, batch=2, seq=16, world_size=4, replicate=2)["hsdp"]
    assert hsdp["params"] == n  # 2n bytes over 2 shards
    ckpt = estimate(case.model, batch=2, seq=16, world_size=4, checkpointing=True)["none"]["activations"]
    assert ckpt < est["none"]["activations"]


def test_estimate_counts_only_trainable_parameters_for_grads_and_optimizer():
    case = effpass.testing.model_case("llama")
    for n, p in case.model.named_parameters():
        p.requires_grad_("q_proj" in n)
    n_all = sum(p.numel() for p in case.model.parameters())
    n_train = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
    est = estimate(case.model, batch=1, seq=16, world_size=1)["none"]
    assert est["params"] == 2 * n_all and est["grads"] == 2 * n_train and est["optimizer"] == 12 * n_train


def test_estimate_rejects_bad_arguments():
    case = effpass.testing.model_case("llama")
    with pytest.raises(ValueError, match="replicate=3"):
        estimate(case.model, 1, 16, 4, replicate=3)
    with pytest.raises(ValueError, match="zero4"):
        estimate(case.model, 1, 16, 4, modes=["zero4"])


def test_estimate_table_and_max_model_params():
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    text = estimate_table(model, 1, 2048, 8)
    assert "zero3" in text and "activations" in text and "1.24B params" in text
    # every assumption stated, in lines that fit 100 columns
    assert "assumes: bf16 parameters and gradients" in text and "AdamW (2 fp32 states)" in text
    assert "micro-batch 1 x seq 2048" in text and "GiB = 2^30 bytes" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    text = estimate_table(model, 1, 2048, 8, mixed_precision=False, optimizer_states=0)
    assert "assumes: fp32 parameters and gradients" in text and "SGD (no state)" in text
    assert max_model_params(8, 80e9) == 40e9 and max_model_params(64, 80e9) == 320e9
    assert max_model_params(1, 80e9, mode="none") == 5e9


def test_estimate_table_from_a_preset_or_a_bare_count():
    from effpass.passes.wrap_fsdp.sizing import PRESETS, _preset_counts

    assert abs(_preset_counts("llama-8b")[0] - 8.03e9) < 0.01e9   # the published 8.03B
    assert abs(_preset_counts("llama-70b")[0] - 70.55e9) < 0.01e9  # and 70.55B
    by_name = estimate("llama-70b", batch=1, seq=4096, world_size=64)["zero3"]
    assert by_name["params"] == -(-2 * _preset_counts("llama-70b")[0] // 64)
    text = estimate_table(params=7e9, world_size=8)  # what `effpass estimate --params 7e9 --world-size 8` calls
    assert "7B params" in text and "llama-8b" in text
    with pytest.raises(ValueError, match="llama-9b"):
        estimate("llama-9b")
    with pytest.raises(TypeError, match="params=<count>"):
        estimate(None)
    assert set(PRESETS) >= {"llama-1b", "llama-8b", "llama-70b"}


def test_wrap_fsdp_fuses_a_packed_distillation_after_the_teachers_boundary(tmp_path):
    """Distillation on packed rows inside wrap_fsdp (world size 1, this process): a self-written student and frozen
    teacher (teacher first), ``F.kl_div(..., "batchmean")`` plus an entropy bonus, three packed lengths. The
    teacher's log-probs come from logits of another graph (its head before the boundary) and are read by the KL
    row block by row block: the student's head is fused (row-wise, symbolic rows), loss and every gradient within
    1e-5 of the unfused packed step."""
    from _families import VOCAB
    from _vocab_losses import SelfLM, examples, frozen_copy, packed
    from effpass.passes import FuseAttention, FuseCrossEntropy, PackSequences

    class Distill(torch.nn.Module):
        def __init__(self, student, teacher):
            super().__init__()
            self.student, self.teacher = student, teacher

        def forward(self, ids, position_ids=None):
            with torch.no_grad():
                zt = self.teacher(ids, position_ids=position_ids)
            zs = self.student(ids, position_ids=position_ids)
            ls, lt = (zs.float() / 2.0).log_softmax(-1), (zt.float() / 2.0).log_softmax(-1)
            kl = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="batchmean")
            return kl + 0.1 * (ls.exp() * ls).mean()

    student = SelfLM(VOCAB).train()
    model = Distill(student, frozen_copy(student))
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    unfused = effpass.compile(ref, passes=[FuseAttention(), PackSequences()], lowering="eager", dump_dir=None)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(), FuseCrossEntropy(), WrapFSDP()],
                                   lowering="eager", dump_dir=None)
        for seed, lens in enumerate(((5, 9, 6, 8), (7, 11, 4, 9), (3, 4, 5, 6))):
            ids, _, pos = packed(examples(lens, VOCAB, seed=seed))
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            want = unfused(ids, position_ids=pos)
            want.backward()
            loss = compiled(ids, position_ids=pos)
            loss.backward()
            assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want)), (float(loss), float(want))
            got, ref_g = _grads(model), _grads(ref)
            assert got.keys() == ref_g.keys() and len(got) > 0
            for n, g in ref_g.items():
                torch.testing.assert_close(got[n], g, atol=1e-7, rtol=1e-5, msg=lambda m: f"{n}: {m}")
        rep = effpass.report(compiled)
    finally:
        dist.destroy_process_group()
    f, s = rep.stats("fuse_cross_entropy"), rep.stats("wrap_fsdp")
    assert f["rowwise_sites"] >= 1 and f["skipped"] == 0 and f["symbolic_rows"] >= 1, f
    assert s["compiled_root"] == 1 and s["world_size"] == 1, s
