"""The planner's step_in_backward + AdamW on the host (``adamw_host``: effpass.HostOffloadAdamW, replayed) and the CUDA
allocator's expandable-segments mode, predicted on this CPU: sizes counted by hand from the parameter shapes, the
step's peak against a measured CPU step, and the plan chosen when it is the only one that fits."""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from _helpers import TanhStack
from effpass.passes import StepInBackward

DIM, DEPTH, ROWS = 640, 4, 8
W = DIM * DIM * 4        # 1,638,400 B: a weight (409,600 elements >= 4,096: offloaded), over 1 MiB (the large pool)
B = DIM * 4              # 2,560 B: a bias (640 elements: its AdamW stays on the device)
X = ROWS * DIM * 4       # the input


def _case():
    torch.manual_seed(0)
    return TanhStack(DIM, DEPTH), (torch.randn(ROWS, DIM),)


def _pow2(n):
    return 1 << (n - 1).bit_length()


def test_sizing_is_a_hand_count_of_the_optimizer_and_the_freed_gradients():
    """CUDA plan on this CPU: host = per weight a pinned copy and a pinned gradient buffer (powers of two) and
    AdamW's two states and 4-byte step; device = parameters, input, the biases' on-device AdamW (two states and a
    fused step, each a 512-byte block); moved = every weight's bytes each way. Against the same pipeline with
    AdamW on the device: the start drops by exactly the weights' states, the backward's peak (gradients freed at
    their step in both) by at least the AdamW step's transient."""
    from effpass.planning import estimate_memory

    model, inputs = _case()
    sib = [StepInBackward()]
    est = estimate_memory(model, inputs, passes=sib, optimizer="adamw_host", device="cuda", lowering="eager")
    dev = estimate_memory(model, inputs, passes=sib, optimizer="adamw", device="cuda", lowering="eager")
    r512 = lambda n: -(-n // 512) * 512  # noqa: E731
    states = DEPTH * (2 * r512(B) + 512)
    assert est.host_bytes == DEPTH * (2 * _pow2(W) + 2 * W + 4) == 29_884_432
    assert est.optimizer_states == states
    assert est.start_bytes == DEPTH * (W + B) + X + states
    assert est.optimizer_d2h_bytes == est.optimizer_h2d_bytes == DEPTH * W
    assert est.pass_stats["step_in_backward"]["steps_in_graph"] == 2 * DEPTH  # structural: one op per parameter
    assert dev.optimizer_states == DEPTH * 2 * (W + B) + 2 * DEPTH * 512 and dev.host_bytes == 0
    assert dev.start_bytes - est.start_bytes == DEPTH * (2 * W + 512)  # the weights' states and step counts gone
    assert est.phase_peaks["backward"] + W <= dev.phase_peaks["backward"]  # no device AdamW step transient
    assert est.optimizer == "adamw_host" and est.peak_bytes == est.start_bytes + est.step_peak_bytes


def test_cpu_prediction_equals_a_measured_step():
    """Numerical oracle: the same prediction for the CPU equals one measured training step of the compiled model
    with StepInBackward and HostOffloadAdamW (profiler allocator events above the step's start)."""
    from effpass.passes.step_in_backward import attach
    from effpass.planning import estimate_memory
    from effpass.planning.result import training_step
    from effpass.testing.memory import live_tensor_bytes, peak_memory

    model, inputs = _case()
    est = estimate_memory(model, inputs, passes=[StepInBackward()], optimizer="adamw_host", device="cpu",
                          lowering="eager")
    m = effpass.compile(copy.deepcopy(model), passes=[StepInBackward()], lowering="eager")
    opt = effpass.HostOffloadAdamW(m.parameters(), lr=1e-3)
    attach(opt)
    for _ in range(2):
        training_step(m, inputs, opt)
    on_host = {id(t) for t, _ in opt.host_buffers()}
    states = [v for s in opt.state.values() for v in s.values() if id(v) not in on_host]
    _, peak = peak_memory(lambda: training_step(m, inputs, opt))
    assert est.step_peak_bytes == peak
    assert est.start_bytes == live_tensor_bytes(list(m.parameters()) + states + list(inputs))
    assert est.host_bytes == sum(t.numel() * t.element_size() for t, _ in opt.host_buffers())  # CPU: nothing pinned
    assert opt.counters["gradients_taken"] == 3 * DEPTH and all(p.grad is None for p in m.parameters())


@pytest.fixture(scope="module")
def plans():
    """plan_memory at 12 MiB for a CUDA GPU with each allocator mode (one shared replay cache). The pipeline given
    holds the options that do not change this stack's bytes (full checkpointing, the fused loss, tiles: each plan of
    the default pipeline's table peaks the same with or without them), so that the table is the options that do
    (offload, step_in_backward, AdamW on the host): 24 replays for both modes, where the default pipeline's table
    needs 144 (~3x the CPU) for the same peaks and the same choice."""
    from effpass.planning import MemoryBudgetError, plan_memory

    model, inputs = _case()
    given = [effpass.make_pass("checkpoint_activations", {"policy": "full"}),
             effpass.make_pass("fuse_cross_entropy", {}), effpass.make_pass("tile_sequence", {})]
    cache: dict = {}
    out = {}
    for alloc in ("default", "expandable"):
        try:
            out[alloc] = plan_memory(model, inputs, "12MiB", passes=given, device="cuda", lowering="eager",
                                     cache=cache, allocator=alloc)
        except MemoryBudgetError as e:
            out[alloc] = e
    return out


def test_the_combination_is_chosen_when_only_it_fits(plans):
    """With expandable segments only plans with step_in_backward + AdamW on the host fit 12 MiB: one is chosen,
    every fitting plan has it, and the plans without it (AdamW on the host alone, step_in_backward with AdamW on
    the device, the plan as given) are all over the budget."""
    plan = plans["expandable"]
    assert "step_in_backward_host" in plan.chosen.techniques() and plan.optimizer == "adamw_host"
    fitting = [c for c in plan.candidates if c.fits]
    assert fitting and all("step_in_backward_host" in c.techniques() for c in fitting)
    others = [c for c in plan.candidates if c.estimate is not None and "step_in_backward_host" not in c.techniques()]
    assert any("adamw_offload" in c.techniques() for c in others)
    assert all(c.peak_bytes > plan.budget for c in others)
    assert plan.chosen.host_bytes == DEPTH * (2 * _pow2(W) + 2 * W + 4)
    assert any("build the optimizer as 'adamw_host'" in n for n in plan.notes)
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in plan.notes)
    assert plan.chosen.est_step_s is not None and plan.chosen.est_step_s > 0
    # its extra compute is device FLOPs (the AdamW step runs on the host): the table says so on its row only
    rows = {ln.lstrip("* ").split("  ")[0]: ln for ln in plan.table().splitlines()}
    assert "host step not counted" in rows[plan.chosen.name]
    assert not any("host step not counted" in rows[c.name] for c in plan.candidates
                   if c.estimate is not None and c.name in rows and not c.estimate.optimizer_d2h_bytes)


def test_expandable_segments_are_the_reserved_bytes_a_plan_fits(plans):
    """The allocator mode decides the fit: the default allocator's 20 MiB segments (each weight-sized request
    is under 10 MiB) put the same plan over 12 MiB, so nothing fits and the error names it as the smallest; with
    expandable segments its reserved bytes are its live peak rounded to 2 MiB pages."""
    from effpass.planning import MemoryBudgetError

    err, plan = plans["default"], plans["expandable"]
    assert isinstance(err, MemoryBudgetError) and "step_in_backward_host" in err.plan.techniques()
    est = plan.chosen.estimate
    assert est.allocator == "expandable" and est.device_peak_bytes == est.reserved_expandable_bytes
    # by hand: the large pool (requests over 1 MiB) holds the 4 weights and, at the backward's peak, one weight's
    # gradient (freed at its step); everything else (biases, states, input, activations) fits one 2 MiB page of
    # the small pool
    two = 2 << 20
    assert est.reserved_expandable_bytes == -(-(DEPTH + 1) * W // two) * two + two == 10 << 20
    assert err.plan.estimate.allocator == "default" and err.smallest == err.plan.estimate.reserved_peak_bytes
    assert err.smallest >= 20 << 20 > plan.budget >= est.device_peak_bytes


def test_allocator_is_checked():
    from effpass.planning import plan_memory

    model, inputs = _case()
    with pytest.raises(ValueError, match=r"effpass: allocator 'pages' is not valid; choose one of \['default', "
                                         r"'expandable'\]"):
        plan_memory(model, inputs, "1GiB", device="cuda", allocator="pages")
    with pytest.raises(ValueError, match=r"effpass: allocator 'expandable' is a CUDA caching-allocator mode"):
        plan_memory(model, inputs, "1GiB", device="cpu", allocator="expandable")


def test_cli_states_the_allocator(monkeypatch):
    """``effpass plan --device cuda --expandable-segments`` plans for that allocator mode (structural: the option
    reaches plan_memory; without the flag, the default mode)."""
    import argparse

    from effpass.planning import cli

    p = argparse.ArgumentParser()
    cli._add_arguments(p)
    base = ["c.json", "--batch", "1", "--seq", "8", "--budget", "1GiB", "--device", "cuda"]
    assert p.parse_args(base).allocator == "default"
    args = p.parse_args(base + ["--expandable-segments"])
    seen = {}

    def fake_plan_config(*a, **k):
        seen.update(k)
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "plan_config", fake_plan_config)
    with pytest.raises(SystemExit, match="stop here"):
        cli._run(args)
    assert seen["allocator"] == "expandable" and seen["device"] == "cuda"
