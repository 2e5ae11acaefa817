"""Autocast entered around the compiled call (as TRL and accelerate do for ``bf16=True``): every pass reads
it through the one reader (effpass.graph.AutocastRegions), so fuse_attention and fuse_cross_entropy agree on
the compute dtype. Oracles: the dtypes the rewritten graph computes in (read from it by a probe pass that
runs after both), the passes' statistics, and the loss against eager autocast (bf16 bound)."""
from __future__ import annotations

import copy

import torch

import effpass
from effpass.attention import attention_op
from effpass.graph import AutocastRegions, val
from effpass.passes import FuseAttention, FuseCrossEntropy

_SEEN: dict[str, list] = {}


@effpass.register_pass("probe_compute_dtypes", run_after=("fuse_attention", "fuse_cross_entropy"), replace=True)
def _probe(gm, ctx):
    regions = AutocastRegions(gm.graph)
    for n in gm.graph.nodes:
        if attention_op(n) is not None:
            q = val(n.args[0])
            _SEEN["attention"].append(regions.dtype_at(n, "cpu") or q.dtype)  # what SDPA computes in
            _SEEN["attention_q"].append(q.dtype)
        elif n.op == "call_function" and n.target is torch.ops.effpass.linear_cross_entropy.default:
            _SEEN["cross_entropy"].append(n.args[13])  # the op's compute dtype ("" = its input's)
    return False


def _demo():
    from effpass.testing.models import DemoConfig, DemoLM

    torch.manual_seed(0)
    model = DemoLM(DemoConfig(vocab_size=128, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=64))
    model.train()
    return model


def test_outer_autocast_fuse_attention_and_fuse_cross_entropy_agree():
    _SEEN.clear()
    _SEEN.update(attention=[], attention_q=[], cross_entropy=[])
    model = _demo()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    compiled = effpass.compile(model, passes=[FuseAttention(), FuseCrossEntropy(), _probe()], lowering="eager",
                               strict=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = compiled(ids, labels)
        ref_loss, _ = ref(ids, labels)
    # structural: both passes rewrote their site and compute in the outer autocast's dtype
    assert _SEEN["attention"] == [torch.bfloat16] and _SEEN["attention_q"] == [torch.bfloat16], _SEEN
    assert _SEEN["cross_entropy"] == ["bfloat16"], _SEEN
    report = effpass.report(compiled)
    assert report.stats("fuse_attention")["rewritten"] == 1
    ce = report.stats("fuse_cross_entropy")
    assert ce["fused"] == 1 and ce["low_precision_matmuls"] == 1, ce
    # numerical: eager autocast is the reference (bf16 matmuls on both sides)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
