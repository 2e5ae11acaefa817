"""The CUDA caching allocator model (effpass.planning.cuda_allocator), issue 39.1.

Oracles: the allocator's rules worked by hand on small sequences (rounding, pools, segment sizes, splitting,
best fit, merging, release on memory pressure), and, on a GPU, the real allocator's
``max_memory_allocated``/``max_memory_reserved`` for random sequences of allocations and frees."""
import random

import pytest
import torch

from effpass.planning.cuda_allocator import (LARGE_BUFFER, CachingAllocator, round_size, segment_size, simulate)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == LARGE_BUFFER == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 512) == 12 * MiB  # rounded to 2 MiB


def _run(seq, **kw):
    """``seq``: ("a", key, bytes) / ("f", key) steps."""
    return simulate([(n, k) if op == "a" else (-1, k) for op, k, *n_ in seq for n in (n_[0] if n_ else 0,)], **kw)


def test_small_requests_share_two_mib_segments():
    p = _run([("a", i, 512) for i in range(4096)])  # 4,096 x 512 B = exactly one 2 MiB segment
    assert (p.allocated, p.reserved, p.segments) == (2 * MiB, 2 * MiB, 1)
    p = _run([("a", i, 100) for i in range(4097)])  # each rounded to 512: one more needs a second segment
    assert (p.allocated, p.reserved, p.segments) == (4097 * 512, 4 * MiB, 2)


def test_large_requests_split_a_twenty_mib_segment_until_a_rest_of_one_mib():
    p = _run([("a", i, 6 * MiB) for i in range(4)])  # 20 = 6 + 6 + 6 + 2 (a 2 MiB rest is split off)
    assert (p.allocated, p.reserved, p.segments) == (24 * MiB, 40 * MiB, 2)
    # a rest of at most 1 MiB is not split off: the block (and the allocated count) is the whole segment
    p = _run([("a", 0, 19 * MiB + MiB // 2)])
    assert (p.allocated, p.reserved) == (20 * MiB, 20 * MiB)


def test_best_fit_reuse_and_fragmentation():
    # a freed 12 MiB segment serves an 8 MiB request (split: 4 MiB rest); the next 8 MiB needs a new segment
    p = _run([("a", "A", 12 * MiB), ("f", "A"), ("a", "B", 8 * MiB), ("a", "C", 8 * MiB)])
    assert (p.allocated, p.reserved, p.segments) == (16 * MiB, 32 * MiB, 2)
    # best fit: of two cached blocks (12 and 30 MiB segments) the smaller one that holds 11 MiB is used
    a = CachingAllocator()
    b12, b30 = a.malloc(12 * MiB), a.malloc(30 * MiB)
    a.free(b30)
    a.free(b12)
    got = a.malloc(11 * MiB)
    assert got.addr == b12.addr and a.reserved == 42 * MiB


def test_freed_neighbours_merge_inside_their_segment():
    a = CachingAllocator()
    x, y, z = (a.malloc(6 * MiB) for _ in range(3))
    a.free(y)
    a.free(x)  # merges with y: one free 12 MiB block at x's address
    assert a.blocks.get((12 * MiB, x.addr)) is not None
    got = a.malloc(11 * MiB)
    assert got.addr == x.addr and a.reserved == 20 * MiB and a.peaks.segments == 1
    a.free(z)
    a.free(got)  # the whole segment free again: one block of 20 MiB
    assert list(a.free_large) == [(20 * MiB, x.addr)]


def test_cached_segments_are_released_before_out_of_memory():
    seq = [("a", "A", 12 * MiB), ("f", "A"), ("a", "B", 20 * MiB)]
    p = _run(seq)  # unlimited: the 12 MiB segment stays cached beside the new 20 MiB one
    assert (p.reserved, p.released, p.oom) == (32 * MiB, 0, False)
    p = _run(seq, budget=30 * MiB)  # 32 > 30: the free 12 MiB segment goes back, then the 20 MiB one fits
    assert (p.reserved, p.released, p.oom) == (20 * MiB, 1, False)
    p = _run(seq, budget=19 * MiB)
    assert p.oom and p.oom_request == 20 * MiB


def test_a_split_segment_is_not_released():
    # 6 MiB live inside a 20 MiB segment (14 MiB of it free, cached): 16 MiB needs a segment of its own, the
    # split segment cannot go back, and 20 + 16 > 30 is out of memory
    p = _run([("a", "A", 6 * MiB), ("a", "B", 16 * MiB)], budget=30 * MiB)
    assert p.oom and p.oom_request == 16 * MiB and p.released == 0


def test_frees_of_storages_made_before_the_events_are_ignored():
    p = simulate([(-4096, "old"), (4096, "x"), (-4096, "x"), (4096, "y")])
    assert (p.allocated, p.reserved) == (4096, 2 * MiB)


def test_expandable_segments_round_each_pool_to_pages():
    seq = [("a", "A", 12 * MiB), ("f", "A"), ("a", "B", 8 * MiB), ("a", "C", 8 * MiB), ("a", "s", 100)]
    p = _run(seq, expandable_segments=True)
    assert (p.allocated, p.reserved) == (16 * MiB + 512, 18 * MiB)  # 16 MiB large pool + one 2 MiB small page


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_equals_the_real_allocator_on_random_sequences(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randrange(1, 4096), rng.randrange(4096, MiB), rng.randrange(MiB, 12 * MiB),
                         rng.randrange(12 * MiB, 64 * MiB)]) for _ in range(200)]
    events, live, real = [], [], {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    for i, n in enumerate(sizes):
        real[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
        events.append((n, i))
        live.append(i)
        while live and rng.random() < 0.45:
            k = live.pop(rng.randrange(len(live)))
            del real[k]
            events.append((-1, k))
    torch.cuda.synchronize()
    p = simulate(events)
    assert torch.cuda.max_memory_allocated() - base_alloc == p.allocated
    assert torch.cuda.max_memory_reserved() - base_res == p.reserved


# ------------------------------------------------------------------------------------------------------
# the planner predicts a CUDA step on a machine without CUDA
# ------------------------------------------------------------------------------------------------------
CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def _meta_case(seq=128, layers=CFG["num_hidden_layers"]):
    from effpass.planning.cli import model_from_config

    tok = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return (model_from_config(dict(CFG, num_hidden_layers=layers), "float32"),
            {"input_ids": tok, "labels": tok, "use_cache": False})


def test_a_cuda_step_is_predicted_on_any_machine(monkeypatch):
    from effpass.planning import estimate_memory
    from effpass.planning import replay as replay_mod

    model, inputs = _meta_case(layers=1)  # the allocator model is fed the step's storages: one block has them all
    seen = []
    real = replay_mod.simulate
    monkeypatch.setattr(replay_mod, "simulate", lambda ev, **k: seen.append(real(ev, **k)) or seen[-1])
    cpu = estimate_memory(model, inputs, passes=[], device="cpu", lowering="eager")
    assert seen == [] and cpu.reserved_peak_bytes is None and cpu.device_peak_bytes == cpu.peak_bytes
    cuda = estimate_memory(model, inputs, passes=[], device="cuda", lowering="eager")
    assert cuda.device == "cuda" and len(seen) == 2  # the default allocator, then with expandable segments
    # every storage rounded to the allocator's 512-byte blocks; the allocator model, fed the same storages and
    # events, reaches exactly that live peak (structural), and reserves whole segments above it
    assert cuda.peak_bytes % 512 == 0 and cuda.peak_bytes >= cpu.peak_bytes
    assert seen[0].allocated == seen[1].allocated == cuda.peak_bytes
    assert cuda.reserved_peak_bytes == seen[0].reserved and cuda.reserved_peak_bytes % (2 * MiB) == 0
    assert cuda.device_peak_bytes == cuda.reserved_peak_bytes > cuda.peak_bytes
    # expandable segments: pages of 2 MiB per pool, never more than the default's segments here
    assert cuda.reserved_expandable_bytes == seen[1].reserved and seen[1].reserved % (2 * MiB) == 0
    assert cuda.peak_bytes <= cuda.reserved_expandable_bytes <= cuda.reserved_peak_bytes
    import dataclasses

    assert dataclasses.replace(cuda, allocator="expandable").device_peak_bytes == cuda.reserved_expandable_bytes
    assert any("caching allocator" in n for n in cuda.notes)


def _passes():
    """The pipeline of this module's plans: checkpointing and the fused loss given, so that the candidates are what
    the planner adds on a CUDA device (activation offloading, the optimizer step in backward, AdamW on the host), not
    also their combinations with each checkpoint policy (6 replays for the CUDA table where the default pipeline
    needs 36: nothing fits at 3 MiB, so every candidate is replayed)."""
    import effpass

    return [effpass.make_pass("checkpoint_activations", {"policy": "full"}),
            effpass.make_pass("fuse_cross_entropy", {})]


@pytest.fixture(scope="module")
def replays():
    """One replay cache per device for this module's plans (replays do not depend on the budget or the GPU)."""
    return {"cpu": {}, "cuda": {}}


def test_the_plan_fits_the_allocators_segments_not_the_live_bytes(replays):
    from effpass.planning import MemoryBudgetError, plan_memory

    model, inputs = _meta_case(layers=1)  # one block: its step's live bytes peak at 1.66 MiB (predicted)
    budget = int(1.75 * MiB)
    cpu = plan_memory(model, inputs, budget, passes=_passes(), device="cpu", lowering="eager", cache=replays["cpu"])
    assert cpu.peak_bytes <= budget  # the live bytes fit
    # on CUDA one whole 2 MiB segment is the least the step holds (host_budget=1 byte: AdamW's states on the host,
    # which lower it, are left out here; tests/planning/test_host_memory.py has them)
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(model, inputs, budget, passes=_passes(), device="cuda", lowering="eager", cache=replays["cuda"],
                    host_budget=1)
    assert e.value.smallest == 2 * MiB
    plan = plan_memory(model, inputs, 2 * MiB, passes=_passes(), device="cuda", lowering="eager", cache=replays["cuda"],
                       host_budget=1)
    assert plan.peak_bytes == 2 * MiB
    # offloaded activations are candidates of a CUDA plan on any machine (on CPU: torch's synchronous rewrite replayed,
    # its copies counted as host memory: tests/planning/test_host_memory.py)
    assert any(c.name.startswith("offload") for c in plan.candidates), [c.name for c in plan.candidates]
    assert not any("not considered" in n for n in plan.notes), plan.notes


def test_cli_host_budget_names_why_nothing_fits(tmp_path, capsys, monkeypatch, replays):
    """``effpass plan --device cuda --host-budget``: only plans with AdamW's states on the host fit the device
    budget; under a 1 KiB host budget nothing fits, and the output names the host budget. What is checked here is
    the command line (the chosen plan, the exit code, the host budget named in the error and the table): the
    commands plan exactly ``test_the_plan_fits_the_allocators_segments_not_the_live_bytes``'s model, inputs, pipeline
    and device (the CLI builds the same one-block meta Llama and zero tokens from ``CFG``) and read that test's CUDA
    replay cache (a replay does not depend on the budgets, which are applied to its figures; whichever test runs
    first replays). The host-memory figures themselves are tests/planning/test_host_memory.py's hand counts."""
    import json

    from effpass.cli import main
    from effpass.passes.offload_activations import offload_supported
    from effpass.planning import planner as planner_mod

    if not offload_supported():
        pytest.skip("torch without partitioner activation offloading")
    real_plan = planner_mod.plan_memory
    monkeypatch.setattr(planner_mod, "plan_memory", lambda *a, **k: real_plan(*a, **k, cache=replays["cuda"]))

    cfg = tmp_path / "config.json"
    # one block: the plan as given peaks at 2.00 MiB on the device (whole 2 MiB segments), AdamW's states on the
    # host bring it to 1.50 MiB (predicted; the budget separates the two)
    cfg.write_text(json.dumps(dict(CFG, num_hidden_layers=1)))
    args = ["plan", str(cfg), "--batch", "1", "--seq", "128", "--budget", "1.75MiB", "--device", "cuda", "--dtype",
            "float32", "--passes", json.dumps({"checkpoint_activations": {"policy": "full"}, "fuse_cross_entropy": {}})]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "adamw on host" in out and "host memory" in out
    chosen = next(ln for ln in out.splitlines() if ln.startswith("memory plan for a budget of 1.75 MiB: "))
    assert chosen.endswith("adamw on host"), chosen  # the plan as given (2.00 MiB) does not fit
    assert main(args + ["--host-budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "left out as over host_budget 1.00 KiB" in err and "over the host budget: holds" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prediction_equals_a_real_cuda_step():
    """The CUDA prediction against a real step on the GPU: live peak (max_memory_allocated) within 1%, reserved
    segments (max_memory_reserved) within 1% or one 2 MiB segment."""
    import copy

    from effpass.planning import estimate_memory
    from effpass.planning.result import training_step

    model, inputs = _meta_case(512)
    est = estimate_memory(model, inputs, passes=[], device="cuda", lowering="eager")
    import transformers as tf

    torch.manual_seed(0)
    real = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"})).train()
    real.config.use_cache = False
    import effpass

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what earlier tests of this process left cached is not this step's
    other = torch.cuda.memory_reserved()  # segments still held by tensors of earlier tests
    compiled = effpass.compile(copy.deepcopy(real).cuda(), passes=[], lowering="eager")
    tok = torch.randint(0, 256, (1, 512), device="cuda")
    batch = {"input_ids": tok, "labels": tok, "use_cache": False}
    opt = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=1e-3)
    training_step(compiled, batch, opt)  # compiles, creates the states
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training_step(compiled, batch, opt)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - base_alloc + est.start_bytes
    assert abs(allocated - est.peak_bytes) <= 0.01 * est.peak_bytes, (allocated, est.peak_bytes)
    reserved = torch.cuda.max_memory_reserved() - other
    assert abs(reserved - est.reserved_peak_bytes) <= max(0.01 * reserved, 2 * MiB), (reserved, est.reserved_peak_bytes)


def test_a_cuda_plan_estimates_each_candidates_step_time(replays):
    """``effpass plan --device cuda``: each candidate's FLOPs at the GPU's rate (fp32 parameters: the fp32 rate), in
    the table and the JSON; none for a CPU plan."""
    from effpass.devices import DEVICES
    from effpass.planning import plan_memory

    model, inputs = _meta_case()
    plan = plan_memory(model, inputs, 1 << 30, passes=_passes(), device="cuda", lowering="eager", gpu="h200",
                       cache=replays["cuda"])
    # plans that move nothing over the host link: their FLOPs at the rate (those that do: test_host_memory.py)
    still = [c for c in plan.candidates if c.estimate and not c.estimate.optimizer_h2d_bytes
             and not c.estimate.offload_d2h_bytes]
    assert still and all(c.est_step_s == c.estimate.flops / DEVICES["h200"].fp32_flops for c in still)
    assert "est. step" in plan.table() and any("fp32 rate (67 TFLOP/s" in n for n in plan.notes)
    assert all("est_step_s" in c for c in plan.to_dict()["candidates"])
    cpu = plan_memory(model, inputs, 1 << 30, passes=_passes(), device="cpu", lowering="eager", cache=replays["cpu"])
    assert all(c.est_step_s is None for c in cpu.candidates) and "est. step" not in cpu.table()
