"""fuse_cross_entropy's log-prob and row-wise sites (issue 27) composed with the other passes: checkpointing, a
LoRA head, NF4/int8-quantized heads, autocast entered around the compiled call (as TRL/accelerate do), packed
sequences and FSDP2 (wrap_fsdp, gloo, world size 1 in this process; 2 ranks: tests/passes/wrap_fsdp/test_wrap_fsdp.py; the log-prob
losses on packed rows: tests/passes/fuse_cross_entropy/test_fused_losses_packing.py).

Losses, in plain PyTorch: DPO (chosen-token log-probs of a policy with gradient and of a frozen reference under
``torch.no_grad``: two ``linear_cross_entropy_rows`` sites) and distillation (forward KL between a student's and a
frozen teacher's heads: one two-head ``linear_rowwise`` site). Families: a plain head (Llama), a tied head
(Qwen3, tie_word_embeddings), a tied soft-capped head (Gemma 2), a LoRA head, an NF4 and an int8 head.

Oracles: numerical (loss and every gradient equal the prepared eager model's, i.e. the unfused graph's, within
1e-5 relative in fp32; within bf16 rounding under autocast) and structural (the pass's statistics and the ops
left in the graph: no log_softmax, the fused ops present).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import effpass
from effpass.passes import CheckpointActivations, FuseCrossEntropy, InjectLoRA, QuantizeLinear

V = 256


def _hf(name):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "gemma2":  # tied head, final-logit soft-capping
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, pad_token_id=0, final_logit_softcapping=3.0,
                                                    **common))
    if name == "qwen3_tied":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common))
    raise ValueError(name)


class Loss(torch.nn.Module):
    """``dpo``: sigmoid DPO over (chosen, rejected) rows; ``kl``: forward KL(teacher || student) at temperature 2,
    masked mean. The reference / teacher is frozen and run under ``torch.no_grad``."""

    def __init__(self, policy, ref, kind):
        super().__init__()
        self.policy, self.ref, self.kind = policy, ref, kind

    def _logps(self, model, ids, labels, **kw):
        logits = model(input_ids=ids, use_cache=False, **kw).logits[:, :-1]
        t = labels[:, 1:]
        lp = logits.float().log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (lp * (t != -100)).sum(-1)

    def forward(self, ids, labels, position_ids=None):
        kw = {} if position_ids is None else {"position_ids": position_ids}
        if self.kind == "dpo":
            pol = self._logps(self.policy, ids, labels, **kw)
            with torch.no_grad():
                ref = self._logps(self.ref, ids, labels, **kw)
            margin = (pol - ref).reshape(2, -1)   # chosen rows, then rejected rows
            return -F.logsigmoid(0.1 * (margin[0] - margin[1])).mean()
        zs = self.policy(input_ids=ids, use_cache=False, **kw).logits
        with torch.no_grad():
            zt = self.ref(input_ids=ids, use_cache=False, **kw).logits
        ls, lt = (zs.float() / 2.0).log_softmax(-1), (zt.float() / 2.0).log_softmax(-1)
        mask = (labels != -100).float()
        return ((lt.exp() * (lt - ls)).sum(-1) * mask).sum() / mask.sum() * 4.0


def _model(family, kind):
    policy = _hf(family).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return Loss(policy, ref, kind)


def _batch(rows=4, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _check(compiled_model, compiled, eager, args, kw=None, tol=1e-5, autocast=False):
    """One step of the compiled and the prepared eager model on the same inputs: loss and every gradient."""
    kw = kw or {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = compiled(*args, **kw)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = eager(*args, **kw)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= tol, (float(loss), float(want))
    ref = dict(eager.named_parameters())
    n = 0
    for name, p in compiled_model.named_parameters():
        q = ref[name]
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and _rel(p.grad, q.grad) <= tol, (name, _rel(p.grad, q.grad))
        n += 1
    assert n > 0
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    return recs[-1], effpass.report(compiled).stats("fuse_cross_entropy")


def _assert_fused(rec, kind, lora=0, dequantized=0, low_precision=0):
    st, ops = rec.stats, rec.ops_after
    reasons = rec.skipped
    if kind == "dpo":
        assert st["logprob_sites"] == 2 and st["rowwise_sites"] == 0, (st, reasons)
        assert ops.get("effpass.linear_cross_entropy_rows", 0) == 2, ops
    else:
        assert st["rowwise_sites"] == 1 and st["two_head_sites"] == 1, (st, reasons)
        assert ops.get("effpass.linear_rowwise_train", 0) == 1 and st["rowwise_grad_in_forward"] == 1, ops
    assert not any(k.endswith("log_softmax") or k.endswith("logsumexp") for k in ops), ops
    assert st["skipped"] == 0, reasons
    assert st["lora_heads"] == lora and st["dequantized_heads"] == dequantized, st
    assert st["low_precision_matmuls"] == low_precision, st


# (family, loss, module-level passes, graph passes): four head families (plain, tied, tied + soft-capped, LoRA,
# NF4, int8) across both fused ops, with checkpointing on the tied and soft-capped ones
CASES = {
    "gemma2-softcap-dpo-checkpoint": ("gemma2", "dpo", "", True),
    "qwen3-tied-kl-checkpoint": ("qwen3_tied", "kl", "", True),
    "llama-lora-head-kl-checkpoint": ("llama", "kl", "lora", True),
    "llama-lora-head-dpo": ("llama", "dpo", "lora", False),
    "llama-nf4-head-dpo": ("llama", "dpo", "nf4", False),
    "llama-int8-head-kl-checkpoint": ("llama", "kl", "int8", True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.sweep
def test_fused_sites_compose_with_lora_quantized_heads_and_checkpointing(case):
    family, kind, head, ckpt = CASES[case]
    model = _model(family, kind)
    passes = []
    if head == "lora":
        passes.append(InjectLoRA(rank=4, init="gaussian", targets=["policy.lm_head", "policy.*.q_proj"]))
    elif head in ("nf4", "int8"):
        if head == "nf4":
            pytest.importorskip("torchao")
        # the teacher's/reference's head too: a frozen quantized head fuses like the trained one
        passes.append(QuantizeLinear(scheme=head, targets=["*.lm_head"]))
    if ckpt:
        passes.append(CheckpointActivations())
    compiled = effpass.compile(model, passes=passes + [FuseCrossEntropy()], lowering="eager", strict=True)
    eager = copy.deepcopy(model)   # the prepared model (LoRA injected / weights quantized), unfused, eager
    rec, merged = _check(model, compiled, eager, _batch())
    dequantized = 0
    if head in ("nf4", "int8"):
        assert all(type(m.lm_head.weight).__name__ not in ("Parameter", "Tensor") for m in (model.policy, model.ref))
        dequantized = 2   # both heads (policy/student and reference/teacher) each in its own site or one op
    _assert_fused(rec, kind, lora=1 if head == "lora" else 0, dequantized=dequantized)
    if head == "lora":
        lm = model.policy.lm_head
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lm.named_parameters() if "lora" in n)
    if ckpt:
        # the joint hook marks the fused ops never-recompute (checkpointing must not run them twice)
        assert merged.get("marked_save", 0) >= 1, merged


def test_outer_autocast_runs_the_fused_matmuls_in_bf16():
    """Autocast entered around the compiled call (TRL's/accelerate's bf16): the DPO log-prob sites run their matmuls
    in bf16 inside the op (fp32 log-sum-exp), as eager under the same autocast does (bf16 logits, fp32 log-softmax):
    loss and gradients within bf16 rounding of the eager step."""
    model = _model("llama", "dpo")
    compiled = effpass.compile(model, passes=[FuseCrossEntropy()], lowering="eager", strict=True)
    eager = copy.deepcopy(model)
    rec, _ = _check(model, compiled, eager, _batch(), tol=3e-2, autocast=True)
    _assert_fused(rec, "dpo", low_precision=2)


def test_packed_sequences_with_a_dynamic_length_fuse_the_two_head_kl_once():
    """pack_sequences (one packed row, position_ids restarting per example) marks the packed length dynamic: the
    two-head KL site has a symbolic row count and is fused (one linear_rowwise op, no size baked into the graph:
    its budget is computed per call); loss and gradients equal the unfused graph (fuse_attention + pack_sequences
    without fuse_cross_entropy) within 1e-5 on two lengths, and the fused model compiles one graph for both."""
    from effpass.passes import FuseAttention, PackSequences
    from effpass.testing import dynamo_counters

    model = _model("llama", "kl")
    unfused_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(), FuseCrossEntropy()], lowering="eager",
                               strict=True)
    unfused = effpass.compile(unfused_model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    with dynamo_counters() as counters:
        for lens in ((5, 9, 6), (7, 11)):
            g = torch.Generator().manual_seed(sum(lens))
            ids = torch.randint(1, V, (1, sum(lens)), generator=g)
            labels = ids.clone()
            labels[0, 0] = -100
            pos = torch.cat([torch.arange(n) for n in lens])[None]
            model.zero_grad(set_to_none=True)
            unfused_model.zero_grad(set_to_none=True)
            rec, _ = _check(model, compiled, unfused, (ids, labels), {"position_ids": pos})
    # the only recompile is the second model's frame (the two share their forward's code: one cache entry per
    # backend); the fused model traced one graph
    assert counters["recompiles"] <= 1 and counters["graph_breaks"] == 0, counters
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    assert len(recs) == 1, [r.graph for r in recs]
    st = rec.stats
    assert st["rowwise_sites"] == 1 and st["two_head_sites"] == 1 and st["symbolic_rows"] == 1, st
    assert st["skipped"] == 0, rec.skipped
    # the student is trained: its gradients are computed in the forward (the trained form of the op)
    assert rec.ops_after.get("effpass.linear_rowwise_train", 0) == 1, rec.ops_after
    assert st["rowwise_grad_in_forward"] == 1, st
    assert effpass.report(compiled).stats("pack_sequences")["sdpa_rewritten"] >= 1


def test_wrap_fsdp_world_size_1_dpo_step_matches_eager(tmp_path):
    """wrap_fsdp (FSDP2, gloo, world size 1 in this process) around a DPO loss module (policy + frozen reference):
    loss and gradients equal the unwrapped eager model's within 1e-5, and both log-prob sites are fused: wrap_fsdp
    compiles each model's decoder blocks and the wrapper around them, with one boundary per model (``policy.model``,
    ``ref.model``; nested graph breaks, so each head and the log-probs its caller computes share a graph). Before,
    the units under two children of the root left no boundary and the heads ran eagerly, unfused."""
    import torch.distributed as dist

    from effpass.passes import WrapFSDP

    model = _model("llama", "dpo")
    eager = copy.deepcopy(model)
    args = _batch()
    want = eager(*args)
    want.backward()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        compiled = effpass.compile(model, passes=[FuseCrossEntropy(), WrapFSDP()], lowering="eager", dump_dir=None)
        loss = compiled(*args)
        loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters() if p.grad is not None}
        rep = effpass.report(compiled)
    finally:
        dist.destroy_process_group()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    ref = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys()
    for n, g in ref.items():
        assert _rel(grads[n], g) <= 1e-5, n
    st, ws = rep.stats("fuse_cross_entropy"), rep.stats("wrap_fsdp")
    assert ws["world_size"] == 1 and ws["units"] == 2 and ws["compiled_root"] == 1, ws
    assert ws["root_boundary"] == "policy.model,ref.model", ws
    assert st["logprob_sites"] == 2 and st["skipped"] == 0, st
