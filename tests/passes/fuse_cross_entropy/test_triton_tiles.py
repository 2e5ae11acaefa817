"""fuse_cross_entropy's Triton tiles (issue 36.2): the loss head a GPU runs, with the logits kept in registers.

The kernels run here in Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess: the variable is read when
Triton loads) on CPU tensors: numerically against the unfused loss (fp32 within 1e-5; fp16 within the unfused
fp16 step's own rounding: the interpreter cannot read bf16, which the GPU-marked test covers), structurally by the ops the step runs (the two tile kernels, no host synchronisation,
no logit-sized buffer but the slab). The cost model's figures for the GPU path (FLOPs, bytes by a hand count of the
design, kernels, syncs) are checked on fake tensors at a shape small enough for a CPU.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import os, torch
    import torch.nn.functional as F
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import effpass
    from effpass.cost import CostMode
    from effpass.passes import FuseCrossEntropy
    from effpass.passes.fuse_cross_entropy.kernels import _lce_reduced, _lce_rows
    from effpass.testing import model_case

    torch.manual_seed(0)
    # ragged in every dimension of the interpreter's tiles (16 rows x 32 vocabulary x 32 hidden; tails 5, 13, 8) and
    # more than one tile in each: 2 row tiles, 3 vocabulary tiles (3 log-sum-exp splits), 2 hidden tiles
    N, H, V = 21, 40, 77

    def unfused(x, w, b, t, eps, pre, cap, red):
        z = F.linear(x, w, b).float() * pre
        if cap:
            z = torch.tanh(z / cap) * cap
        return F.cross_entropy(z, t, label_smoothing=eps, reduction=red)

    def fused(x, w, b, t, eps, pre, cap, red):
        ppre, post, sc = (pre / cap, cap, True) if cap else (pre, 1.0, False)
        if red == "none":
            return _lce_rows(x, w, None, None, b, t, -100, eps, ppre, sc, post, 0, "", False, "triton")[0]
        mask = [True, False, True, False, b is not None]
        return _lce_reduced(x, w, None, None, b, t, -100, eps, ppre, sc, post, red == "mean", 0, "", mask,
                            "triton")[0]

    def grads(fn, x, w, b, t, gout, **kw):
        out = fn(x, w, b, t, **kw)
        return [out] + list(torch.autograd.grad(out, [x, w] + ([b] if b is not None else []), gout))

    def rel(a, c):
        return (a.float() - c.float()).abs().max().item() / (c.float().abs().max().item() + 1e-30)

    # fp32: every option of the head (bias, scale, soft-cap, smoothing, ignored rows), every reduction
    for b_on, cap, eps, red in [(False, None, 0.0, "mean"), (True, 30.0, 0.1, "mean"), (True, None, 0.1, "sum"),
                                (False, 30.0, 0.0, "none"), (True, 30.0, 0.1, "none")]:
        x = torch.randn(N, H, requires_grad=True)
        w = (torch.randn(V, H) * 0.3).requires_grad_()
        b = torch.randn(V).requires_grad_() if b_on else None
        t = torch.randint(0, V, (N,))
        t[::5] = -100
        gout = torch.randn(N) if red == "none" else torch.tensor(1.7)
        ref = grads(unfused, x, w, b, t, gout, eps=eps, pre=0.7, cap=cap, red=red)
        got = grads(fused, x, w, b, t, gout, eps=eps, pre=0.7, cap=cap, red=red)
        errs = [rel(g, r) for g, r in zip(got, ref)]
        assert max(errs) < 1e-5, (b_on, cap, eps, red, errs)
        if red == "none":
            assert torch.all(got[0][t == -100] == 0)

    # a LoRA head: the adapter's rows (A x s) and B as the second projection, every gradient
    x = torch.randn(N, H, requires_grad=True)
    w = (torch.randn(V, H) * 0.3).requires_grad_()
    x2 = torch.randn(N, 8, requires_grad=True)
    w2 = (torch.randn(V, 8) * 0.3).requires_grad_()
    t = torch.randint(0, V, (N,))
    t[::4] = -100
    ref = F.cross_entropy((x @ w.t() + x2 @ w2.t()) * 0.5, t)
    mode = CostMode()
    mode.recording = True
    with mode:
        got = _lce_reduced(x, w, x2, w2, None, t, -100, 0.0, 0.5, False, 1.0, True, 0, "",
                           [True, True, True, True, False], "triton")[0]
    assert {"effpass.lce_lse.default", "effpass.lce_dlogits.default"} <= {r.op for r in mode.records}
    assert rel(got, ref) < 1e-5
    for a, c in zip(torch.autograd.grad(got, [x, w, x2, w2]), torch.autograd.grad(ref, [x, w, x2, w2])):
        assert rel(a, c) < 1e-5, rel(a, c)

    # a frozen head (LoRA elsewhere): only the hidden states' gradient, per row (the log-prob sites' form)
    x = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H) * 0.3
    t = torch.randint(0, V, (N,))
    gout = torch.randn(N)
    ref = unfused(x, w, None, t, 0.0, 1.0, None, "none")
    got = fused(x, w, None, t, eps=0.0, pre=1.0, cap=None, red="none")
    assert rel(got, ref) < 1e-5
    assert rel(torch.autograd.grad(got, x, gout)[0], torch.autograd.grad(ref, x, gout)[0]) < 1e-5

    # low precision (fp32 accumulation in the tiles): within the unfused step's own error against fp32. fp16 here:
    # Triton's interpreter reads bf16 tensors wrongly (numpy has no bf16); bf16 is the same code (GPU test below)
    x32, w32 = torch.randn(N, H), torch.randn(V, H) * 0.3
    t = torch.randint(0, V, (N,))
    gout = torch.tensor(1.0)
    exact = grads(unfused, x32.clone().requires_grad_(), w32.clone().requires_grad_(), None, t, gout, eps=0.0,
                  pre=1.0, cap=None, red="mean")
    def bf(fn):
        return grads(fn, x32.half().requires_grad_(), w32.half().requires_grad_(), None, t, gout, eps=0.0,
                     pre=1.0, cap=None, red="mean")
    ub, fb = bf(unfused), bf(fused)
    for u, f, e in zip(ub, fb, exact):
        assert f.dtype == u.dtype
        assert rel(f, e) <= 2 * rel(u, e) + 1e-3, (rel(f, e), rel(u, e))
    print("OK ops")

    # the pass end to end on a real model: kernel="triton" (what "effpass" picks on a CUDA device)
    case = model_case("llama", layers=1)
    ref_model = case.fresh_model() if hasattr(case, "fresh_model") else None
    import copy
    eager = copy.deepcopy(case.model).train()
    work = copy.deepcopy(case.model).train()
    compiled = effpass.compile(work, passes=[FuseCrossEntropy(kernel="triton")], lowering="eager")
    mode = CostMode()
    mode.recording = True
    with mode:
        out = compiled(**case.inputs)
        out.loss.backward()
    ops = {r.op for r in mode.records}
    assert "effpass.lce_lse.default" in ops and "effpass.lce_dlogits.default" in ops, sorted(ops)
    assert not any(r.sync for r in mode.records), [r.op for r in mode.records if r.sync]
    assert "effpass.linear_cross_entropy.default" not in ops   # the mean is a sum of the per-row op in the graph
    stats = effpass.report(work).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["triton_tiles"] == 1, stats
    ref = eager(**case.inputs)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * abs(ref.loss.item())
    for (n, p), q in zip(work.named_parameters(), eager.parameters()):
        assert rel(p.grad, q.grad) < 1e-5, (n, rel(p.grad, q.grad))
    assert out.logits is None
    print("OK pass")
""")


def test_triton_tiles_equal_the_unfused_loss_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK ops" in out.stdout and "OK pass" in out.stdout


def test_triton_kernel_where_it_cannot_run_is_an_error_naming_why():
    """On a CPU without Triton's interpreter ``kernel="triton"`` cannot run: the compile says so (effpass, the
    value, why, the valid ones), before any step runs; ``"effpass"`` there takes the chunked kernel."""
    import effpass
    from effpass.passes import FuseCrossEntropy
    from effpass.testing import model_case

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on in this process")
    case = model_case("llama", layers=1)
    compiled = effpass.compile(case.model.train(), passes=[FuseCrossEntropy(kernel="triton")], lowering="eager",
                               strict=True)
    with pytest.raises(Exception) as err:
        compiled(**case.inputs)
    text = str(err.value) + "".join(str(a) for a in getattr(err.value, "args", ()))
    assert "kernel='triton'" in text and "TRITON_INTERPRET=1" in text and "'chunked'" in text


# ------------------------------------------------------------------------------------------------------
# the GPU path by the cost model (fake tensors): FLOPs, bytes, syncs, kernels of the fused head
# ------------------------------------------------------------------------------------------------------
HIDDEN, VOCAB, SEQ = 256, 32000, 2048


def _head_cost(tmp_path, kernel):
    import json

    from effpass.cost import config_step_cost
    from effpass.passes import FuseCrossEntropy

    cfg = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": SEQ,
           "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    passes = [] if kernel is None else [FuseCrossEntropy(kernel=kernel)]
    return config_step_cost(str(path), 1, SEQ, dtype="bfloat16", passes=passes, device="h100", tensors="fake",
                            per_pass=False)


def test_gpu_head_by_the_cost_model_within_its_bounds(tmp_path):
    """At a small bf16 shape (hidden 256, vocabulary 32,000, 2,048 tokens, fake tensors) the GPU path of the fused
    head: FLOPs 4 GEMM-equivalents (3 + the logits once more), zero host synchronisations, one lse kernel and per
    vocabulary slab one tile kernel and two GEMMs (the kernel count set by the slabs, not the rows), and its bytes
    equal a hand count of the design, fewer than the unfused head's (the chunked kernel's: docs/cost_model.md)."""
    from effpass.passes.fuse_cross_entropy.triton_tiles import slab_entries

    tiles, plain = (_head_cost(tmp_path, k) for k in ("effpass", None))
    n = SEQ   # the rows of the loss (Hugging Face's shifted labels keep every position, the last one ignored)
    gemm = 2 * n * HIDDEN * VOCAB
    inside = {k: v for k, v in tiles.ops.items() if k.startswith("effpass::linear_cross_entropy_rows")}
    flops = sum(r.work_flops for r in tiles.records if r.inside.startswith("effpass::linear_cross_entropy_rows"))
    assert flops == 4 * gemm
    assert tiles.head["host_syncs"] == 0 and tiles.totals["host_syncs"] == 0
    step = slab_entries(n, VOCAB, 2)
    slabs = -(-VOCAB // step)
    calls = {k.split(" > ")[1]: v["calls"] for k, v in inside.items()}
    assert calls["effpass.lce_lse"] == 1 and calls["effpass.lce_dlogits"] == slabs
    assert calls["aten.addmm"] == slabs and calls["aten.mm"] == slabs   # the rows' and the weight's gradient
    kernels = sum(v["kernels"] for v in inside.values())
    assert kernels <= 3 * slabs + 26   # + the bookkeeping of both ops (targets, mask, bounds check, casts): constant
    # bytes by hand: lse reads x, W and the targets and writes 3 floats per row; per slab the tile kernel reads x,
    # W's slab, the targets, log-sum-exps and row factors and writes the slab's logit gradients (bf16), the rows'
    # GEMM reads those and the slab and reads and writes the fp32 rows' gradient, the weight's GEMM reads them and
    # x and writes the weight gradient's slab
    x, w, d32, dlogits = n * HIDDEN * 2, VOCAB * HIDDEN * 2, n * HIDDEN * 4, n * VOCAB * 2
    hand = (x + w + 8 * n + 12 * n) + slabs * (x + 16 * n) + slabs * 2 * d32 + slabs * x + 3 * w + 3 * dlogits
    lse_and_gemms = sum(v["bytes"] for k, v in inside.items()
                        if k.split(" > ")[1] in ("effpass.lce_lse", "effpass.lce_dlogits", "aten.addmm", "aten.mm"))
    assert hand <= lse_and_gemms <= hand * 1.02
    assert tiles.head["bytes"] < plain.head["bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_tiles_on_gpu(dtype):
    """On a GPU the default kernel takes the Triton tiles: loss and gradients within the unfused step's own rounding
    (bf16) or 1e-5 (fp32) of the unfused loss, a 32k vocabulary, ignored rows, soft-capping."""
    import torch.nn.functional as F

    from effpass.passes.fuse_cross_entropy.kernels import _lce_reduced

    torch.manual_seed(0)
    n, h, v = 1000, 512, 32000
    x32, w32 = torch.randn(n, h, device="cuda"), torch.randn(v, h, device="cuda") * 0.05
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100

    def run(fn, dt):
        x, w = x32.to(dt).requires_grad_(), w32.to(dt).requires_grad_()
        out = fn(x, w)
        return [out.float()] + [g.float() for g in torch.autograd.grad(out, [x, w])]

    def unfused(x, w):
        return F.cross_entropy(torch.tanh((x @ w.t()).float() / 30.0) * 30.0, t)

    def fused(x, w):
        return _lce_reduced(x, w, None, None, None, t, -100, 0.0, 1 / 30.0, True, 30.0, True, 0, "",
                            [True, False, True, False, False], "effpass")[0]

    exact = run(unfused, torch.float64)
    ref, got = run(unfused, dtype), run(fused, dtype)
    for g, r, e in zip(got, ref, exact):
        err = ((g - e).abs().max() / e.abs().max()).item()
        bound = 2 * ((r - e).abs().max() / e.abs().max()).item() + (1e-5 if dtype == torch.float32 else 1e-3)
        assert err <= bound, (err, bound)


@pytest.mark.inductor
def test_cuda_replay_lowers_the_tile_ops_with_inductor():
    """The planner's replay for a CUDA target runs the tiles' path, and Inductor lowers the fused ops as fallback
    kernels (an op argument named ``kernel`` collided with ``FallbackKernel.create`` and the replay fell back to
    eager); ``strict=True`` makes any fallback an error."""
    from effpass.passes import FuseCrossEntropy
    from effpass.planning import estimate_memory
    from effpass.testing import model_case

    case = model_case("llama", layers=1)
    est = estimate_memory(case.model.train(), case.inputs, passes=[FuseCrossEntropy()], device="cuda",
                          lowering="inductor", strict=True)
    assert est.peak_bytes > 0 and est.reserved_peak_bytes >= est.peak_bytes
