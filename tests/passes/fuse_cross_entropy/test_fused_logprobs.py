"""fuse_cross_entropy on chosen-token log-probabilities (issue 27): ``log_softmax(z).gather(-1, t)`` and
``gather(z, -1, t) - logsumexp(z, -1)`` after the output projection become the chunked rows op, for the
policy (with gradient) and a frozen reference under ``torch.no_grad`` in the same graph (a DPO step written
in plain PyTorch), on a plain, a tied soft-capped (Gemma 2), a LoRA and an int8-quantized head.

Oracles: numerical (loss and every gradient equal eager within 1e-5 relative, fp32) and structural (stats:
log-prob sites, dropped logits; no log_softmax/logsumexp left in the graph).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import effpass
from effpass.passes import FuseCrossEntropy

V = 256


def _hf(name, vocab=V):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "gemma2":  # tied head, final-logit soft-capping 30.0
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, pad_token_id=0, **common))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common))
    raise ValueError(name)


class DPO(torch.nn.Module):
    """A DPO loss over (chosen, rejected) rows: sums of chosen-token log-probs of the policy and of a frozen
    reference (no gradient), in plain PyTorch."""

    def __init__(self, policy, ref, form="log_softmax", beta=0.1):
        super().__init__()
        self.policy, self.ref, self.form, self.beta = policy, ref, form, beta

    def logps(self, model, ids, labels):
        logits = model(input_ids=ids).logits[:, :-1]
        t = labels[:, 1:]
        mask = t != -100
        idx = t.clamp(min=0).unsqueeze(-1)
        if self.form == "log_softmax":
            lp = logits.float().log_softmax(-1).gather(-1, idx).squeeze(-1)
        else:
            lp = torch.gather(logits, -1, idx).squeeze(-1) - torch.logsumexp(logits, -1)
        return (lp * mask).sum(-1), lp

    def forward(self, ids, labels):
        pol, _ = self.logps(self.policy, ids, labels)
        with torch.no_grad():
            ref, _ = self.logps(self.ref, ids, labels)
        pc, pr = pol.chunk(2)
        rc, rr = ref.chunk(2)
        return -F.logsigmoid(self.beta * ((pc - rc) - (pr - rr))).mean()


def _batch(seed=1, pairs=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (2 * pairs, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # prompt tokens
    return ids, labels


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(arm, family="llama", form="log_softmax"):
    policy = _hf(family).train()
    extra = []
    if arm == "lora":
        from effpass.passes import InjectLoRA
        extra = [InjectLoRA(rank=4, init="gaussian", targets=["policy.lm_head", "policy.*.q_proj"])]
    if arm == "lora_body":  # LoRA on the attention only: the head is frozen
        from effpass.passes import InjectLoRA
        extra = [InjectLoRA(rank=4, init="gaussian", targets=["policy.*.q_proj", "policy.*.v_proj"])]
    if arm == "int8":
        from effpass.passes import QuantizeLinear
        extra = [QuantizeLinear(scheme="int8", targets=["*.lm_head"])]
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    model = DPO(policy, ref, form)
    ids, labels = _batch()
    compiled_model = copy.deepcopy(model)
    compiled = effpass.compile(compiled_model, passes=extra + [FuseCrossEntropy()], lowering="eager")
    # the eager reference: the same prepared model (LoRA injected / weights quantized), unfused
    eager = copy.deepcopy(compiled_model)
    loss = compiled(ids, labels)
    loss.backward()
    want = eager(ids, labels)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5, (float(loss), float(want))
    n = 0
    ref_grads = dict(eager.named_parameters())
    for name, p in compiled_model.named_parameters():
        q = ref_grads[name]
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert _rel(p.grad, q.grad) <= 1e-5, name
        n += 1
    assert n > 0
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    stats = recs[-1].stats
    ops = recs[-1].ops_after
    return stats, ops, recs


@pytest.mark.parametrize("family,arm,form", [("llama", "plain", "log_softmax"), ("gemma2", "plain", "log_softmax"),
                                             ("qwen3", "plain", "logsumexp"), ("llama", "lora", "log_softmax"),
                                             ("llama", "int8", "logsumexp"), ("gemma2", "lora_body", "log_softmax")])
@pytest.mark.sweep
def test_dpo_logprobs_fused_policy_and_reference(family, arm, form):
    stats, ops, recs = _run(arm, family, form)
    # two sites: the policy's (with gradient) and the frozen reference's (no_grad), both fused
    assert stats["logprob_sites"] == 2, (stats, [s for r in recs for s in r.skipped])
    assert not any(k.endswith("log_softmax") or k.endswith("logsumexp") for k in ops), ops
    assert ops.get("effpass.linear_cross_entropy_rows", 0) == 2, ops
    assert stats["lora_heads"] == (1 if arm == "lora" else 0)
    assert stats["dequantized_heads"] == (2 if arm == "int8" else 0)
    assert stats["logits_bytes_avoided"] == 2 * 4 * 11 * V * 4
    # a frozen head (quantized, or LoRA on other layers): the policy's input gradient is computed in the forward
    # (no logits recomputed in the backward); the reference needs no gradient at all
    assert stats["input_grad_in_forward"] == (1 if arm in ("int8", "lora_body") else 0), stats


def test_full_log_probs_used_elsewhere_fuse_as_a_row_function():
    """An entropy next to the chosen-token log-prob reads the whole log_softmax: the log-prob rewrite cannot
    take it alone, the row-wise rewrite takes both (one effpass::linear_rowwise, no log_softmax left), with
    the eager loss and gradients."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = _hf("llama").train()

        def forward(self, ids):
            ls = self.m(input_ids=ids).logits.log_softmax(-1)
            lp = ls.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            return lp.mean() + (ls.exp() * ls).sum(-1).mean()

    m = M()
    ref = copy.deepcopy(m)
    ids, _ = _batch()
    compiled = effpass.compile(m, passes=[FuseCrossEntropy()], lowering="eager")
    loss = compiled(ids)
    loss.backward()
    want = ref(ids)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    for p, q in zip(m.parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-5
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    st = recs[-1].stats
    assert st["logprob_sites"] == 0 and st["rowwise_sites"] == 1 and st["skipped"] == 0, st
    assert not any(k.endswith("log_softmax") for k in recs[-1].ops_after)


def test_per_row_op_plans_cache_sized_tiles_on_cpu():
    """The per-row op (log-prob sites, reduction="none") on CPU: a 2 MiB tile of at most 256 rows by default (its
    backward recomputes every tile whatever the plan, so cutting the vocabulary adds no matmul); elsewhere the
    cross-entropy default (full row blocks); an explicit budget is the user's."""
    from effpass.passes.fuse_cross_entropy.kernels import (CPU_ROWS_TILE_BYTES, default_chunk_bytes, default_rows_chunk_bytes,
                                                 num_chunks, plan_chunks, plan_row_tiles)
    llama3 = 128256
    assert default_rows_chunk_bytes(510, llama3, 510 * 64 * 4, "cpu") == CPU_ROWS_TILE_BYTES == 2 << 20
    assert plan_row_tiles(510, llama3, CPU_ROWS_TILE_BYTES) == (256, 2048)
    assert num_chunks(510, llama3, CPU_ROWS_TILE_BYTES, per_row=True) == 2 * 63
    assert plan_chunks(510, llama3, CPU_ROWS_TILE_BYTES) == (510, 1028)  # the summed op's tiles: unchanged
    assert default_rows_chunk_bytes(510, llama3, 510 * 64 * 4, "cuda") == default_chunk_bytes(510, llama3, 510 * 64 * 4)
    assert plan_row_tiles(2048, llama3, default_chunk_bytes(2048, llama3, 2048 * 256 * 4)) == (256, llama3)


@pytest.mark.parametrize("budget", [64 * 4 * 3, 10 ** 9])  # tiles (online softmax) and full rows
def test_frozen_head_input_gradient_in_the_forward(budget):
    """A frozen head (only the hidden states need a gradient): the per-row op computes d loss / d x in its forward
    pass (``x_grad``, online softmax over the tiles) and the backward only scales it: the per-row losses and the
    input gradient equal F.cross_entropy's within 1e-5 (scaling, soft-capping, a frozen bias, ignored rows); asking
    for the weight's gradient from that form raises."""
    torch.manual_seed(0)
    n, h, vocab = 37, 16, 50
    x = torch.randn(n, h, requires_grad=True)
    w, b = torch.randn(vocab, h), torch.randn(vocab)
    t = torch.randint(0, vocab, (n,))
    t[::5] = -100
    g = torch.randn(n)
    op = torch.ops.effpass.linear_cross_entropy_rows.default
    for pre, cap, post in ((1.0, False, 1.0), (0.7, False, 1.0), (1.5 / 3.0, True, 3.0)):
        z = F.linear(x, w, b) * (pre * post if not cap else 1.0)
        if cap:
            z = torch.tanh(F.linear(x, w, b) * pre) * post
        want = F.cross_entropy(z, t, reduction="none")
        (gw,) = torch.autograd.grad((want * g).sum(), [x])
        loss, _, gx = op(x, w, None, None, b, t, -100, 0.0, pre, cap, post, budget, "", True)
        assert gx.shape == x.shape and _rel(loss.detach(), want.detach()) <= 1e-5
        (gg,) = torch.autograd.grad((loss * g).sum(), [x])
        assert _rel(gg, gw) <= 1e-5, (pre, cap, _rel(gg, gw))
        assert not gg[::5].abs().any()  # ignored rows: no gradient
    with pytest.raises(RuntimeError, match="only x may need a gradient"):
        op(x, w.requires_grad_(), None, None, None, t, -100, 0.0, 1.0, False, 1.0, budget, "", True)


@effpass.register_pass("measure_vocab_values", run_after=("fuse_cross_entropy",))
def measure_vocab_values(gm, ctx):
    """Test pass: the largest value computed in the graph (not an input) whose last dim is the vocabulary."""
    largest = 0
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if n.op in ("call_function", "call_method") and isinstance(v, torch.Tensor) and v.dim() >= 1 \
                and v.shape[-1] == V:
            largest = max(largest, v.numel())
    return effpass.PassResult(stats={"largest_vocab_value": largest})


class RefLogps(torch.nn.Module):
    """The frozen reference's per-token log-probs (what DPO/GRPO compute for it), compiled on its own."""

    def __init__(self, ref):
        super().__init__()
        self.ref = ref

    def forward(self, ids, labels):
        logits = self.ref(input_ids=ids, use_cache=False).logits[:, :-1]
        t = labels[:, 1:]
        return logits.float().log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_frozen_reference_forward_alone_is_chunked(family):
    """A frozen reference compiled with effpass and called under torch.no_grad (issue 27, item 2): its log-probs
    equal eager's within 1e-5 and its graph computes no vocabulary-sized value (only the head's weight, an input,
    has the vocabulary as a dim): the per-row op computes them tile by tile."""
    ref = _hf(family).eval().requires_grad_(False)
    ids, labels = _batch()
    want = RefLogps(ref)(ids, labels)
    compiled = effpass.compile(RefLogps(copy.deepcopy(ref)).eval(), passes=[FuseCrossEntropy(), measure_vocab_values],
                               lowering="eager", strict=True)
    with torch.no_grad():
        got = compiled(ids, labels)
    assert got.shape == want.shape and _rel(got, want) <= 1e-5
    rep = effpass.report(compiled)
    st = rep.stats("fuse_cross_entropy")
    assert st["logprob_sites"] == 1 and st["input_grad_in_forward"] == 0, st
    assert rep.stats("measure_vocab_values")["largest_vocab_value"] == 0
    # without the pass the graph holds the logits (the oracle can fail)
    plain = effpass.compile(RefLogps(copy.deepcopy(ref)).eval(), passes=[measure_vocab_values], lowering="eager")
    with torch.no_grad():
        plain(ids, labels)
    assert effpass.report(plain).stats("measure_vocab_values")["largest_vocab_value"] >= ids.shape[0] * 11 * V


def test_planner_counts_fused_and_unfused_logprob_memory():
    """The memory planner's replay (estimate_memory) of a DPO step, fused and unfused: the prediction drops by
    more than the logits it no longer holds (policy and reference: 2 x rows x V x 4 bytes), and the fused step's
    prediction is within the op's tile workspace of the measured peak. The op's internal tiles are not visible to
    the replay (a custom op allocates its outputs only), so the measured peak may exceed the prediction by up to
    three 2 MiB tiles. The unfused step's prediction is within the planner's 1% of its measured peak."""
    from effpass.passes.fuse_cross_entropy.kernels import CPU_ROWS_TILE_BYTES
    from effpass.planning.estimate import estimate_memory
    from effpass.testing.memory import peak_memory

    vocab = 4096  # the logits (4 MiB per head) outweigh the model's activations
    policy = _hf("llama", vocab).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    ids, labels = _batch(pairs=4, seq=33)
    logits = ids.shape[0] * 32 * vocab * 4
    est = {}
    for name, passes in (("fused", [FuseCrossEntropy()]), ("unfused", [])):
        est[name] = estimate_memory(DPO(copy.deepcopy(policy), copy.deepcopy(ref)), (ids, labels), passes=passes,
                                    optimizer=None, lowering="eager")
    assert est["fused"].pass_stats["fuse_cross_entropy"]["logprob_sites"] == 2
    assert est["unfused"].step_peak_bytes - est["fused"].step_peak_bytes >= 2 * logits, est
    measured = {}
    for name, passes in (("fused", [FuseCrossEntropy()]), ("unfused", [])):
        compiled = effpass.compile(DPO(copy.deepcopy(policy), copy.deepcopy(ref)), passes=passes, lowering="eager")

        def step():
            compiled(ids, labels).backward()
            compiled.zero_grad(set_to_none=True)

        step()
        _, measured[name] = peak_memory(step)
    pred = est["fused"].step_peak_bytes
    assert pred <= measured["fused"] + 64 * 1024 and measured["fused"] - pred <= 3 * CPU_ROWS_TILE_BYTES, (
        pred, measured)
    # unfused: within the planner's 1% (exact here); log_softmax of the sliced logits copies them inside its kernel
    # (a contiguous copy the fake kernel does not make): the replay missed one head's logits before it counted it
    pred = est["unfused"].step_peak_bytes
    assert abs(pred - measured["unfused"]) <= 0.01 * measured["unfused"], (pred, measured, logits)


class ORPO(torch.nn.Module):
    """ORPO (Hong et al. 2024) as TRL's ``ORPOTrainer.concatenated_forward`` + ``odds_ratio_loss`` compute it, written
    as one module: the chosen half's cross-entropy (the SFT term), average chosen-token log-probs per sequence and
    the log-odds ratio ``(lc - lr) - (log1p(-exp(lc)) - log1p(-exp(lr)))``. Its metrics on the full logits (their
    means) are left out."""

    def __init__(self, policy, beta=0.1):
        super().__init__()
        self.policy, self.beta = policy, beta

    def forward(self, ids, labels):
        logits = self.policy(input_ids=ids).logits
        n = ids.shape[0] // 2
        z = logits[:, :-1]
        t = labels[:, 1:]
        nll = F.cross_entropy(z[:n].reshape(-1, z.shape[-1]), t[:n].reshape(-1), ignore_index=-100)
        mask = t != -100
        lp = z.float().log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        avg = (lp * mask).sum(-1) / mask.sum(-1)
        lc, lr = avg[:n], avg[n:]
        log_odds = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
        return nll - self.beta * F.logsigmoid(log_odds).mean()


def test_orpo_written_as_a_module_is_fused():
    """ORPO's loss in one module (model, chosen-half cross-entropy, average log-probs, log-odds): the cross-entropy
    becomes the reduced op and the log-probs the per-row op (both read the same head: the head is computed twice in
    chunks, the logits never), the odds-ratio term stays ordinary graph code on the per-sequence values; loss and
    every gradient within 1e-5 of eager."""
    policy = _hf("llama").train()
    model = ORPO(policy)
    eager = copy.deepcopy(model)
    compiled = effpass.compile(model, passes=[FuseCrossEntropy()], lowering="eager", strict=True)
    ids, labels = _batch()
    loss = compiled(ids, labels)
    loss.backward()
    want = eager(ids, labels)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5, (float(loss), float(want))
    ref = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and _rel(p.grad, ref[name].grad) <= 1e-5, name
    rec = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"][-1]
    st, ops = rec.stats, rec.ops_after
    assert st["fused"] == 1 and st["logprob_sites"] == 1 and st["skipped"] == 0, (st, rec.skipped)
    assert ops.get("effpass.linear_cross_entropy", 0) == 1 and ops.get("effpass.linear_cross_entropy_rows", 0) == 1
    assert not any(k.endswith("log_softmax") or k.endswith("logsumexp") for k in ops), ops
    # no full head left: the one layer's 7 projections (q, k, v, o, gate, up, down) are the graph's only linears
    assert st["logits_returned"] == 0 and sum(v for k, v in ops.items() if k.endswith("linear")) == 7, ops
