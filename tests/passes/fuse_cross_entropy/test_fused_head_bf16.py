"""The fused vocabulary head on a bf16 model (no autocast): the chunked ops multiply in bf16, as the unfused graph
does (``bf16 x bf16`` logits, upcast to fp32 for the loss), and accumulate a bf16 weight's gradient in bf16 (the
unfused graph's weight gradient is one bf16 matmul output): no fp32 buffer of the weight's size exists inside them.

Found on an H100 (bench/results/cross_entropy_cuda-h100.md): the reduced op held an fp32 accumulator of the head weight's
size (1,002 MiB at vocabulary 128,256 x hidden 2,048) and added each chunk's bf16 product into it (a full-size bf16
temporary per chunk; on CPU also an fp32 copy of it, TensorIterator's dtype promotion).

Oracles: structural (every matmul inside the ops takes bf16 inputs, read from the profiler's recorded input dtypes;
no allocation inside the ops reaches the fp32 weight's bytes; the ops' own peak stays below them) and numerical (each
gradient's error against an fp32 copy of the model stays within twice the unfused bf16 graph's own error, and the
losses agree to bf16 rounding).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import effpass
from effpass.passes import FuseCrossEntropy
from effpass.passes.fuse_cross_entropy.kernels import linear_cross_entropy, register_row_fn

V, H = 4096, 128
MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul")


def _op_profile(fn, op_prefix: str):
    """Run ``fn`` under the profiler; return (matmul input dtypes inside ops named ``op_prefix*``, the largest
    allocation inside them, the peak of the bytes allocated inside them above those live when each op started)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        fn()
    dtypes = [tuple(d for d in e.input_dtypes if d and d != "Scalar") for e in prof.events()
              if e.name in MATMULS and _inside(e, op_prefix)]
    largest, peak = 0, 0

    def transient(ev) -> list[int]:
        """Sizes a library matmul allocated and freed again inside its own call (oneDNN packs a bf16 weight
        operand into a workspace of about its size on CPUs with bf16 GEMM kernels): workspaces, not tensors."""
        sizes = [int(c.extra_fields.alloc_size) for c in ev.children if c.tag == _EventType.Allocation]
        freed = [-s for s in sizes if s < 0]
        return [s for s in sizes if s > 0 and s in freed and not freed.remove(s)]

    def walk(ev, inside, live, skip=()):
        nonlocal largest, peak
        here = inside or ev.name.startswith(op_prefix)
        if ev.tag == _EventType.Allocation and inside and ev.extra_fields.device.type == "cpu":
            size = int(ev.extra_fields.alloc_size)
            if abs(size) in skip:
                return
            largest = max(largest, size)
            live[0] += size
            peak = max(peak, live[0])
        start = [0] if (here and not inside) else live
        inner = tuple(transient(ev)) if ev.name in MATMULS else ()
        for c in sorted(ev.children, key=lambda c: c.start_time_ns):
            walk(c, here, start, inner)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False, [0])
    return dtypes, largest, peak


def _inside(e, prefix: str) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.cpu_parent
    return False


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=0, eos_token_id=0)
    return tf.LlamaForCausalLM(conf).train()


def test_bf16_model_fused_step_multiplies_in_bf16_and_holds_no_fp32_weight():
    """A bf16 HF Llama (vocabulary 4,096, hidden 128), effpass-compiled with fuse_cross_entropy: the op's matmuls
    take bf16 inputs, its head-weight gradient is accumulated in bf16 (nothing inside the op reaches the 2 MiB of
    an fp32 copy of the weight; before the fix it allocated one, plus a bf16 product per chunk), and every
    gradient is as close to the fp32 model's as the unfused bf16 step's are."""
    ref32 = _llama()
    model = copy.deepcopy(ref32).to(torch.bfloat16)
    unfused = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 24), generator=g)
    compiled = effpass.compile(model, passes=[FuseCrossEntropy()], lowering="eager", strict=True)

    def step():
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        return out

    out = None

    def run():
        nonlocal out
        out = step()

    dtypes, largest, peak = _op_profile(run, "effpass::linear_cross_entropy")
    stats = effpass.report(compiled).stats("fuse_cross_entropy")
    assert stats["fused"] == 1 and stats["low_precision_matmuls"] == 0 and out.logits is None, stats
    # structural: the logits, the input gradient and the weight gradient of every chunk: bf16 x bf16
    assert len(dtypes) >= 3 * stats["chunks"], (dtypes, stats)
    assert all(set(d) == {"c10::BFloat16"} for d in dtypes), dtypes
    w32_bytes = V * H * 4
    assert largest <= V * H * 2, (largest, w32_bytes)  # the bf16 gradient; no fp32 weight-sized accumulator
    assert peak < w32_bytes, (peak, w32_bytes)         # the bf16 gradient (1 MiB) + chunks
    assert model.lm_head.weight.grad.dtype == torch.bfloat16

    unfused(input_ids=ids, labels=ids).loss.backward()
    loss32 = ref32(input_ids=ids, labels=ids).loss
    loss32.backward()
    assert abs(out.loss.item() - loss32.item()) <= 1e-2 * abs(loss32.item())
    ref = dict(ref32.named_parameters())
    unf = dict(unfused.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        want = ref[name].grad
        err, base = _rel(p.grad, want), _rel(unf[name].grad, want)
        assert err <= 2 * base + 1e-3, (name, err, base)
        n += 1
    assert n > 5


def test_rows_and_rowwise_ops_accumulate_a_bf16_weight_gradient_in_bf16():
    """The per-row op (log-probabilities, ``reduction="none"``) recomputes in its backward op, and the row-wise op
    (entropy here) differentiates per block in its backward op: both accumulate a bf16 weight's gradient in bf16
    with bf16 matmuls, and both gradients stay as close to fp32's as the unfused bf16 graph's."""
    torch.manual_seed(0)
    n = 96
    x0 = torch.randn(n, H).bfloat16()
    w0 = (torch.randn(V, H) * 0.05).bfloat16()
    t = torch.randint(0, V, (n,))
    gw = torch.randn(n)
    budget = 16 * V * 4  # 6 chunks of 16 rows

    class Entropy(torch.nn.Module):
        def forward(self, z):
            ls = z.log_softmax(-1)
            return (-(ls.exp() * ls).sum(-1),)

    key = register_row_fn(torch.fx.symbolic_trace(Entropy()))

    def rows(x, w, fused):
        if fused:
            return linear_cross_entropy(x, w, t, reduction="none", chunk_bytes=budget)
        return F.cross_entropy((x @ w.t()).float(), t, reduction="none")

    def rowwise(x, w, fused):
        if fused:
            out = torch.ops.effpass.linear_rowwise(x, w, None, None, None, None, None, None, None, None, [], key,
                                                   [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], budget, "", 1)
            return out[:, 0]
        return Entropy()((x @ w.t()).float())[0]

    for fn, prefix in ((rows, "effpass::linear_cross_entropy_rows_backward"),
                       (rowwise, "effpass::linear_rowwise_backward")):
        def grads(dtype, fused):
            x = x0.to(dtype).clone().requires_grad_()
            w = w0.to(dtype).clone().requires_grad_()
            (fn(x, w, fused) * gw).sum().backward()
            return x.grad, w.grad

        got = {}
        dtypes, largest, peak = _op_profile(lambda: got.update(g=grads(torch.bfloat16, True)), prefix)
        assert dtypes and all(set(d) == {"c10::BFloat16"} for d in dtypes), (prefix, dtypes)
        # the largest buffer is the bf16 gradient itself (before the fix: its fp32 accumulator, twice that); the rest
        # are chunk-sized (the row-wise op's autograd keeps a few tiles of the block's logits)
        assert largest <= V * H * 2 and peak <= V * H * 2 + 8 * budget, (prefix, largest, peak)
        dx, dw = got["g"]
        assert dw.dtype == torch.bfloat16
        rx, rw = grads(torch.float32, False)
        ux, uw = grads(torch.bfloat16, False)
        assert _rel(dw, rw) <= 2 * _rel(uw, rw) + 1e-3, (prefix, _rel(dw, rw), _rel(uw, rw))
        assert _rel(dx, rx) <= 2 * _rel(ux, rx) + 1e-3, (prefix, _rel(dx, rx), _rel(ux, rx))
