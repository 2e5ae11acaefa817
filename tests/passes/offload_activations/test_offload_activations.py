"""offload_activations: saved activations to host memory in forward, back in backward (CUDA; CPU emulation)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import effpass
from effpass.passes import CheckpointActivations, OffloadActivations
from effpass.passes.offload_activations import offload_supported
from tests._families import family_case

pytestmark = pytest.mark.skipif(not offload_supported(), reason="torch without partitioner activation offloading")


class MLPLM(nn.Module):
    def __init__(self, vocab=64, dim=64, ffn=256, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(dim, ffn) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(ffn, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.gelu(up(norm(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _mlp(device="cpu"):
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)
    return MLPLM().to(device), {"tokens": tokens, "labels": tokens.roll(-1, dims=1)}


def _grads(model, inputs, loss_of=lambda out: out):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(**inputs))
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


_GRAPHS: dict = {}


@effpass.register_pass("record_offload_graphs", phase="post_grad", run_after=("offload_activations",))
def _record(gm, ctx):
    _GRAPHS[ctx.graph_kind] = gm
    return False


def test_cpu_graph_skipped_with_reason():
    model, inputs = _mlp()
    ref = effpass.compile(copy.deepcopy(model), passes=[], lowering="eager")
    cm = effpass.compile(copy.deepcopy(model), passes=[OffloadActivations()], lowering="eager")
    l0, g0 = _grads(ref, inputs)
    l1, g1 = _grads(cm, inputs)
    assert l0 == l1 and all(torch.equal(g0[k], g1[k]) for k in g0)
    rep = effpass.report(cm)
    assert rep.stats("offload_activations").get("offloaded", 0) == 0
    reasons = [s["reason"] for g in rep.graphs for r in g.records if r.name == "offload_activations" for s in r.skipped]
    assert any("needs CUDA" in r for r in reasons)


def test_cpu_graph_refused_when_asked():
    model, inputs = _mlp()
    cm = effpass.compile(copy.deepcopy(model), passes=[OffloadActivations(cpu="error")], lowering="eager")
    with pytest.raises(Exception, match="not CUDA"):  # a ValueError, wrapped by Dynamo
        cm(**inputs)


def _check_placement():
    fw, bw = _GRAPHS["forward"].graph, _GRAPHS["backward"].graph
    order = {n: i for i, n in enumerate(fw.nodes)}
    offl = [n for n in fw.nodes if n.name.startswith("cpu_offload_")]
    out = fw.output_node()
    for n in offl:
        src = n.args[0]
        assert n in out.args[0] and src not in out.args[0]  # the copy is saved instead of the tensor
        assert all(order[u] < order[n] for u in src.users if u is not n and u.op != "output")  # after its last use
        assert n.kwargs.get("non_blocking") and n.args[1] == torch.device("cpu")
    order = {n: i for i, n in enumerate(bw.nodes)}
    rel = [n for n in bw.nodes if n.name.startswith("gpu_reload_")]
    assert {n.args[0].name for n in rel} == {n.name for n in offl}
    for n in rel:
        assert n.args[0].op == "placeholder" and n.args[0].users.keys() == {n}  # every use goes through the copy
        assert all(order[u] > order[n] for u in n.users)
    return offl


def test_emulated_on_cpu_self_written_model():
    model, inputs = _mlp()
    ref = effpass.compile(copy.deepcopy(model), passes=[], lowering="eager")
    cm = effpass.compile(copy.deepcopy(model), passes=[OffloadActivations(cpu="emulate", min_bytes=64 * 1024),
                                                       effpass.make_pass("record_offload_graphs")], lowering="eager")
    l0, g0 = _grads(ref, inputs)
    l1, g1 = _grads(cm, inputs)
    assert l0 == l1 and all(torch.equal(g0[k], g1[k]) for k in g0)  # a copy there and back: exact
    offl = _check_placement()
    st = effpass.report(cm).stats("offload_activations")
    # torch offloads the saved, non-view, contiguous marked values: the two up-projections (128 x 256 fp32)
    assert st["offloaded"] == st["reloaded"] == len(offl) == 2 and st["offloaded_bytes"] == 2 * 128 * 256 * 4
    assert {n.args[0].target for n in offl} == {torch.ops.aten.addmm.default}


def test_emulated_on_cpu_llama_with_full_checkpointing():
    case = family_case("llama", batch=2, seq=16)
    passes = [CheckpointActivations(policy="full")]
    ref = effpass.compile(copy.deepcopy(case.model), passes=passes, lowering="eager")
    cm = effpass.compile(copy.deepcopy(case.model), passes=passes + [OffloadActivations(cpu="emulate", min_bytes=0),
                                                                      effpass.make_pass("record_offload_graphs")],
                         lowering="eager")
    l0, g0 = _grads(ref, case.inputs, case.loss)
    l1, g1 = _grads(cm, case.inputs, case.loss)
    assert l0 == l1 and all(torch.equal(g0[k], g1[k]) for k in g0)
    offl = _check_placement()
    st = effpass.report(cm).stats("offload_activations")
    assert st["offloaded"] == st["reloaded"] == len(offl) > 0 and st["marked"] > st["offloaded"]


def test_emulated_with_the_fused_loss_whose_forward_returns_none():
    """fuse_cross_entropy's forward returns None for the logits; torch's offload rewrite read ``.meta`` of every
    forward output and failed (AttributeError in the partition: every lowering failed). The Nones are kept out of
    torch's rewrite and put back at their places: exact gradients, the output's None where it was."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).train()
    tok = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    passes = [CheckpointActivations(policy="full"), effpass.make_pass("fuse_cross_entropy", {})]
    ref = effpass.compile(copy.deepcopy(model), passes=passes, lowering="eager")
    cm = effpass.compile(copy.deepcopy(model), passes=passes + [OffloadActivations(cpu="emulate", min_bytes=0),
                                                                effpass.make_pass("record_offload_graphs")],
                         lowering="eager", strict=True)
    l0, g0 = _grads(ref, inputs, lambda out: out.loss)
    l1, g1 = _grads(cm, inputs, lambda out: out.loss)
    assert l0 == l1 and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    offl = _check_placement()
    st = effpass.report(cm).stats("offload_activations")
    assert st["offloaded"] == st["reloaded"] == len(offl) > 0
    assert None in _GRAPHS["forward"].graph.output_node().args[0]  # the None output kept, not offloaded or dropped


def test_min_bytes_leaves_small_tensors():
    model, inputs = _mlp()
    cm = effpass.compile(copy.deepcopy(model), passes=[OffloadActivations(cpu="emulate", min_bytes=1 << 30)],
                         lowering="eager")
    _grads(cm, inputs)
    st = effpass.report(cm).stats("offload_activations")
    assert st["marked"] == 0 and st["offloaded"] == 0 and st["below_min_bytes"] > 0


def test_declared_lossless_and_validated():
    from effpass.memory_options import declared_memory_options

    opts = [o for o in declared_memory_options() if o.technique == "offload_activations"]
    assert opts and all(o.lossless for o in opts)
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadActivations(min_bytes=-1)
    with pytest.raises(effpass.PassOptionError, match="emulate"):
        OffloadActivations(cpu="host")


@pytest.mark.gpu
def test_cuda_offload_overlapped_saves_device_memory():
    """The stream variant on CUDA (ran on an H100, 2026-11-27: offloaded 5 tensors, 23,068,672 B). CUDA's embedding
    backward accumulates with atomics (two runs of the same reference differed by 9e-10), so the bit-equality oracle
    runs with deterministic algorithms."""
    model, inputs = _mlp("cuda")
    inputs = {k: v.repeat(16, 4) for k, v in inputs.items()}  # 64 x 128 tokens: 8 MiB per saved (.., 256) tensor
    torch.use_deterministic_algorithms(True)
    try:
        _offload_peaks_and_check(model, inputs)
    finally:
        torch.use_deterministic_algorithms(False)


def _offload_peaks_and_check(model, inputs):
    passes = [CheckpointActivations(policy="full")]
    ref = effpass.compile(copy.deepcopy(model), passes=passes, lowering="eager")
    cm = effpass.compile(copy.deepcopy(model), passes=passes + [OffloadActivations(min_bytes=1 << 20)], lowering="eager")
    _grads(ref, inputs), _grads(cm, inputs)  # compile both
    peaks = []
    for m in (ref, cm):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss, grads = _grads(m, inputs)
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated(), loss, grads))
    (p0, l0, g0), (p1, l1, g1) = peaks
    assert l0 == l1 and all(torch.equal(g0[k], g1[k]) for k in g0)
    st = effpass.report(cm).stats("offload_activations")
    assert st["offloaded"] > 0 and p1 < p0
