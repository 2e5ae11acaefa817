"""effpass.cost (issue 36.1): the cost model of a training step, checked against torch's FlopCounterMode, hand
counts of bytes, planted host synchronisations and the command line's JSON."""
import copy
import json

import pytest
import torch

import effpass
from effpass.cost import KEYS, CostMode, build_kernels, get_device, step_cost
from effpass.cli import main

VOCAB, HIDDEN, BATCH, SEQ = 320, 64, 2, 32
TINY = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128}


def _tiny_llama():
    import transformers as tf

    cfg = tf.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}  # as config_step_cost (and trainers) run


@pytest.fixture(scope="module")
def llama():
    return _tiny_llama()


@pytest.fixture(scope="module")
def fused(llama):
    model, inputs = llama
    return step_cost(model, inputs, passes=["fuse_cross_entropy"], per_pass=False)


@pytest.fixture(scope="module")
def chunked(llama):
    """The fused head on its chunked torch kernel (what a CPU runs), estimated for the GPU."""
    from effpass.passes import FuseCrossEntropy

    model, inputs = llama
    return step_cost(model, inputs, passes=[FuseCrossEntropy(kernel="chunked")], per_pass=False)


@pytest.fixture(scope="module")
def plain(llama):
    model, inputs = llama
    return step_cost(model, inputs, passes=[], per_pass=False)


def _flop_counter_total(model, inputs, passes) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    work = copy.deepcopy(model)
    torch._dynamo.reset()
    try:
        compiled = effpass.compile(work, passes=passes, lowering="eager")
        compiled(**inputs).loss.backward()   # compiles
        for p in work.parameters():
            p.grad = None
        with FlopCounterMode(display=False) as counter:
            compiled(**inputs).loss.backward()
        return counter.get_total_flops()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("which", ["plain", "chunked", "fused"])
def test_step_flops_equal_flop_counter_mode(which, llama, request):
    """FlopCounterMode's count of the step, plus what a pass declares it trades: the fused head on a GPU (the
    Triton tiles) computes the logits once more in backward (one head GEMM, 2*N*H*V: never stored)."""
    cost = request.getfixturevalue(which)
    model, inputs = llama
    recompute = 2 * BATCH * SEQ * HIDDEN * VOCAB if which == "fused" else 0
    assert cost.totals["flops"] == _flop_counter_total(model, inputs, [] if which == "plain" else
                                                       ["fuse_cross_entropy"]) + recompute
    # structural: one forward and one backward graph, whose parts add up to the totals
    assert {"forward graph 1", "backward graph 1"} <= set(cost.graphs)
    for key in KEYS:
        assert sum(g[key] for g in cost.graphs.values()) == pytest.approx(cost.totals[key])
        assert sum(o[key] for o in cost.ops.values()) == pytest.approx(cost.totals[key])
    assert cost.ops["aten.mm"]["flops"] > 0


def test_loss_head_share_is_counted_fused_or_not(fused, chunked, plain):
    """The head's matmul FLOPs are 3 GEMMs (logits, input and weight gradient) of 2*N*H*V each, whether the loss
    runs unfused (aten.mm) or inside the fused custom op on its chunked kernel (its registered formula; its chunks
    recorded inside); on a GPU (the Triton tiles) 4: the logits are computed again in backward, never stored."""
    n = BATCH * SEQ
    gemms = 3 * 2 * n * HIDDEN * VOCAB
    assert plain.head["flops"] == gemms
    assert chunked.head["flops"] == gemms
    assert fused.head["flops"] == 4 * gemms // 3
    tiles = {k: v for k, v in fused.ops.items() if "effpass.lce_" in k}
    assert set(tiles) == {"effpass::linear_cross_entropy_rows > effpass.lce_lse",
                          "effpass::linear_cross_entropy_rows_backward > effpass.lce_dlogits"}
    assert all(v["kernels"] == v["calls"] for v in tiles.values())   # one kernel per call, recorded whole
    assert fused.head["host_syncs"] == 0 and fused.head["bytes"] < chunked.head["bytes"]
    fused = chunked
    for cost in (fused, plain):
        assert 0 < cost.head["est_time_s"] < cost.totals["est_time_s"]
        assert 0 < cost.head["bytes"] < cost.totals["bytes"] and cost.head["kernels"] > 0
    inside = {k: v for k, v in fused.ops.items() if k.startswith("effpass::linear_cross_entropy > ")}
    assert inside and sum(v["kernels"] for v in inside.values()) > 0
    assert "effpass.linear_cross_entropy" in fused.ops and fused.ops["effpass.linear_cross_entropy"]["kernels"] == 0
    # the work inside the op: the registered formula's 3 GEMMs on every row (ignored rows are not compacted away,
    # which would need the host to read how many there are: they run with a zero row factor)
    assert sum(r.work_flops for r in fused.records if r.inside) == gemms
    # neither the chunked op nor the unfused loss synchronises with the host (issue 36.2)
    assert fused.head["host_syncs"] == 0 and plain.totals["host_syncs"] == 0


def test_fake_tensors_give_the_real_step_cost(fused, tmp_path):
    """The full-size path (fake tensors: shapes only) counts what the real step does: the same FLOPs, kernels and
    syncs; bytes within the rows the fake replay assumes labelled (Hugging Face's shift leaves 1 row in 32 out)."""
    from effpass.cost import config_step_cost

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    fake = config_step_cost(str(cfg), BATCH, SEQ, passes=["fuse_cross_entropy"], tensors="fake", per_pass=False)
    assert fake.tensors == "fake" and fused.tensors == "real"
    for key in ("flops", "kernels", "host_syncs"):
        assert fake.totals[key] == fused.totals[key], key
        assert fake.head[key] == fused.head[key], key
    assert fake.totals["bytes"] == pytest.approx(fused.totals["bytes"], rel=0.02)
    assert fake.graphs.keys() == fused.graphs.keys()
    assert not any("nonzero" in n for n in fake.notes) and not fused.notes


# ------------------------------------------------------------------------------------------------------
# bytes and kernels by hand, on a graph small enough to count
# ------------------------------------------------------------------------------------------------------
class _Chain(torch.nn.Module):
    def forward(self, x, w):
        y = x @ w
        return (y.relu() * 2.0 + 1.0).sum(dim=1)


def _record(fn, *args):
    mode = CostMode()
    mode.recording = True
    with mode:
        fn(*args)
    return build_kernels(mode.records, get_device("h100"))


def test_bytes_of_a_matmul_and_a_fused_pointwise_chain_equal_a_hand_count():
    m, k, n = 8, 16, 32
    x, w = torch.randn(m, k), torch.randn(k, n)
    gm = torch.fx.symbolic_trace(_Chain())  # runs as a graph (<eval_with_key>): the fusion rule applies
    kernels, share = _record(gm, x, w)
    launched = [kn for kn in kernels if kn.launches]
    assert len(launched) == 2                      # the matmul; relu, mul, add and the row sum fused
    mm, chain = launched
    assert mm.bytes == 4 * (m * k + k * n + m * n) and mm.flops == 2 * m * k * n
    assert chain.bytes == 4 * (m * n + m)          # reads y, writes the row sums; the chain stays in registers
    assert sum(share) == mm.bytes + chain.bytes
    # the same ops in eager code: no fusion, every op reads and writes memory
    kernels, _ = _record(_Chain(), x, w)
    eager = [kn for kn in kernels if kn.launches]
    assert len(eager) == 5
    assert sum(kn.bytes for kn in eager) == 4 * (m * k + k * n + m * n) + 3 * 4 * 2 * m * n + 4 * (m * n + m)


def test_views_are_free_and_a_broadcast_operand_is_read_once():
    x, b = torch.randn(64, 32), torch.randn(32)

    def f(x, b):
        return x.t().contiguous().t() + b  # a transpose is free; its copy is a kernel; b broadcast over rows

    kernels, _ = _record(f, x, b)
    assert [kn.bytes for kn in kernels if kn.launches] == [2 * 64 * 32 * 4, 64 * 32 * 4 + 32 * 4 + 64 * 32 * 4]


def test_gathers_and_scatters_touch_only_the_rows_they_index():
    vocab, hidden, tokens = 1000, 16, 32
    w, ids = torch.randn(vocab, hidden), torch.randint(0, vocab, (tokens,))
    kernels, _ = _record(torch.nn.functional.embedding, ids, w)
    [emb] = [kn for kn in kernels if kn.launches]
    assert emb.bytes == 8 * tokens + 2 * 4 * tokens * hidden  # the ids, the rows read, the rows written
    logits = torch.randn(tokens, vocab)
    kernels, _ = _record(lambda z, t: z.gather(1, t[:, None]), logits, ids)
    assert [kn.bytes for kn in kernels if kn.launches] == [8 * tokens + 4 * tokens + 4 * tokens]
    grad = torch.zeros(tokens, vocab)
    kernels, _ = _record(lambda d, t: d.index_put_((torch.arange(tokens), t), torch.ones(tokens), accumulate=True),
                         grad, ids)
    put = [kn for kn in kernels if kn.launches][-1]   # after arange and ones: reads/writes one element per row
    assert put.bytes == 8 * tokens * 2 + 4 * tokens + 4 * tokens * 2


# ------------------------------------------------------------------------------------------------------
# host synchronisations
# ------------------------------------------------------------------------------------------------------
class _Syncs(torch.nn.Module):
    def forward(self, x, w):
        y = x @ w
        rows = torch.nonzero(y.sum(1) > 0)        # a data-dependent shape
        return y[rows[:, 0]].sum() + (y * 0).sum()


def test_nonzero_and_item_are_host_syncs():
    x, w = torch.randn(8, 4), torch.randn(4, 4)
    gm = torch.fx.symbolic_trace(_Syncs())
    kernels, _ = _record(gm, x, w)
    assert sum(kn.syncs for kn in kernels) == 1
    kernels, _ = _record(lambda a: a.sum().item() + float(a.max()), x)
    syncs = [kn for kn in kernels if kn.syncs]
    assert len(syncs) == 2 and all(kn.launches == 0 for kn in syncs)   # a scalar read is a copy, not a kernel
    assert sum(kn.launches for kn in kernels) == 2                        # sum, max


def test_a_step_with_item_counts_its_sync():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            scale = float(y.detach().abs().max().item())  # a graph break and a host read
            return (y / (1.0 + scale)).pow(2).mean()

    torch.manual_seed(0)
    cost = step_cost(Model(), (torch.randn(4, 8),), passes=[], per_pass=False, loss_fn=lambda out: out)
    assert cost.totals["host_syncs"] == 1
    assert cost.ops["aten._local_scalar_dense"]["host_syncs"] == 1 and cost.ops["aten._local_scalar_dense"]["kernels"] == 0


# ------------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------------
def test_cli_json_has_the_keys_and_totals_are_the_sum_of_parts(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert main(["cost", str(cfg), "--batch", str(BATCH), "--seq", str(SEQ), "--passes", "fuse_cross_entropy",
                 "--device", "h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for part in (data, data["head"], data["passes"]["fuse_cross_entropy"]):
        assert set(KEYS) <= set(part)
    for key in KEYS:
        assert sum(g[key] for g in data["graphs"].values()) == pytest.approx(data[key])
        assert 0 < data["head"][key] <= data[key] or key == "host_syncs"
    assert data["device"].startswith("NVIDIA H200") and data["pipeline"] == ["fuse_cross_entropy"]
    # the fused head adds kernels (its chunks) but no host synchronisation to the plain step (issue 36.2)
    assert data["passes"]["fuse_cross_entropy"]["host_syncs"] == 0 and data["passes"]["fuse_cross_entropy"]["kernels"] > 0


def test_unknown_device_is_a_clear_error(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    with pytest.raises(SystemExit) as e:
        main(["cost", str(cfg), "--batch", "1", "--seq", "8", "--device", "a100x"])
    msg = str(e.value)
    assert "effpass cost" in msg and "'a100x'" in msg and "h100" in msg and "h200" in msg
    with pytest.raises(ValueError, match=r"effpass cost: device 'tpu' is not known; choose one of \['gh200', 'h100', 'h200'\]"):
        get_device("tpu")


def test_roofline_takes_the_slower_of_compute_and_memory_plus_a_launch():
    from effpass.cost import kernel_seconds

    h100, h200 = get_device("h100"), get_device("H200")
    gemm = 2 * 8192 * 4096 * 4096           # compute-bound in bf16: FLOPs at the 790 TFLOP/s ceiling
    assert kernel_seconds(h100, gemm, 10 ** 6, torch.bfloat16) == pytest.approx(gemm / 790e12 + 4e-6)
    assert kernel_seconds(h100, gemm, 10 ** 6, torch.float32) == pytest.approx(gemm / 67e12 + 4e-6)
    copy_bytes = 2 * 2 ** 30                # memory-bound: bytes at the HBM bandwidth (H200's is 4.8/3.35 faster)
    assert kernel_seconds(h100, 0, copy_bytes, torch.bfloat16) == pytest.approx(copy_bytes / 3.35e12 + 4e-6)
    assert kernel_seconds(h200, 0, copy_bytes, torch.bfloat16) == pytest.approx(copy_bytes / 4.8e12 + 4e-6)
