"""fuse_cross_entropy's vocabulary losses on packed rows (pack_sequences: padding-free rows, per-example
``position_ids``), issue 27 item 3.

The losses are written as TRL writes them (``tests/_vocab_losses.py``): logits -> ``log_softmax`` -> ``gather`` ->
masked sums per example, DPO over (chosen, rejected) examples and GRPO (ratio, k3-KL to a frozen reference, token
mean per example); on packed rows the loss reads the example boundaries from the ``position_ids`` it is called with
(a segment sum over ``cumsum(position_ids == 0) - 1``), on padded rows it sums each row.

Oracles: numerical (the packed, fused step against the unfused eager step on the same examples as a right-padded
batch, one example per row: per-example log-prob sums, loss and every gradient within 1e-5 relative in fp32) and
structural (the pass's statistics: both log-prob sites fused with a symbolic row count, nothing skipped, no
``log_softmax`` left; Dynamo's counters: one graph for three packed lengths, no recompile, no graph break).
"""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from effpass.passes import FuseAttention, FuseCrossEntropy, InjectLoRA, PackSequences
from effpass.testing import dynamo_counters

from _families import VOCAB, family_case
from _vocab_losses import SelfLM, examples, frozen_copy, packed, padded, pair

LENGTHS = ((5, 9, 6, 8), (7, 11, 4, 9), (3, 4, 5, 6))   # 4 examples (2 DPO pairs / 4 GRPO completions) per row


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _policy(family):
    if family == "self":
        return SelfLM(VOCAB)
    # Gemma 2: tied head with final-logit soft-capping and a sliding window (eager attention, as the pack matrix)
    return family_case(family, attn="eager" if family == "gemma2" else "sdpa").model


def _fce_record(compiled):
    recs = [r for r in effpass.report(compiled).records("fuse_cross_entropy") if r.phase == "torch_ir"]
    assert len(recs) == 1, [r.graph for r in recs]   # one graph for every packed length
    return recs[0]


def _fused_and_unfused(model):
    """``model`` compiled with packing and the fused loss, a copy with packing only (the reference), that copy,
    and one packed batch per length of LENGTHS."""
    unfused_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(), FuseCrossEntropy()], lowering="eager",
                               strict=True)
    unfused = effpass.compile(unfused_model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    return compiled, unfused, unfused_model, [packed(examples(lens, VOCAB, seed=seed))
                                              for seed, lens in enumerate(LENGTHS)]


@pytest.mark.parametrize("family,kind,lora", [("llama", "dpo", False), ("gemma2", "grpo", False),
                                              ("qwen3", "grpo", False), ("llama", "grpo", True), ("self", "dpo", False),
                                              ("self", "grpo", False)])
@pytest.mark.sweep
def test_packed_logprob_losses_fuse_once_and_sum_per_example(family, kind, lora):
    model = pair(_policy(family), kind)
    if lora:   # LoRA on the policy's head and queries, injected first (the reference below is the prepared model)
        effpass.prepare(model, [InjectLoRA(rank=4, init="gaussian", targets=["policy.lm_head", "policy.*.q_proj"])])
    eager = copy.deepcopy(model)   # the unfused eager reference, run on padded rows
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(), FuseCrossEntropy()],
                               lowering="eager", strict=True)
    with dynamo_counters() as counters:
        for seed, lens in enumerate(LENGTHS):
            exs = examples(lens, VOCAB, seed=seed)
            ids, labels, pos = packed(exs)
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            loss, sums = compiled(ids, labels, len(exs), position_ids=pos)
            loss.backward()
            want, want_sums = eager(*padded(exs), len(exs))
            want.backward()
            # per example, not per packed row: the 4 sums equal those of the examples each in its own row
            assert sums.shape == (len(exs),) and _rel(sums.detach(), want_sums.detach()) <= 1e-5, (sums, want_sums)
            assert _rel(loss.detach(), want.detach()) <= 1e-5, (float(loss), float(want))
            ref = dict(eager.named_parameters())
            checked = 0
            for name, p in model.named_parameters():
                if ref[name].grad is None:
                    assert p.grad is None, name
                    continue
                assert p.grad is not None and _rel(p.grad, ref[name].grad) <= 1e-5, (name, _rel(p.grad, ref[name].grad))
                checked += 1
            assert checked == sum(p.requires_grad for p in model.policy.parameters()) > 0
    # one graph with a symbolic packed length serves every length (the pass bakes no row count into it)
    assert counters == {"graph_breaks": 0, "unique_graphs": 1, "recompiles": 0, "frames": 1}, counters
    rec = _fce_record(compiled)
    st, ops = rec.stats, rec.ops_after
    assert st["logprob_sites"] == 2 and st["symbolic_rows"] == 2 and st["skipped"] == 0, (st, rec.skipped)
    assert st["lora_heads"] == int(lora), st   # the policy's LoRA head: the adapter is the op's second projection
    assert ops.get("effpass.linear_cross_entropy_rows", 0) == 2, ops
    assert not any(k.endswith("log_softmax") for k in ops), ops
    assert st["logits_bytes_avoided"] == 2 * (sum(LENGTHS[0]) - 1) * VOCAB * 4, st   # the traced length's rows
    ps = effpass.report(compiled).stats("pack_sequences")
    assert ps["packed_examples"] == 4 * len(LENGTHS) and ps["skipped"] == 0, ps


def test_packed_hf_cross_entropy_compiles_once():
    """Plain cross-entropy (Hugging Face labels) on packed rows: fused in one graph for every packed length (it was
    recompiled per length: the row count was read as an int, a guard); loss and gradients equal the unfused
    packed step."""
    model = family_case("llama", attn="sdpa").model.train()
    compiled, unfused, unfused_model, batches = _fused_and_unfused(model)
    wants = []
    for ids, labels, pos in batches:   # the reference first: counted apart from the fused model's frame
        unfused_model.zero_grad(set_to_none=True)
        want = unfused(input_ids=ids, labels=labels, position_ids=pos).loss
        want.backward()
        wants.append((want.detach(), {n: p.grad.clone() for n, p in unfused_model.named_parameters()}))
    torch._dynamo.reset()   # the two models share their forward's code object (a cache entry per backend)
    with dynamo_counters() as counters:
        for (ids, labels, pos), (want, grads) in zip(batches, wants):
            model.zero_grad(set_to_none=True)
            out = compiled(input_ids=ids, labels=labels, position_ids=pos)
            out.loss.backward()
            assert out.logits is None
            assert _rel(out.loss.detach(), want) <= 1e-5
            for n, p in model.named_parameters():
                assert _rel(p.grad, grads[n]) <= 1e-5, n
    assert counters == {"graph_breaks": 0, "unique_graphs": 1, "recompiles": 0, "frames": 1}, counters
    rec = _fce_record(compiled)
    assert rec.stats["fused"] == 1 and rec.stats["symbolic_rows"] == 1 and rec.stats["skipped"] == 0, rec.stats


class _Distill(torch.nn.Module):
    """A student and a frozen teacher (self-written) on packed rows: ``F.kl_div(..., reduction="batchmean")`` plus an
    entropy bonus averaged over everything (``.mean()`` of a vocabulary-sized value): two reductions of everything,
    which the row-wise op computes per row and the graph finishes (a mean over a symbolic number of rows)."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def forward(self, ids, position_ids=None):
        zs = self.student(ids, position_ids=position_ids)
        with torch.no_grad():
            zt = self.teacher(ids, position_ids=position_ids)
        ls, lt = (zs.float() / 2.0).log_softmax(-1), (zt.float() / 2.0).log_softmax(-1)
        kl = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="batchmean")
        return kl + 0.1 * (ls.exp() * ls).mean()


def test_packed_distillation_reductions_of_everything_fuse_once():
    student = SelfLM(VOCAB).train()
    model = _Distill(student, frozen_copy(student))
    compiled, unfused, unfused_model, batches = _fused_and_unfused(model)
    wants = []
    for ids, _, pos in batches:   # the unfused packed step first: counted apart from the fused model's frame
        unfused_model.zero_grad(set_to_none=True)
        want = unfused(ids, position_ids=pos)
        want.backward()
        wants.append((want.detach(), {n: p.grad.clone() for n, p in unfused_model.named_parameters()
                                      if p.grad is not None}))
    torch._dynamo.reset()
    with dynamo_counters() as counters:
        for (ids, _, pos), (want, grads) in zip(batches, wants):
            model.zero_grad(set_to_none=True)
            loss = compiled(ids, position_ids=pos)
            loss.backward()
            assert _rel(loss.detach(), want) <= 1e-5, (float(loss), float(want))
            got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert got.keys() == grads.keys() and len(got) > 0
            for n, g in got.items():
                assert _rel(g, grads[n]) <= 1e-5, n
    assert counters == {"graph_breaks": 0, "unique_graphs": 1, "recompiles": 0, "frames": 1}, counters
    st = _fce_record(compiled).stats
    assert st["rowwise_sites"] == 1 and st["two_head_sites"] == 1 and st["rowwise_outputs"] == 2, st
    assert st["symbolic_rows"] == 1 and st["skipped"] == 0, st
