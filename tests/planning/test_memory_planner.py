"""The memory planner: predicted peak of a training step vs measurement, plans under budgets, bad input.

Oracles: measured peak (profiler allocator events + bytes live at the step's start) for the prediction;
byte counts of parameters / optimizer states (structural); gradients of the planned step vs the plain one.
"""
import copy
import json

import pytest
import torch

import effpass
from effpass.passes import CheckpointActivations, InjectLoRA, QuantizeLinear
from effpass.planning import MemoryBudgetError, estimate_memory, fold_fsdp, parse_size, plan_memory
from effpass.planning.measure import measure_step
from effpass.testing import assert_close_tree, model_case

SEQ, BATCH = 64, 2


def _case(name, **kw):
    return model_case(name, **{"layers": 2, "seq": SEQ, "batch": BATCH, **kw})


@pytest.fixture(scope="module")
def plain_llama():
    """(case, estimate with passes=[]) of the tiny Llama, replayed once for this module (a module fixture: its users
    run on one xdist worker, tests/conftest.py, so that it is replayed once per run, not once per worker)."""
    case = _case("llama")
    return case, estimate_memory(case.model, case.inputs, passes=[], lowering="eager")


def _measure(model, inputs, passes, lowering="eager", optimizer="adamw", keep_grads=False):
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=passes, lowering=lowering)
    return measure_step(compiled, model, inputs, optimizer=optimizer, keep_grads=keep_grads)


COMBOS = {
    "none": lambda case: [],
    "checkpoint": lambda case: [CheckpointActivations()],
    "qlora": lambda case: [QuantizeLinear(scheme="nf4", exclude=[
        p for p in ("lm_head", "output") if any(n == p or n.endswith("." + p) for n, _ in case.model.named_modules())]),
                           InjectLoRA(rank=4, targets=["*.q_proj", "*.v_proj"]), CheckpointActivations()],
}


@pytest.mark.parametrize("name,combo", [
    ("llama", "none"), ("gpt2", "checkpoint"),
    ("demo", "qlora"),  # torchao NF4 weights quantized on the fake copy (issue 17: once mixed real and fake)
])
def test_prediction_matches_measurement(name, combo, plain_llama):
    if name == "llama" and combo == "none":
        case, est = plain_llama
        case = case.fresh()
    else:
        case = _case(name, layers=1)  # the step's peak is the same kind of sum on one block (llama-none has two)
        est = estimate_memory(case.model, case.inputs, passes=COMBOS[combo](case), lowering="eager")
    # the user's model is untouched by the estimate (it works on a fake copy)
    assert not any(isinstance(m, effpass.passes.lora.LoRALinear) for m in case.model.modules())
    meas = _measure(case.model, case.inputs, COMBOS[combo](case))
    assert est.start_bytes == meas.start_bytes
    assert abs(est.peak_bytes - meas.peak_bytes) <= 0.01 * meas.peak_bytes, (est.summary(), meas)
    # structural: the breakdown adds up and names the peak
    trainable = [p for p in case.model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    assert est.gradients == grad_bytes
    assert est.optimizer_states == 2 * grad_bytes + 4 * len(trainable)  # exp_avg, exp_avg_sq, fp32 step
    assert est.start_bytes == est.parameters + est.buffers + est.optimizer_states + est.inputs
    assert est.peak_phase in ("forward", "backward", "optimizer") and est.peak_node != "-"
    assert 0 < est.activations < est.step_peak_bytes
    assert est.flops > 0 and est.largest_transient > 0


def test_meta_model_predicts_the_same_as_real_weights(plain_llama):
    case, real = plain_llama
    with torch.device("meta"):
        meta_model = case.make()
    meta_model.train(case.model.training)
    tokens = case.inputs["input_ids"].to("meta")            # input_ids and labels are one tensor, as in the case
    meta_inputs = {"input_ids": tokens, "labels": tokens}
    meta = estimate_memory(meta_model, meta_inputs, passes=[], lowering="eager", device="cpu")
    assert meta.peak_bytes == real.peak_bytes
    assert meta.breakdown() == real.breakdown()


def test_depth_extrapolation_equals_the_full_replay(plain_llama):
    """Identical blocks: replays of the first 2, 3 and 4 blocks extrapolate to the full depth exactly (what
    makes a Llama-3-8B prediction take seconds, not minutes); a model with too few blocks is replayed whole."""
    case = model_case("llama", layers=5, seq=32, batch=1)
    ext = estimate_memory(case.model, case.inputs, passes=[], lowering="eager", extrapolate=True)
    full = estimate_memory(case.model, case.inputs, passes=[], lowering="eager", extrapolate=False)
    assert ext.depths == [2, 3, 4] and full.depths == []
    assert ext.peak_bytes == full.peak_bytes and ext.breakdown() == full.breakdown()
    assert ext.flops == full.flops and ext.phase_peaks == full.phase_peaks
    assert sorted(ext.trainable_numels) == sorted(full.trainable_numels)
    assert len(case.model.model.layers) == 5  # the user's model is restored
    assert plain_llama[1].depths == []  # 2 blocks: replayed whole


def test_replays_spread_over_worker_processes(monkeypatch):
    """The extrapolation's depths are replayed by forked workers (planning speed on 2 cores): results come
    back in order, and a worker that dies or hangs hands its jobs back to this process (same results)."""
    import os
    import sys

    from effpass.planning.pool import in_workers

    if not sys.platform.startswith("linux"):
        pytest.skip("forked workers: Linux only (elsewhere everything runs in one process)")
    here = os.getpid()
    pids = in_workers(lambda j: (j, os.getpid()), [2, 3, 4], [4, 5, 6], 2)
    assert [j for j, _ in pids] == [2, 3, 4]
    assert {p for _, p in pids} - {here}, "no job ran in a worker"
    assert [p for _, p in pids].count(here) == 1  # by cost: the longest here, the two others in the worker

    def dies_in_a_worker(j):
        if os.getpid() != here:
            os._exit(3)
        return j * j

    assert in_workers(dies_in_a_worker, [2, 3, 4], [4, 5, 6], 2) == [4, 9, 16]

    def hangs_in_a_worker(j):  # a child stuck on a lock another thread held at the fork
        if os.getpid() != here:
            import time
            time.sleep(3600)
        return j + 1

    from effpass.planning import pool

    monkeypatch.setattr(pool, "CHILD_GRACE_S", 1.0)
    assert in_workers(hangs_in_a_worker, [2, 3, 4], [4, 5, 6], 2) == [3, 4, 5]  # given up, its jobs run here
    assert in_workers(lambda j: ValueError(j), [1, 2], [1, 1], 2)[1].args == (2,)  # results may be exceptions


def test_world_size_folds_fsdp_sharding(plain_llama):
    case, one = plain_llama
    four = estimate_memory(case.model, case.inputs, passes=[], lowering="eager", world_size=4)
    assert four.sharding == "zero3" and four.world_size == 4
    assert four.parameters == -(-one.parameters // 4) and four.optimizer_states == -(-one.optimizer_states // 4)
    assert four.peak_bytes < one.peak_bytes
    assert four.peak_bytes == fold_fsdp(one, 4, _unit_bytes(case.model)).peak_bytes


def _unit_bytes(model):
    from effpass.graph import transformer_blocks

    return max(sum(p.numel() * p.element_size() for p in u.parameters()) for _, u in transformer_blocks(model))


def test_adamw8bit_states_are_sized_by_the_real_optimizer(monkeypatch, plain_llama):
    """torchao's AdamW8bit is built on fake parameters (no hand-copied layout): its states equal those of the
    real optimizer after a real step on the same model, byte for byte.

    The fake optimizer steps run with torchao's compiled step forced eager (its Inductor compile of one step per
    parameter shape costs ~40 CPU-s cold; the states, made by the first step, are the same either way), in a
    replay cache of this test's own (the compiled fake step stays what other tests and the planner use:
    ``test_cli_plan``'s ``--allow adamw8bit`` replays it)."""
    import effpass.planning.optimizer_replay as optimizer_replay_mod
    from effpass.planning.estimate import with_optimizer
    from effpass.planning.measure import make_optimizer
    from effpass.quantized import storage_bytes

    case, a = plain_llama
    monkeypatch.setattr(optimizer_replay_mod, "_OPTIMIZER_REPLAYS", {})
    with torch.compiler.set_stance("force_eager"):
        optimizer_replay_mod.optimizer_replay("adamw8bit", a.trainable_shapes, a.device)
    b = estimate_memory(case.model, case.inputs, passes=[], lowering="eager", optimizer="adamw8bit")
    model = case.fresh().model
    opt = make_optimizer(model, "adamw8bit")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # the states are created by the optimizer, not by its compiled step (torchao compiles one step per parameter
    # shape with Inductor: ~35 CPU-s of C++ builds here); their layout is the same when the step runs eagerly
    with torch.compiler.set_stance("force_eager"):
        opt.step()
    real = storage_bytes([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    assert b.optimizer_states == real
    # analytic cross-check: uint8 codes + an fp32 scale per 256 values (+ a 256-entry fp32 code map) per state of
    # big tensors, fp32 states for small ones, an fp32 step per parameter
    big = [p.numel() for p in case.model.parameters() if p.numel() >= 4096 and p.numel() % 256 == 0]
    small = [p for p in case.model.parameters() if not (p.numel() >= 4096 and p.numel() % 256 == 0)]
    n_params = sum(1 for _ in case.model.parameters())
    assert b.optimizer_states == (sum(2 * (n + 4 * (n // 256) + 1024) for n in big)
                                  + sum(2 * p.numel() * 4 for p in small) + 4 * n_params)
    assert b.optimizer_states < a.optimizer_states / 2
    assert b.parameters == a.parameters and b.gradients == a.gradients
    assert with_optimizer(a, "adamw8bit").peak_bytes == b.peak_bytes  # what the planner derives


@pytest.fixture(scope="module")
def eager_attention_replays():
    """Replays (planner cache) of _case("llama", attn="eager") with passes=[], lowering="eager", AdamW, shared by
    the two tests below (a module fixture: both run on one xdist worker, so the sharing holds in CI too)."""
    return {}


def test_budget_plan_fits_and_keeps_gradients(eager_attention_replays):
    """compile(memory_budget=...) picks a lossless plan whose measured peak fits; gradients equal the plain step's."""
    case = _case("llama", attn="eager", layers=1)
    ref = copy.deepcopy(case.model)
    plain = _measure(ref, case.inputs, [], keep_grads=True)
    budget = int(0.9 * plain.peak_bytes)
    torch._dynamo.reset()
    from effpass.planning import planner as planner_mod

    # the replays of this model's candidates are shared with test_nothing_fits_names_the_smallest_plan (the
    # same config, pipeline and options); whichever runs first replays them
    real_plan = planner_mod.plan_memory
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner_mod, "plan_memory", lambda *a, **k: real_plan(*a, **k, cache=eager_attention_replays))
        compiled = effpass.compile(case.model, passes=[], lowering="eager", memory_budget=budget,
                                   example_inputs=case.inputs)
    plan = effpass.report(compiled).memory_plan
    by_name = {c.name: c.estimate for c in plan.candidates}
    # checkpointing shrinks what is saved for backward and adds recompute (counted in the replay)
    assert by_name["checkpoint(full)"].activations < by_name["as given"].activations
    assert by_name["checkpoint(full)"].flops > by_name["as given"].flops
    assert plan is not None and not plan.chosen.lossy and plan.chosen.option("checkpoint")
    assert plan.peak_bytes <= budget and "fits" in plan.reason
    meas = measure_step(compiled, case.model, case.inputs, keep_grads=True)
    assert meas.peak_bytes <= budget
    assert abs(meas.peak_bytes - plan.peak_bytes) <= 0.01 * meas.peak_bytes
    assert_close_tree(meas.grads, plain.grads, atol=1e-6, rtol=1e-5, what="grads")
    assert "checkpoint" in plan.table() and "as given" in plan.table()


def test_nothing_fits_names_the_smallest_plan(eager_attention_replays):
    case = _case("llama", attn="eager", layers=1)
    params = sum(p.numel() * p.element_size() for p in case.model.parameters())
    cache = eager_attention_replays  # shared with test_budget_plan_fits_and_keeps_gradients (same model and options)
    with pytest.raises(MemoryBudgetError, match=r"smallest achievable predicted peak is .* with plan 'checkpoint") as e:
        plan_memory(case.model, case.inputs, params + 1, passes=[], lowering="eager", cache=cache)
    # the same replays, a budget that fits the smallest: that plan is chosen
    plan = plan_memory(case.model, case.inputs, e.value.smallest, passes=[], lowering="eager", cache=cache)
    assert plan.chosen.name == e.value.plan.name
    # the smallest of the replayed candidates (which checkpoint policy is smallest depends on the shape:
    # here "ops", as full recomputation's backward holds a recomputed block)
    assert e.value.smallest == min(c.peak_bytes for c in e.value.candidates if c.estimate)
    assert e.value.smallest > params and e.value.plan.option("checkpoint").options["policy"] in ("ops", "full")


@pytest.mark.parametrize("budget,err", [("24 gigs", "cannot read '24 gigs' as a size"), (-1, "positive"),
                                        ("1KiB", "below the parameters' own bytes")])
def test_bad_budgets(budget, err):
    case = _case("llama")
    with pytest.raises(ValueError, match=err):
        plan_memory(case.model, case.inputs, budget, passes=[], lowering="eager")


def test_bad_allow_and_option_key():
    case = _case("llama")
    with pytest.raises(ValueError, match=r"'nf5' names no technique \(did you mean 'nf4'\?\)"):
        plan_memory(case.model, case.inputs, "1GiB", allow=["nf5"], passes=[], lowering="eager")
    with pytest.raises(ValueError, match="names no technique"):
        effpass.parse_options({"allow": ["fp3"]})
    assert effpass.parse_options({"memory_budget": "2GiB"}).memory_budget == 2 * 1024 ** 3
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("512MiB") == 512 * 2 ** 20
    with pytest.raises(ValueError, match=r"the plan may use \['nf4'\], which change the eager model.*example_inputs="):
        effpass.compile(case.model, passes=[effpass.make_pass("inject_lora", {"targets": ["*.q_proj"]})],
                        memory_budget="1GiB", allow=["nf4"])
    with pytest.raises(ValueError, match="optimizer 'sgd' is not valid"):
        estimate_memory(case.model, case.inputs, optimizer="sgd")


@torch.library.custom_op("effpass_test_planner::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:  # no fake (meta) implementation: cannot be traced
    return x.clone()


class _Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _opaque(self.lin(x)).sum()


def test_untraceable_model_is_a_clear_error():
    with pytest.raises(RuntimeError, match="could not replay a training step of _Untraceable"):
        estimate_memory(_Untraceable(), (torch.randn(2, 8),), passes=[], lowering="eager")


def test_cli_plan(tmp_path, capsys, monkeypatch):
    """``effpass plan`` on a config: the table when a plan fits, exit code 2 and the smallest plan when none does
    (``--allow adamw8bit``: torchao's optimizer built and its compiled step replayed on fake parameters).

    Every weight matrix is 64 x 64 (vocabulary = MLP width = hidden size, as many key/value heads as heads): torchao
    compiles its step once per parameter shape with Inductor, two shapes here (matrices, norm weights) where a
    config with four matrix shapes costs four more compiles. One block (a replay's cost is its trace; two blocks
    cost ~1.4x). The two commands share one replay cache (same config, pipeline and options, as
    ``plan_memory(cache=)`` allows): the second replays only what the first did not."""
    from effpass.cli import main
    from effpass.planning import planner as planner_mod

    shared: dict = {}
    real_plan = planner_mod.plan_memory
    monkeypatch.setattr(planner_mod, "plan_memory", lambda *a, **k: real_plan(*a, **k, cache=shared))
    cfg = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    full = ["--passes", '{"checkpoint_activations": {"policy": "full"}}']
    assert main(["plan", str(path), "--batch", "2", "--seq", "32", "--budget", "64MiB"] + full) == 0
    out = capsys.readouterr().out
    assert "memory plan for a budget of 64.00 MiB:" in out and "predicted peak" in out
    assert "(predictions, not measurements)" in out
    assert "assumes: float32 weights (the config), optimizer adamw, full fine-tuning, device cpu" in out
    n_replays = len(shared)
    # 0.5 MiB: above the parameters' own 145 KiB, below every plan (the smallest, AdamW8bit's, is ~572 KiB)
    assert main(["plan", str(path), "--batch", "2", "--seq", "32", "--budget", "0.5MiB", "--allow", "adamw8bit"]
                + full) == 2
    err = capsys.readouterr().err
    assert "smallest achievable predicted peak" in err and "with plan 'adamw8bit'" in err
    assert len(shared) > n_replays > 0  # the first command's replays reused, the step-in-backward plans added
    with pytest.raises(SystemExit, match="names no technique"):
        main(["plan", str(path), "--batch", "2", "--seq", "32", "--budget", "1GiB", "--allow", "magic"])


@pytest.mark.inductor
def test_inductor_prediction_matches_measurement(plain_llama):
    """The default lowering is predicted by replaying Inductor's generated wrapper (its fused buffers,
    reuse and frees) on fake tensors: within 1% of the measured peak (byte-exact here). The eager-lowering
    replay of the same step, which Inductor's fusions undercut, is >5% off: the check discriminates."""
    case, eager_est = plain_llama
    case = case.fresh()
    est = estimate_memory(case.model, case.inputs, passes=[], lowering="inductor")
    meas = _measure(case.model, case.inputs, [], lowering="inductor")
    assert est.replay_lowering == "inductor" and est.requested_lowering == "inductor"
    assert est.start_bytes == meas.start_bytes
    assert abs(est.peak_bytes - meas.peak_bytes) <= 0.01 * meas.peak_bytes, (est.summary(), meas)
    assert eager_est.peak_bytes > 1.05 * meas.peak_bytes  # Inductor allocates less than the op-by-op program
    assert est.peak_phase in ("forward", "backward", "optimizer") and est.peak_node != "-"


@pytest.mark.gpu
def test_cuda_prediction_matches_max_memory_allocated():  # pragma: no cover - no GPU where this was written
    case = _case("llama")
    model = case.model.cuda()
    inputs = {k: v.cuda() for k, v in case.inputs.items()}
    est = estimate_memory(model, inputs, passes=[], lowering="eager")
    meas = _measure(model, inputs, [])
    assert abs(est.peak_bytes - meas.peak_bytes) <= 0.01 * meas.peak_bytes, (est.summary(), meas)


def test_replay_patches_are_confined_to_one_context_manager():
    """Every patch of a private torch function the replay needs is made by ``replay_patches`` and undone when it
    exits (numerical: the functions before, inside, after); no other module of effpass/planning assigns to an
    attribute of something imported from torch (structural, on the source)."""
    import ast
    import pathlib

    from torch._dynamo.backends import common
    from torch._functorch import aot_autograd
    from torch._functorch._aot_autograd import graph_compile
    from torch._inductor.output_code import CompiledFxGraph
    from torch._subclasses import fake_tensor as ft

    from effpass.planning.patches import replay_patches

    targets = [(common, "aot_module_simplified"), (graph_compile, "aot_dispatch_autograd_graph"),
               (aot_autograd, "run_functionalized_fw_and_collect_metadata"), (CompiledFxGraph, "__call__"),
               (ft.FakeTensorMode, "__init__")]
    before = [getattr(o, n) for o, n in targets]
    with replay_patches("cpu", inductor=True):
        inside = [getattr(o, n) for o, n in targets]
    after = [getattr(o, n) for o, n in targets]
    assert all(a is not b for a, b in zip(before, inside)) and all(a is b for a, b in zip(before, after))

    planning = pathlib.Path(effpass.__file__).parent / "planning"
    offenders = []
    for path in sorted(planning.glob("*.py")):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        from_torch = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                      for a in n.names if a.name.split(".")[0] == "torch"}
        from_torch |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                       and (n.module or "").split(".")[0] == "torch" for a in n.names}
        for n in ast.walk(tree):
            for t in getattr(n, "targets", []) if isinstance(n, ast.Assign) else []:
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(t, ast.Attribute) and isinstance(base, ast.Name) and base.id in from_torch:
                    offenders.append(f"{path.name}:{n.lineno}")
    assert not offenders, f"patch torch only inside effpass.planning.patches.replay_patches: {offenders}"
