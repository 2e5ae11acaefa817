"""fuse_cross_entropy on row-wise functions of the heads' distributions (issue 27): entropy, KL and JSD between
a student's and a frozen teacher's heads (distillation), z-loss, and a log-prob whose full log-softmax is also
read (an entropy bonus), become ``effpass::linear_rowwise`` on row blocks.

Oracles: numerical (loss and every gradient equal the unfused eager graph's within 1e-5 relative, fp32) and
structural (the pass's statistics; no log_softmax / softmax / logsumexp left in the graph; the logits' bytes
avoided). Families: a plain head (Llama), a tied head (Qwen3 with tie_word_embeddings), a tied soft-capped head
(Gemma 2, final_logit_softcapping), a LoRA head (inject_lora) and an int8-quantized head (quantize_linear).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import effpass
from effpass.passes import FuseCrossEntropy

V = 256


def _hf(name):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "gemma2":  # tied head, final-logit soft-capping 30.0
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, pad_token_id=0, final_logit_softcapping=3.0,
                                                    **common))
    if name == "qwen3_tied":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common))
    raise ValueError(name)


def _kl(lt, ls):
    return (lt.exp() * (lt - ls)).sum(-1)


class Loss(torch.nn.Module):
    """One distribution loss of a student (trained) and a frozen teacher, in plain PyTorch."""

    def __init__(self, student, teacher, kind, temperature=2.0):
        super().__init__()
        self.student, self.teacher, self.kind, self.tau = student, teacher, kind, temperature

    def forward(self, ids, mask):
        zs = self.student(input_ids=ids).logits
        if self.kind in ("kl", "kl_div", "jsd"):
            with torch.no_grad():
                zt = self.teacher(input_ids=ids).logits
        if self.kind == "kl":  # forward KL at a temperature, masked mean over tokens
            ls = (zs.float() / self.tau).log_softmax(-1)
            lt = (zt.float() / self.tau).log_softmax(-1)
            return (_kl(lt, ls) * mask).sum() / mask.sum() * self.tau ** 2
        if self.kind == "kl_div":  # torch's KL, reduced over everything
            return F.kl_div(zs.float().log_softmax(-1), zt.float().log_softmax(-1), reduction="batchmean",
                            log_target=True)
        if self.kind == "jsd":  # Jensen-Shannon (beta 0.5), as Liger's / TRL's GKD write it
            ls, lt = zs.float().log_softmax(-1), zt.float().log_softmax(-1)
            m = torch.log(0.5 * ls.exp() + 0.5 * lt.exp())
            jsd = 0.5 * F.kl_div(m, ls, reduction="none", log_target=True).sum(-1) \
                + 0.5 * F.kl_div(m, lt, reduction="none", log_target=True).sum(-1)
            return (jsd * mask).sum() / mask.sum()
        if self.kind == "entropy_bonus":  # chosen-token log-prob + entropy of the same log-softmax (GRPO-style)
            ls = zs.float().log_softmax(-1)
            lp = ls.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            ent = -(ls.exp() * ls).sum(-1)
            return -((lp + 0.01 * ent) * mask).sum() / mask.sum()
        if self.kind == "z_loss":  # PaLM's z-loss next to a per-token cross-entropy
            z = zs.float()
            return (torch.logsumexp(z, -1).pow(2) * mask).mean() * 1e-2
        raise ValueError(self.kind)


def _batch(seed=1, rows=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, :3] = 0
    return ids, mask


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _teacher(student):
    t = copy.deepcopy(student).eval().requires_grad_(False)
    with torch.no_grad():
        for p in t.parameters():
            if p.dtype.is_floating_point:
                p.add_(0.05 * torch.randn_like(p))
    return t


def _llama_student_teacher(vocab: int, seq: int, prompt: int):
    """A one-layer Llama student (training mode) at ``vocab``, its perturbed frozen teacher, a batch of 2 x ``seq``
    ids and a mask that drops each row's first ``prompt`` tokens."""
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(128, 2 * seq),
                          bos_token_id=0, eos_token_id=0)
    student = tf.LlamaForCausalLM(conf).train()
    ids = torch.randint(1, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, seq)
    mask[:, :prompt] = 0
    return student, _teacher(student), ids, mask


def _compare(model, extra=()):
    """Compiles a copy with effpass, runs one step on both, checks loss and gradients; returns the pass's
    torch-IR record."""
    ids, mask = _batch()
    compiled_model = copy.deepcopy(model)
    compiled = effpass.compile(compiled_model, passes=list(extra) + [FuseCrossEntropy()], lowering="eager")
    eager = copy.deepcopy(compiled_model)  # the same prepared model (LoRA injected / weights quantized), unfused
    loss = compiled(ids, mask)
    loss.backward()
    want = eager(ids, mask)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5, (float(loss), float(want))
    got, ref = dict(compiled_model.named_parameters()), dict(eager.named_parameters())
    n = 0
    for name, q in ref.items():
        p = got[name]
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and _rel(p.grad, q.grad) <= 1e-5, (name, _rel(p.grad, q.grad))
        n += 1
    assert n > 0
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    return recs[-1]


@pytest.mark.parametrize("family,kind,arm", [
    ("llama", "kl", "int8"), ("gemma2", "kl_div", "plain"), ("qwen3_tied", "jsd", "plain"),
    ("llama", "entropy_bonus", "lora"), ("gemma2", "z_loss", "plain"),
])
def test_distribution_losses_fused(family, kind, arm):
    student = _hf(family).train()
    extra = []
    if arm == "lora":
        from effpass.passes import InjectLoRA
        extra = [InjectLoRA(rank=4, init="gaussian", targets=["student.lm_head", "student.*.q_proj"])]
    if arm == "int8":  # both heads quantized (a QLoRA-style frozen int8 student head and teacher head)
        from effpass.passes import QuantizeLinear
        extra = [QuantizeLinear(scheme="int8", targets=["*.lm_head"])]
    rec = _compare(Loss(student, _teacher(student), kind), extra)
    st, ops = rec.stats, rec.ops_after
    two = kind in ("kl", "kl_div", "jsd")
    assert st["rowwise_sites"] == 1 and st["two_head_sites"] == int(two), (st, rec.skipped)
    # the student needs gradients: the trained form (every gradient computed in the forward)
    assert ops.get("effpass.linear_rowwise_train", 0) == 1 and ops.get("effpass.linear_rowwise", 0) == 0, ops
    assert st["rowwise_grad_in_forward"] == 1, st
    # (Gemma 2's eager attention keeps its own softmax)
    assert not any(k.endswith(("log_softmax", "logsumexp", "kl_div")) for k in ops), ops
    assert ops.get(".softmax", 0) + ops.get("F.softmax", 0) == rec.ops_before.get(".softmax", 0) + \
        rec.ops_before.get("F.softmax", 0), ops
    assert st["logits_bytes_avoided"] == (2 if two else 1) * 2 * 12 * V * 4
    assert st["lora_heads"] == (1 if arm == "lora" else 0)
    assert st["dequantized_heads"] == ((2 if two else 1) if arm == "int8" else 0)
    assert not rec.skipped, rec.skipped


def test_keep_logits_opt_out_and_returned_logits():
    """A graph that also returns the student's logits: they are dropped (None) by default and kept with
    keep_logits=True; the entropy is fused either way."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = _hf("llama").train()

        def forward(self, ids):
            z = self.m(input_ids=ids).logits
            ls = z.float().log_softmax(-1)
            return -(ls.exp() * ls).sum(-1).mean(), z

    ids, _ = _batch()
    for keep in (False, True):
        m = M()
        ref = copy.deepcopy(m)
        c = effpass.compile(m, passes=[FuseCrossEntropy(keep_logits=keep)], lowering="eager")
        loss, logits = c(ids)
        want, want_logits = ref(ids)
        assert _rel(loss.detach(), want.detach()) <= 1e-5
        st = effpass.report(c).stats("fuse_cross_entropy")
        assert st["rowwise_sites"] == 1
        if keep:
            assert logits is not None and torch.allclose(logits, want_logits) and st["logits_returned"] == 1
        else:
            assert logits is None and st["logits_dropped"] == 1


def test_distribution_read_elsewhere_is_left_alone():
    """A softmax also read by something that is not row-wise (a top-k) would be materialised anyway: the site
    is left unchanged with its reason."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = _hf("llama").train()

        def forward(self, ids):
            p = self.m(input_ids=ids).logits.float().softmax(-1)
            return -(p * p.log()).sum(-1).mean() + p.topk(2, -1).values.sum()

    ids, _ = _batch()
    c = effpass.compile(M(), passes=[FuseCrossEntropy()], lowering="eager")
    c(ids).backward()
    recs = [r for r in effpass.report(c).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    assert recs[-1].stats["rowwise_sites"] == 0
    assert any("read by" in s["reason"] and "topk" in s["reason"] for r in recs for s in r.skipped), \
        [s for r in recs for s in r.skipped]


@pytest.mark.parametrize("teacher_graph", ["same", "own"])
def test_distillation_loop(teacher_graph):
    """A plain-PyTorch distillation loop, three SGD steps, the teacher frozen: ``same``: teacher and student in
    one module compiled with effpass (both heads fused into one op: the teacher's logits are never
    materialised either); ``own``: the teacher compiled with effpass on its own (its logits are its output) and
    passed to the compiled student step (the student's head fused, the teacher's logits read row block by row
    block). Losses and weights equal the eager loop's."""

    class Student(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, teacher_logits, mask):
            ls = (self.m(input_ids=ids).logits.float() / 2.0).log_softmax(-1)
            lt = (teacher_logits.float() / 2.0).log_softmax(-1)
            return (_kl(lt, ls) * mask).sum() / mask.sum() * 4.0

    base = _hf("llama").train()
    teacher_model = _teacher(base)
    runs = {}
    for arm in ("eager", "effpass"):
        student, teacher = copy.deepcopy(base), copy.deepcopy(teacher_model)
        if teacher_graph == "same":
            module = Loss(student, teacher, "kl")
            step_fn = effpass.compile(module, lowering="eager") if arm == "effpass" else module
        else:
            module = Student(student)
            step_fn = effpass.compile(module, lowering="eager") if arm == "effpass" else module
            teacher_fwd = effpass.compile(teacher, lowering="eager") if arm == "effpass" else teacher
        opt = torch.optim.SGD(student.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            ids, mask = _batch(seed=10 + step)
            if teacher_graph == "same":
                loss = step_fn(ids, mask)
            else:
                with torch.no_grad():
                    tl = teacher_fwd(input_ids=ids).logits
                loss = step_fn(ids, tl, mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        runs[arm] = (losses, [p.detach().clone() for p in student.parameters()])
        if arm == "effpass":
            st = effpass.report(step_fn).stats("fuse_cross_entropy")
            assert st["rowwise_sites"] == 1 and st["two_head_sites"] == int(teacher_graph == "same"), st
    (le, pe), (lf, pf) = runs["eager"], runs["effpass"]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(le, lf)), (le, lf)
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(pf, pe))


def test_rowwise_op_flops_and_opcheck():
    """The row-wise op's FLOP formulas (registered for the memory planner): forward = the heads' logits;
    backward = the logits again plus one matmul per gradient asked for. torch.library.opcheck passes."""
    from torch.utils.flop_counter import FlopCounterMode

    from effpass.passes.fuse_cross_entropy.kernels import register_row_fn

    def kl(z0, z1):
        ls, lt = z0.log_softmax(-1), z1.log_softmax(-1)
        return ((lt.exp() * (lt - ls)).sum(-1),)

    key = register_row_fn(torch.fx.symbolic_trace(kl))
    g = torch.Generator().manual_seed(0)
    n, h, v = 6, 8, 32
    x, w = torch.randn(n, h, generator=g, requires_grad=True), torch.randn(v, h, generator=g, requires_grad=True)
    y, u = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    args = (x, w, None, None, None, y, u, None, None, None, [], key, [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], 4 * v * 2 * 2,
            "", 1)
    with FlopCounterMode(display=False) as fc:
        out = torch.ops.effpass.linear_rowwise(*args)
    assert fc.get_total_flops() == 2 * (2 * n * h * v)
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    assert fc.get_total_flops() == 2 * (2 * n * h * v) + 2 * (2 * n * h * v)  # recompute both, dx and dw
    # the gradient equals autograd's on the unfused computation
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    kl(x2 @ w2.t(), y @ u.t())[0].sum().backward()
    assert _rel(x.grad, x2.grad) <= 1e-5 and _rel(w.grad, w2.grad) <= 1e-5
    result = torch.library.opcheck(torch.ops.effpass.linear_rowwise.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_rowwise_train_op_gradients_in_forward_and_fallback():
    """``effpass::linear_rowwise_train`` computes every gradient asked for in its forward (FLOPs: the logits once plus
    dx and dw; its backward op none when the incoming gradient is the same on every row, e.g. the rows summed); with
    a different gradient per row the row inputs' gradients are still scaled exactly and the weight's is recomputed
    (the recomputing backward op's FLOPs: logits of both heads + dw). Every gradient equals the unfused graph's
    within 1e-5 (fp32), several row blocks and CPU tiles; opcheck passes."""
    from torch.utils.flop_counter import FlopCounterMode

    from effpass.passes.fuse_cross_entropy.kernels import register_row_fn

    def kl(z0, z1, m):
        ls, lt = z0.log_softmax(-1), z1.log_softmax(-1).detach()
        return ((lt.exp() * (lt - ls)).sum(-1) * m,)

    key = register_row_fn(torch.fx.symbolic_trace(kl))
    g = torch.Generator().manual_seed(0)
    n, h, v = 10, 8, 32
    x0, w0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    y, u = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    m = (torch.arange(n) > 2).float()
    gw = torch.rand(n, generator=g) + 0.5
    mask = [True, True] + [False] * 8
    for per_row in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        args = (x, w, None, None, None, y, u, None, None, None, [m], key, [1.0, 0.0, 1.0], [1.0, 0.0, 1.0],
                4 * v * 2 * 3, "", 1, mask, [True])  # 3-row blocks
        with FlopCounterMode(display=False) as fc:
            out = torch.ops.effpass.linear_rowwise_train(*args)[0]
        assert fc.get_total_flops() == 2 * (2 * n * h * v) + 2 * (2 * n * h * v)  # both heads' logits, dx, dw
        with torch.profiler.profile() as prof:
            (out[:, 0] * (gw if per_row else 0.3)).sum().backward()
        names = {e.name for e in prof.events()}
        assert "effpass::linear_rowwise_train_backward" in names
        # uniform: scaling only; per row: the recomputing backward op runs (for dw only)
        assert ("effpass::linear_rowwise_backward" in names) == per_row, (per_row, names)
        x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = kl(x2 @ w2.t(), y @ u.t(), m)[0]
        (ref * (gw if per_row else 0.3)).sum().backward()
        assert _rel(out[:, 0].detach(), ref.detach()) <= 1e-6
        assert _rel(x.grad, x2.grad) <= 1e-5 and _rel(w.grad, w2.grad) <= 1e-5, per_row
    result = torch.library.opcheck(torch.ops.effpass.linear_rowwise_train.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_planner_counts_the_fused_distillation_step():
    """The memory planner's replay (estimate_memory) of a distillation step (forward KL, student trained, teacher
    frozen): fused, the prediction drops by more than both heads' logits; it counts the gradients the trained
    row-wise op computes in its forward (its outputs) and is within the op's internal workspace (the block
    buffers of both heads' logits and of the logits' gradient, and one tile's autograd temporaries: a custom op's
    internals are not visible to the replay) of the measured peak."""
    from effpass.passes.fuse_cross_entropy.rowwise import CPU_ROW_TILE_BYTES, rowwise_rows
    from effpass.planning.estimate import estimate_memory
    from effpass.testing.memory import peak_memory

    vocab = 4096  # the logits (2 MiB per head) outweigh the model's activations
    student, teacher, ids, mask = _llama_student_teacher(vocab, 64, 5)
    n = ids.numel()
    logits = n * vocab * 4
    est = {}
    for name, passes in (("fused", [FuseCrossEntropy()]), ("unfused", [])):
        est[name] = estimate_memory(Loss(copy.deepcopy(student), copy.deepcopy(teacher), "kl"), (ids, mask),
                                    passes=passes, optimizer=None, lowering="eager")
    st = est["fused"].pass_stats["fuse_cross_entropy"]
    assert st["rowwise_sites"] == 1 and st["rowwise_grad_in_forward"] == 1, st
    assert est["unfused"].step_peak_bytes - est["fused"].step_peak_bytes >= 2 * logits, est
    compiled = effpass.compile(Loss(copy.deepcopy(student), copy.deepcopy(teacher), "kl"), passes=[FuseCrossEntropy()],
                               lowering="eager")

    def step():
        compiled(ids, mask).backward()
        compiled.zero_grad(set_to_none=True)

    step()
    _, measured = peak_memory(step)
    rows = rowwise_rows(n, vocab, 2, st["chunk_bytes"])
    tile = min(rows, CPU_ROW_TILE_BYTES // (4 * vocab * 2))
    workspace = 3 * rows * vocab * 4 + 8 * tile * vocab * 4
    pred = est["fused"].step_peak_bytes
    assert pred <= measured + 64 * 1024 and measured - pred <= workspace, (pred, measured, workspace)


def test_rowwise_train_op_compiled_tile_program(monkeypatch):
    """At a large vocabulary the trained form runs its tiles (the row function and its gradient) as one program
    compiled with Inductor on CPU (structural: the program is cached and not marked failed); gradients equal the
    unfused graph's within 1e-5, the summed values within 1e-5 (the per-row KL values within 1e-4 of the largest:
    fp32 cancellation, reassociated), and EFFPASS_ROWWISE_COMPILE=0 gives the eager tile (no new program)."""
    import effpass.passes.fuse_cross_entropy.rowwise as rw
    from effpass.passes.fuse_cross_entropy.kernels import register_row_fn

    def kl(z0, z1, m):
        ls, lt = (z0 / 2.0).log_softmax(-1), (z1 / 2.0).log_softmax(-1).detach()
        return ((lt.exp() * (lt - ls)).sum(-1) * m,)

    key = register_row_fn(torch.fx.symbolic_trace(kl))
    g = torch.Generator().manual_seed(0)
    n, h, v = 40, 16, 8192  # tiles of 40 x 8192 logits per head: >= COMPILE_MIN_TILE_ELEMS
    x0, w0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    y, u = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    m = (torch.arange(n) > 3).float()
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = kl(x2 @ w2.t(), y @ u.t(), m)[0]
    (ref * 0.7).sum().backward()
    for compiled in (True, False):
        monkeypatch.setenv("EFFPASS_ROWWISE_COMPILE", "1" if compiled else "0")
        before = dict(rw._PROGRAMS)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = torch.ops.effpass.linear_rowwise_train(x, w, None, None, None, y, u, None, None, None, [m], key,
                                                     [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], 4 * v * 2 * n, "", 1,
                                                     [True, True] + [False] * 8, [True])[0]
        (out[:, 0] * 0.7).sum().backward()
        new = {k: p for k, p in rw._PROGRAMS.items() if k not in before}
        if compiled:
            assert len(new) == 1 and all(p is not False for p in new.values()), new
        else:
            assert not new
        assert _rel(out[:, 0].detach(), ref.detach()) <= (1e-4 if compiled else 1e-6)
        assert abs(float(out.sum()) - float(ref.sum())) <= 1e-5 * abs(float(ref.sum()))
        assert _rel(x.grad, x2.grad) <= 1e-5 and _rel(w.grad, w2.grad) <= 1e-5, compiled


def test_compiled_tile_program_compiles_one_tile_shape_whatever_the_row_count(monkeypatch):
    """Row counts that are not a multiple of the tile (200 and 150 rows, 128-row tiles) run the short last tile as
    the full tile ending where it ends, so the tile program compiles once (one graph) for both calls (a compile per
    remainder shape cost minutes per step at a 128K vocabulary: KTO's batches of different lengths); values and
    gradients equal the unfused graph's for every row (the recomputed rows are dropped, not added twice)."""
    import effpass.passes.fuse_cross_entropy.rowwise as rw
    from effpass.passes.fuse_cross_entropy.kernels import register_row_fn
    from torch._dynamo.utils import counters

    monkeypatch.setenv("EFFPASS_ROWWISE_COMPILE", "1")

    def lse(z0, m):  # a different row function from the other tests': its own program
        return ((z0.logsumexp(-1) - z0.mean(-1)) * m,)

    key = register_row_fn(torch.fx.symbolic_trace(lse))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    h, v = 16, 8192
    w0 = torch.randn(v, h, generator=g) * 0.3
    for n in (200, 150):
        assert n % rw._tile_rows(n, v, 1, torch.device("cpu")) != 0  # a short last tile
        x0 = torch.randn(n, h, generator=g)
        m = (torch.arange(n) % 5 > 0).float()
        x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        refs = lse(x2 @ w2.t(), m)
        (refs[0] * 0.7).sum().backward()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = torch.ops.effpass.linear_rowwise_train(x, w, None, None, None, None, None, None, None, None, [m], key,
                                                     [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], 4 * v * n, "", 1,
                                                     [True, True] + [False] * 8, [True])[0]
        (out[:, 0] * 0.7).sum().backward()
        assert _rel(out[:, 0].detach(), refs[0].detach()) <= 1e-5, n
        assert _rel(x.grad, x2.grad) <= 1e-5 and _rel(w.grad, w2.grad) <= 1e-5, n
    assert counters["stats"]["unique_graphs"] - graphs == 1, counters["stats"]


def test_compiled_tile_program_inside_the_compiled_step():
    """Inside effpass's compiled step (the op's kernel runs below autograd and functorch's dispatch keys, gradients
    off) the tile program still compiles and runs (no fallback warning; the program cached, not marked failed), and
    the distillation loss and every gradient equal eager's within 1e-5."""
    import warnings

    import effpass.passes.fuse_cross_entropy.rowwise as rw

    vocab = 8192  # 64-row tiles of 8,192 logits per head: the tile program runs
    student, teacher, ids, mask = _llama_student_teacher(vocab, 256, 7)
    eager = Loss(copy.deepcopy(student), copy.deepcopy(teacher), "kl")
    fused = Loss(copy.deepcopy(student), copy.deepcopy(teacher), "kl")
    before = dict(rw._PROGRAMS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="effpass::linear_rowwise_train")
        got = effpass.compile(fused, passes=[FuseCrossEntropy()], lowering="eager")(ids, mask)
        got.backward()
    new = {k: p for k, p in rw._PROGRAMS.items() if k not in before}
    assert len(new) == 1 and all(p is not False for p in new.values()), new
    want = eager(ids, mask)
    want.backward()
    assert _rel(got.detach(), want.detach()) <= 1e-5
    ref = dict(eager.named_parameters())
    n = 0
    for name, p in fused.named_parameters():
        if p.grad is not None:
            assert _rel(p.grad, ref[name].grad) <= 1e-5, name
            n += 1
    assert n > 0
