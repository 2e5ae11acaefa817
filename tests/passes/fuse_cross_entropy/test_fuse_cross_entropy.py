"""Tests of the fuse_cross_entropy pass: the chunked kernel against F.cross_entropy, six model families
(Llama, Qwen3, Gemma 2 with soft-capping, GPT-2 tied, Cohere with logit scaling, DemoLM), the loss forms
(HF's shift and num_items_in_batch, user code with reduction="none" and label smoothing), composition
with the other passes, negative cases, and the compiled step's peak memory.

Oracles: numerical (loss and every gradient equal the unfused eager model within 1e-5 relative in fp32)
and structural (the pass's stats, the op histogram, the output's logits, ``skipped`` reasons, bytes).
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import effpass
from effpass.passes import FuseCrossEntropy
from effpass.integrations.huggingface import set_hf_loss_type
from effpass.passes.fuse_cross_entropy import default_chunk_bytes, linear_cross_entropy, plan_chunks
from effpass.testing import model_case

V = 256
OP = "effpass.linear_cross_entropy"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest reference magnitude (NaN where both are NaN: 0)."""
    if torch.isnan(b).any() or torch.isnan(a).any():
        return 0.0 if torch.equal(torch.isnan(a), torch.isnan(b)) else float("inf")
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _assert_grads_close(model, ref, tol=1e-5):
    ref_params = dict(ref.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        q = ref_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.abs().any(), name
            continue
        assert p.grad is not None, f"{name}: no gradient"
        err = _rel(p.grad, q.grad)
        assert err <= tol, f"{name}: relative gradient error {err:.2e} > {tol}"
        n += 1
    assert n > 0


def _records(compiled):
    return effpass.report(compiled).records("fuse_cross_entropy")


def _ops_after(compiled) -> dict:
    out: dict = {}
    for r in _records(compiled):
        if r.phase == "torch_ir":
            for k, v in r.ops_after.items():
                out[k] = out.get(k, 0) + v
    return out


def _last_stats(report) -> dict:
    """The statistics of the pass on the most recently compiled graph."""
    return [r for r in report.records("fuse_cross_entropy") if r.phase == "torch_ir"][-1].stats


def _skipped(compiled) -> list[dict]:
    return [s for r in _records(compiled) for s in r.skipped]


def _hf(name: str, **over):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    common.update(over)
    torch.manual_seed(0)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(bos_token_id=0, eos_token_id=0, **common))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, bos_token_id=0, eos_token_id=0, **common))
    if name == "gemma2":  # tied head, final-logit soft-capping 30.0
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                                    **common))
    if name == "cohere":  # logits * logit_scale
        return tf.CohereForCausalLM(tf.CohereConfig(logit_scale=0.5, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                                    **common))
    if name == "gpt2":  # tied head (lm_head.weight is wte.weight); loss_type None (see test_gpt2_loss_type_*)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=1, n_head=4, n_positions=128,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                eos_token_id=0))
    raise ValueError(name)


def _batch(seed=1, batch=2, seq=16, ignored=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :ignored] = -100  # a prompt whose tokens are not trained on
    return ids, labels


# ------------------------------------------------------------------------------------------------------
# the kernel alone
# ------------------------------------------------------------------------------------------------------
def _reference(x, w, t, b, reduction, eps, scale, cap, x2=None, w2=None):
    z = F.linear(x, w, b)
    if x2 is not None:
        z = z + x2 @ w2.t()
    z = z * scale
    if cap:
        z = torch.tanh(z / cap) * cap
    return F.cross_entropy(z.float(), t, reduction=reduction, label_smoothing=eps)


def test_kernel_matches_cross_entropy_in_every_form():
    """Loss and all gradients within 1e-5 relative: reductions, smoothing, soft-cap, bias, LoRA second
    projection, ignored and all-ignored rows, one-pass (full rows) and tiled (online log-sum-exp) chunks."""
    torch.manual_seed(0)
    n, h, vocab = 37, 16, 50
    assert plan_chunks(n, vocab, 64)[1] < vocab and plan_chunks(n, vocab, 10**9) == (n, vocab)
    worst = 0.0
    # every value of every factor, and every pair of reduction x the others (not the full product: time)
    forms = [(r, eps, cap, bias, budget, lora, ign)
             for r, (eps, cap, bias, budget, lora, ign) in itertools.product(["mean", "sum", "none"], [
                 (0.0, None, False, 64, False, "some"), (0.1, 3.0, True, 64, True, "some"),
                 (0.1, None, True, 4 * vocab * 40, False, "all"), (0.0, 3.0, False, 4 * vocab * 40, True, "some"),
                 (0.0, None, False, 64, True, "all")])]
    for reduction, eps, cap, bias, budget, lora, ignored in forms:
        x = torch.randn(n, h, requires_grad=True)
        w = torch.randn(vocab, h, requires_grad=True)
        b = torch.randn(vocab, requires_grad=True) if bias else None
        x2 = torch.randn(n, 4, requires_grad=True) if lora else None
        w2 = torch.randn(vocab, 4, requires_grad=True) if lora else None
        t = torch.randint(0, vocab, (n,))
        t[::3] = -100
        if ignored == "all":
            t[:] = -100
        weights = torch.rand(n)  # per-token weights for reduction="none"
        inputs = [i for i in (x, w, b, x2, w2) if i is not None]

        def run(fn):
            loss = fn()
            total = (loss * weights).sum() if reduction == "none" else loss
            return loss, torch.autograd.grad(total, inputs)

        l0, g0 = run(lambda: _reference(x, w, t, b, reduction, eps, 1.5, cap, x2, w2))
        l1, g1 = run(lambda: linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=eps, scale=1.5,
                                                  softcap=cap, chunk_bytes=budget, x2=x2, weight2=w2))
        errs = [_rel(l1, l0)] + [_rel(a, c) for a, c in zip(g1, g0)]
        assert max(errs) <= 1e-5, (reduction, eps, cap, bias, budget, lora, ignored, errs)
        if ignored == "all" and reduction == "mean":
            assert torch.isnan(l1) and all(not g.abs().any() for g in g1)  # as torch: NaN loss, zero grads
        worst = max(worst, *errs)
    assert worst > 0.0  # the comparison is live: chunked sums differ from the unfused ones in rounding


def test_default_budget_holds_at_least_256_rows_or_a_quarter():
    """The default chunk: the larger of the hidden states and min(256, rows / 4) full rows of logits:
    full-row chunks (one pass) at the benchmark's shape, where the hidden states (2 MiB) held 4 rows."""
    llama3 = 128256
    assert default_chunk_bytes(2048, llama3, 2048 * 256 * 4) == 256 * llama3 * 4
    assert plan_chunks(2048, llama3, default_chunk_bytes(2048, llama3, 2048 * 256 * 4)) == (256, llama3)
    # 8k tokens at hidden 4096 in fp32: the hidden states (128 MiB) hold 261 rows, more than the floor
    big = default_chunk_bytes(8192, llama3, 8192 * 4096 * 4)
    assert big == 8192 * 4096 * 4 and plan_chunks(8192, llama3, big) == (261, llama3)
    # a small batch: a quarter of its rows (still four chunks), one pass
    assert default_chunk_bytes(128, 1000, 40) == 32 * 1000 * 4 and plan_chunks(128, 1000, 32 * 4000) == (32, 1000)


def test_kernel_rejects_out_of_range_targets():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8)
    with pytest.raises(IndexError, match="target 10 is out of bounds for 10 classes"):
        linear_cross_entropy(x, w, torch.tensor([1, 2, 10, -100]))
    with pytest.raises(ValueError, match="reduction 'avg' is not valid"):
        linear_cross_entropy(x, w, torch.tensor([1, 2, 3, 4]), reduction="avg")


# ------------------------------------------------------------------------------------------------------
# real models: five Hugging Face families and DemoLM
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gpt2", "cohere", "demo"])
@pytest.mark.sweep
def test_fuses_the_loss_of_real_models(name):
    ids, labels = _batch()
    if name == "demo":
        model = model_case("demo", layers=1).model
        kwargs = {"tokens": ids, "labels": labels}
    else:
        model = _hf(name)
        kwargs = {"input_ids": ids, "labels": labels}
    model.train()
    ref = copy.deepcopy(model)
    # DemoLM runs effpass's default pipeline (fuse_attention + fuse_cross_entropy on CPU): the pass is in it.
    # Gemma 2 (soft-cap) and Cohere (scale) run a small explicit budget: 2-D tiles over the vocabulary (the
    # default cuts these small batches into four full-row chunks)
    small = name in ("gemma2", "cohere")
    passes = None if name == "demo" else [FuseCrossEntropy(chunk_bytes=4096 if small else 0)]
    compiled = effpass.compile(model, passes=passes, lowering="eager", strict=True)
    out, ref_out = compiled(**kwargs), ref(**kwargs)
    loss, ref_loss = (out[0], ref_out[0]) if name == "demo" else (out.loss, ref_out.loss)
    assert _rel(loss, ref_loss) <= 1e-5
    loss.backward()
    ref_loss.backward()
    _assert_grads_close(model, ref)
    # structural: one site fused, the logits never computed (the output's logits is None)
    logits = out[1] if name == "demo" else out.logits
    assert logits is None
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    # DemoLM drops the last position (logits[:, :-1]); HF pads the shifted labels with -100 instead
    n_rows = ids.shape[0] * (ids.shape[1] - 1) if name == "demo" else ids.numel()
    assert stats["fused"] == 1 and stats["skipped"] == 0 and stats["logits_dropped"] == 1, stats
    assert stats["logits_bytes_avoided"] == n_rows * V * 4
    # default: the larger of the batch's hidden states and min(256, rows / 4) rows of logits (here: 8 rows)
    budget = 4096 if small else max(ids.numel() * 64 * 4, -(-n_rows // 4) * V * 4)
    assert stats["chunk_bytes"] == budget == (4096 if small else default_chunk_bytes(n_rows, V, ids.numel() * 256))
    r, vt = plan_chunks(n_rows, V, budget)
    assert stats["chunks"] == -(-n_rows // r) * -(-V // vt)
    assert stats["chunks"] == (8 if small else 4) and (vt < V) == small
    recs = [r for r in _records(compiled) if r.phase == "torch_ir"]
    assert len(recs) == 1  # one graph: no break between the head and the loss (GPT-2: loss_type below)
    before, after = recs[0].ops_before, recs[0].ops_after
    assert before.get("F.cross_entropy") == 1 and "F.cross_entropy" not in after, after
    assert after.get(OP, 0) == 1 and after.get("F.linear", 0) == before.get("F.linear", 0) - 1  # the head is gone


def test_gpt2_loss_type_graph_break_and_its_fix():
    """GPT2LMHeadModel's loss_type is None (its class name matches no transformers loss kind): the
    loss_function property then calls logger.warning_once, which Dynamo cannot trace, a graph break between
    head and loss: nothing is fused and the reason says why (the string backend sees the model only as
    graphs). set_hf_loss_type sets the type the property falls back to (the same loss function), and
    effpass.compile calls it: head and loss are then in one graph and fused with no user action."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _hf("gpt2")
    model.train()
    assert model.loss_type is None
    ids, labels = _batch()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="effpass", options={"passes": {"fuse_cross_entropy": {}},
                                                                 "lowering": "eager"})
    out = compiled(input_ids=ids, labels=labels)
    assert _rel(out.loss, ref(input_ids=ids, labels=labels).loss) <= 1e-5 and out.logits is not None
    assert effpass.report(model).stats("fuse_cross_entropy")["fused"] == 0
    reasons = [s["reason"] for g in effpass.report(model).graphs for r in g.records
               if r.name == "fuse_cross_entropy" for s in r.skipped]
    assert any("graph input" in r and "loss_type" in r for r in reasons), reasons
    # the fix: same loss function, no warning, one graph
    assert set_hf_loss_type(_hf("gpt2")) == ["GPT2LMHeadModel"]
    assert set_hf_loss_type(_hf("llama")) == []  # a recognised type: left alone
    torch._dynamo.reset()
    model = _hf("gpt2")
    model.train()
    compiled = effpass.compile(model, passes=[FuseCrossEntropy()], lowering="eager")  # calls it
    assert model.loss_type == "ForCausalLM" and model.loss_function is ForCausalLMLoss
    assert set_hf_loss_type(model) == []
    out = compiled(input_ids=ids, labels=labels)
    assert _rel(out.loss, ref(input_ids=ids, labels=labels).loss) <= 1e-5 and out.logits is None
    assert effpass.report(compiled).stats("fuse_cross_entropy")["fused"] == 1


def test_gradient_accumulation_with_num_items_in_batch():
    """HF's reduction="sum" / num_items_in_batch over three micro-batches, one of them all ignored (its
    loss is 0 and its gradients zero, as unfused): the division stays in the graph."""
    model = _hf("llama")
    model.train()
    ref = copy.deepcopy(model)
    compiled = effpass.compile(model, passes=[FuseCrossEntropy()], lowering="eager", strict=True)
    batches = [_batch(seed=1, ignored=5), _batch(seed=2, ignored=9)]
    batches.append((batches[0][0], torch.full_like(batches[0][1], -100)))  # nothing to train on
    num_items = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for _, lab in batches))
    for ids, labels in batches:
        out = compiled(input_ids=ids, labels=labels, num_items_in_batch=num_items)
        ref_out = ref(input_ids=ids, labels=labels, num_items_in_batch=num_items)
        assert _rel(out.loss, ref_out.loss) <= 1e-5 and out.logits is None
        out.loss.backward()
        ref_out.loss.backward()
    _assert_grads_close(model, ref)
    assert out.loss.item() == 0.0  # the all-ignored micro-batch
    after = _ops_after(compiled)
    assert after.get(OP, 0) == 1 and any("truediv" in k or "div" in k for k in after), after


def _demo(**over):
    """effpass's own Llama-style model, one layer (a small graph: the fastest to compile)."""
    from effpass.testing.models import DemoConfig, DemoLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=V, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128)
    cfg.update(over)
    model = DemoLM(DemoConfig(**cfg))
    model.train()
    return model


def test_user_loss_with_per_token_weights_and_label_smoothing():
    """User code: F.cross_entropy(reduction="none", label_smoothing) on shifted returned logits, weighted;
    an accuracy computed from the same logits keeps them (the loss is still fused)."""
    model = _demo()
    ref = copy.deepcopy(model)
    ids, labels = _batch()
    weights = torch.rand(ids.shape[0] * (ids.shape[1] - 1))

    def step(m, with_accuracy):
        logits = m(ids)
        flat = logits[:, :-1].reshape(-1, V)
        per_token = F.cross_entropy(flat.float(), labels[:, 1:].reshape(-1), reduction="none", label_smoothing=0.1)
        loss = (per_token * weights).sum() / weights.sum()
        if with_accuracy:
            return loss, (flat.argmax(-1) == labels[:, 1:].reshape(-1)).float().mean()
        return loss, logits

    compiled_step = torch.compile(step, backend="effpass", options={"passes": {"fuse_cross_entropy": {}},
                                                                   "lowering": "eager", "strict": True})
    loss, logits = compiled_step(model, False)
    ref_loss, _ = step(ref, False)
    assert _rel(loss, ref_loss) <= 1e-5 and logits is None
    loss.backward()
    ref_loss.backward()
    _assert_grads_close(model, ref)
    stats = _last_stats(effpass.backend.last_string_backend().report)
    assert stats["fused"] == 1 and stats["logits_dropped"] == 1
    # an accuracy reads the logits: they are computed, the loss is still chunked
    torch._dynamo.reset()
    loss, acc = compiled_step(model, True)
    ref_loss, ref_acc = step(ref, True)
    assert _rel(loss, ref_loss) <= 1e-5 and acc == ref_acc
    stats = _last_stats(effpass.backend.last_string_backend().report)
    assert stats["fused"] == 1 and stats["logits_dropped"] == 0


def test_keep_logits_returns_them_and_eval_is_unchanged():
    model = _demo()
    ref = copy.deepcopy(model)
    ids, labels = _batch()
    compiled = effpass.compile(model, passes=[FuseCrossEntropy(keep_logits=True)], lowering="eager", strict=True)
    (loss, logits), (ref_loss, ref_logits) = compiled(ids, labels), ref(ids, labels)
    assert _rel(logits, ref_logits) <= 1e-5 and _rel(loss, ref_loss) <= 1e-5
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["logits_returned"] == 1 and stats["logits_dropped"] == 0
    # evaluation: no gradient, nothing changes (same logits, no op)
    model.eval()
    ref.eval()
    with torch.no_grad():
        (loss, logits), (ref_loss, ref_logits) = compiled(ids, labels), ref(ids, labels)
    assert _rel(logits, ref_logits) <= 1e-5 and _rel(loss, ref_loss) <= 1e-5
    eval_records = [r for r in _records(compiled) if r.stats.get("left_alone_no_grad")]
    assert eval_records and all(r.stats["fused"] == 0 for r in eval_records)


def test_skips_class_weights_with_a_reason():
    model = _demo()
    ids, labels = _batch()
    cls_w = torch.rand(V)

    def step(m):
        return F.cross_entropy(m(ids).view(-1, V), labels.view(-1), weight=cls_w)

    compiled = torch.compile(step, backend="effpass", options={"passes": {"fuse_cross_entropy": {}},
                                                              "lowering": "eager"})
    assert _rel(compiled(model), step(model)) <= 1e-5
    # the string backend is shared by every compile with these options in the process: read this graph's record
    rec = [r for r in effpass.backend.last_string_backend().report.records("fuse_cross_entropy")
           if r.phase == "torch_ir"][-1]
    assert rec.stats["fused"] == 0
    reasons = [s["reason"] for s in rec.skipped]
    assert any("class weights" in r for r in reasons), reasons


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.13 has no F.linear_cross_entropy")
def test_torch_kernel_option_calls_torchs_linear_cross_entropy():
    model = _demo()
    compiled = effpass.compile(model, passes=[FuseCrossEntropy(kernel="torch")], lowering="eager", strict=True)
    _train_and_compare(model, compiled, copy.deepcopy(model))
    rec = next(r for r in _records(compiled) if r.phase == "torch_ir")
    assert rec.stats["torch_kernel"] == 1 and rec.ops_after.get("F.linear_cross_entropy") == 1, rec.ops_after


def test_bad_option_names_the_value():
    with pytest.raises(ValueError, match="chunk_bytes must be >= 0.*-1"):
        FuseCrossEntropy(chunk_bytes=-1)
    with pytest.raises(ValueError, match="'cuda_only' is not valid"):
        effpass.make_pass("fuse_cross_entropy", {"kernel": "cuda_only"})


# ------------------------------------------------------------------------------------------------------
# composition with the other passes
# ------------------------------------------------------------------------------------------------------
def _train_and_compare(model, compiled, ref, tol=1e-5):
    ids, labels = _batch()
    (loss, logits), (ref_loss, _) = compiled(ids, labels), ref(ids, labels)
    assert _rel(loss, ref_loss) <= tol and logits is None
    loss.backward()
    ref_loss.backward()
    _assert_grads_close(model, ref, tol)


def test_composes_with_lora_head_and_checkpointing():
    from effpass.passes import CheckpointActivations, InjectLoRA

    model = _demo()
    compiled = effpass.compile(model, passes=[InjectLoRA(rank=4, alpha=8, targets=["lm_head", "*.q_proj"]),
                                              CheckpointActivations(), FuseCrossEntropy()],
                               lowering="eager", strict=True)
    for p in model.parameters():  # non-zero B so the adapter path contributes to the logits
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ref = copy.deepcopy(model)  # reference semantics: the prepared eager model
    _train_and_compare(model, compiled, ref)
    assert model.lm_head.lora_B.weight.grad.abs().sum() > 0 and model.lm_head.lora_A.weight.grad.abs().sum() > 0
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["lora_heads"] == 1 and stats.get("marked_save", 0) == 1, stats


def test_composes_with_quantized_head():
    """quantize_linear's int8 head (an nn.Linear whose weight is a torchao Int8Tensor): the frozen weight is
    dequantised once in the graph and feeds the op; the loss and every gradient equal the prepared eager
    model's (which runs torchao's weight-only linear)."""
    from effpass.passes import QuantizeLinear

    model = _demo()
    compiled = effpass.compile(model, passes=[QuantizeLinear(scheme="int8", targets=["lm_head"]), FuseCrossEntropy()],
                               lowering="eager", strict=True)
    assert type(model.lm_head.weight).__name__ == "Int8WeightTensor"
    _train_and_compare(model, compiled, copy.deepcopy(model))
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["dequantized_heads"] == 1 and stats["logits_dropped"] == 1, stats
    assert _ops_after(compiled).get(OP, 0) == 1


def test_composes_with_autocast_bf16_matmuls_fp32_logsumexp():
    from effpass.passes import ApplyAutocast

    model = _demo()
    ids, labels = _batch()
    ref = copy.deepcopy(model)
    compiled = effpass.compile(model, passes=[ApplyAutocast(dtype="bfloat16"), FuseCrossEntropy()],
                               lowering="eager", strict=True)
    loss, logits = compiled(ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, _ = ref(ids, labels)
    assert loss.dtype == torch.float32 and logits is None
    # bf16 matmuls on both sides (8 mantissa bits): the losses agree to bf16 rounding of the logits
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    assert _rel(model.lm_head.weight.grad, ref.lm_head.weight.grad) <= 5e-2
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["low_precision_matmuls"] == 1, stats  # the op runs its matmuls in bf16


@pytest.mark.inductor
def test_compiled_step_peak_memory_is_about_one_chunk():
    """Inductor-compiled training step of DemoLM with V=16384 and 1024 tokens: the unfused eager step holds
    the logits about three times (logits, softmax, gradient); the fused compiled step's peak stays below a
    quarter of one fp32 logits matrix (what remains: activations, the head's and the embedding's gradients,
    the hidden states' gradient and about three chunks of 1024 x 64 x 4 bytes). DemoLM writes attention by
    hand: fuse_attention turns it into SDPA so no S x S matrix competes with the logits."""
    from effpass.testing.memory import peak_memory
    from effpass.testing.models import DemoConfig, DemoLM

    from effpass.passes import FuseAttention

    vocab, tokens, hidden = 16384, 1024, 64
    torch.manual_seed(0)
    model = DemoLM(DemoConfig(vocab_size=vocab, dim=hidden, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=tokens))
    model.train()
    ids = torch.randint(0, vocab, (1, tokens))
    logits_bytes = (tokens - 1) * vocab * 4
    ref = copy.deepcopy(model)

    def step(m):
        loss = m(ids, labels=ids)[0]
        loss.backward()
        return loss.detach()

    step(ref)
    ref_loss, eager_peak = peak_memory(lambda: step(ref))
    budget = tokens * hidden * 4  # explicit (the default would hold 256 of these 1,023 rows: a quarter)
    compiled = effpass.compile(model, passes=[FuseAttention(), FuseCrossEntropy(chunk_bytes=budget)],
                               lowering="inductor", strict=True)
    step(compiled)
    loss, fused_peak = peak_memory(lambda: step(compiled))
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["chunk_bytes"] == budget and stats["chunks"] > 1
    assert eager_peak >= 2 * logits_bytes, eager_peak  # the unfused step holds logits, softmax and gradient
    print(f"eager peak {eager_peak:,} B, fused compiled peak {fused_peak:,} B, fp32 logits {logits_bytes:,} B")
    assert fused_peak <= logits_bytes // 4, (fused_peak, logits_bytes)
    assert _rel(loss, ref_loss) <= 1e-5


def test_weight_gradient_is_written_once_without_host_syncs():
    """GPU-grade structure of the chunked head (issue 36.2): with several row chunks, the head weight's gradient
    is taken by vocabulary tiles over every row, each tile written once (``mm.out``; never an in-place
    accumulation of a weight tile), the logits computed twice in all (4 matmuls), no host synchronisation
    (``nonzero``, ``item``) inside the op; numerically equal to eager cross-entropy with ignored rows."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from effpass.passes.fuse_cross_entropy.kernels import linear_cross_entropy

    n, h, v = 64, 32, 4096
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w = (torch.randn(v, h, generator=g) / h ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = kwargs.get("out")
            self.calls.append((str(func), tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else (),
                               tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return func(*args, **kwargs)

    from effpass.passes.fuse_cross_entropy import kernels

    with Ops() as ops:  # the op's implementation itself (the chunks), under the recording mode
        loss, gx, gw, *_ = kernels._lce_reduced._init_fn(x.detach(), w.detach(), None, None, None, t, -100, 0.0, 1.0,
                                                         False, 1.0, True, 4 * n * 1024, "",
                                                         [True, False, True, False, False])
    # 16-row chunks, 1,024-entry vocabulary tiles; the public entry point gives the same
    torch.testing.assert_close(linear_cross_entropy(x, w, t, chunk_bytes=4 * n * 1024), loss)
    ref = F.cross_entropy(x @ w.t(), t)
    rx, rw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)
    names = [c[0] for c in ops.calls]
    assert not any(k in nm for nm in names for k in ("nonzero", "_local_scalar_dense", "item"))
    written = [c for c in ops.calls if c[0] == "aten.mm.out" and c[2] == (1024, h)]
    assert len(written) == v // 1024                                            # each weight tile once
    assert not any(c[0] in ("aten.addmm_.default", "aten.add_.Tensor") and c[1] == (1024, h) for c in ops.calls)
    logits = [c for c in ops.calls if c[0] == "aten.mm.default" and c[1] in ((16, h), (n, h))]
    assert len(logits) == n // 16 + v // 1024                                   # forward chunks + vocab tiles
