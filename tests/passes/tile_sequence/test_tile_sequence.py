"""tile_sequence: row-wise regions computed in sequence tiles, recomputed tile by tile in backward."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import effpass
from effpass.graph import tensor_meta
from effpass.passes import CheckpointActivations, FuseAttention, FuseCrossEntropy, TileSequence
from tests._families import family_case


def _grads(model, inputs, loss_of):
    model.zero_grad(set_to_none=True)
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = loss_of(out)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


_SEEN: dict[str, list] = {}


@effpass.register_pass("record_backward_shapes", phase="post_grad", run_after=("tile_sequence",))
def _record_backward_shapes(gm, ctx):
    """Test helper: the shapes of every value the backward graph computes."""
    if ctx.graph_kind == "backward":
        _SEEN.setdefault("backward", []).extend(tuple(tensor_meta(n).shape) for n in gm.graph.nodes
                                                if isinstance(tensor_meta(n), torch.Tensor))
    if ctx.graph_kind == "forward":
        _SEEN.setdefault("forward", []).extend(tuple(tensor_meta(n).shape) for n in gm.graph.nodes
                                               if isinstance(tensor_meta(n), torch.Tensor))
    return False


def _compile_pair(case, extra, tile_rows):
    """(untiled compiled, tiled compiled) with the same pipeline otherwise."""
    base = [FuseAttention(), FuseCrossEntropy()] + list(extra)
    ref = effpass.compile(copy.deepcopy(case.model), passes=base, lowering="eager")
    tiled = effpass.compile(copy.deepcopy(case.model), passes=base + [TileSequence(tile_rows=tile_rows)], lowering="eager")
    return ref, tiled


@pytest.mark.parametrize("family,ckpt", [("llama", None), ("llama", "full"), ("llama", "ops"), ("qwen3", "full"),
                                         ("phi3", None), ("olmo2", "full")])
@pytest.mark.sweep
def test_gradients_equal_untiled(family, ckpt):
    case = family_case(family, batch=2, seq=32, attn="sdpa")
    case.model.train()
    extra = [] if ckpt is None else [CheckpointActivations(policy=ckpt)]
    ref, tiled = _compile_pair(case, extra, tile_rows=16)
    l0, g0 = _grads(ref, case.inputs, case.loss)
    l1, g1 = _grads(tiled, case.inputs, case.loss)
    assert abs(l0 - l1) <= 1e-6 * abs(l0)
    assert g0.keys() == g1.keys()
    worst = max(_rel(g1[n], g0[n]) for n in g0)
    assert worst <= 1e-6, worst
    st = effpass.report(tiled).stats("tile_sequence")
    # one MLP region per layer, 64 rows in tiles of 16
    assert st["regions"] == case.num_layers, st
    assert st["tiles"] == 4 * case.num_layers, st
    assert st["marked_recompute"] > 0


def test_a_parallel_block_tiles_its_mlp_and_keeps_the_shared_norm_whole():
    """Cohere's parallel block: one norm feeds the attention's projections (before the MLP in the graph) and the
    MLP. The tiles are computed after the region's last node, so the norm stays computed once, untiled, an input
    of the MLP's tiles (it was tiled with the MLP: a value used before its definition, the pass rolled back)."""
    case = family_case("cohere", batch=2, seq=32, attn="sdpa")
    case.model.train()
    ref, tiled = _compile_pair(case, [CheckpointActivations(policy="full")], tile_rows=16)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a pass that fails and is rolled back warns
        l0, g0 = _grads(ref, case.inputs, case.loss)
        l1, g1 = _grads(tiled, case.inputs, case.loss)
    assert abs(l0 - l1) <= 1e-6 * abs(l0) and g0.keys() == g1.keys()
    assert max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6
    rep = effpass.report(tiled)
    st = rep.stats("tile_sequence")
    assert st["regions"] >= case.num_layers and st["tiles"] == 4 * st["regions"], st
    assert not any(r.error for g in rep.graphs for r in g.records), [r.error for g in rep.graphs for r in g.records]


def test_backward_never_holds_a_whole_sequence_of_intermediate_width():
    """Structural: with tiles of 16 rows, no forward or backward value is (48 rows x intermediate)."""
    case = family_case("llama", batch=1, seq=48, attn="sdpa")
    case.model.train()
    inter = case.model.config.intermediate_size
    _SEEN.clear()
    probe = effpass.get_pass_class("record_backward_shapes")()
    base = [FuseAttention(), FuseCrossEntropy(), CheckpointActivations(policy="full")]
    m = effpass.compile(copy.deepcopy(case.model), passes=base + [probe], lowering="eager")
    _grads(m, case.inputs, case.loss)
    untiled = [s for s in _SEEN["backward"] if s and s[-1] == inter and 48 in s]
    assert untiled, "the untiled backward computes whole-sequence MLP intermediates (the oracle can fail)"
    _SEEN.clear()
    m = effpass.compile(copy.deepcopy(case.model), passes=base + [TileSequence(tile_rows=16), probe], lowering="eager")
    _grads(m, case.inputs, case.loss)
    for kind in ("forward", "backward"):
        wide = [s for s in _SEEN[kind] if s and s[-1] == inter]
        assert wide and all(48 not in s for s in wide), (kind, wide)
        assert any(16 in s for s in wide)


class _Mixer(nn.Module):
    """A self-written block: an MLP whose middle mixes rows along the sequence (cumsum) or not."""

    def __init__(self, d=16, inter=48, mix="none"):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, inter)
        self.down = nn.Linear(inter, d)
        self.mix = mix

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x)))
        if self.mix == "cumsum":
            h = h.cumsum(dim=1)
        elif self.mix == "dropout":
            h = F.dropout(h, 0.1, training=True)
        elif self.mix == "seq_softmax":
            h = torch.softmax(h, dim=1)
        return (x + self.down(h)).pow(2).mean()


@pytest.mark.parametrize("mix", ["none", "cumsum", "dropout", "seq_softmax"])
def test_row_mixing_ops_end_a_region(mix):
    torch.manual_seed(0)
    model = _Mixer(mix=mix)
    x = torch.randn(2, 64, 16)
    ref = copy.deepcopy(model)
    m = effpass.compile(model, passes=[TileSequence(tile_rows=32)], lowering="eager")
    if mix == "dropout":  # random: compare structure only
        m(x).backward()
    else:
        l0, g0 = _grads(ref, (x,), lambda o: o)
        l1, g1 = _grads(m, (x,), lambda o: o)
        assert abs(l0 - l1) <= 1e-6 * abs(l0) and max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6
    rec = effpass.report(m)
    st = rec.stats("tile_sequence")
    assert st["regions"] == 1 and st["tiles"] == 4, st
    if mix == "none":  # norm, up, gelu, down, the residual add and pow (the mean over all rows ends it)
        assert st["tiled_nodes"] == 6, st
    else:  # the row-mixing (or random) op ends the region: norm, up, gelu only
        assert st["tiled_nodes"] == 3, st


def test_lora_composes():
    from effpass.passes import InjectLoRA

    case = family_case("llama", batch=2, seq=32, attn="sdpa")
    case.model.train()
    extra = [InjectLoRA(targets=("*.gate_proj", "*.up_proj", "*.down_proj", "*.q_proj"), rank=4)]
    torch.manual_seed(0)
    ref, tiled = _compile_pair(case, extra, tile_rows=16)
    tiled.load_state_dict(ref.state_dict())
    l0, g0 = _grads(ref, case.inputs, case.loss)
    l1, g1 = _grads(tiled, case.inputs, case.loss)
    assert any("lora" in n for n in g0)
    assert abs(l0 - l1) <= 1e-6 * abs(l0)
    assert max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6
    assert effpass.report(tiled).stats("tile_sequence")["regions"] == case.num_layers


def test_bad_option():
    with pytest.raises(ValueError, match="tile_rows"):
        TileSequence(tile_rows=0)


def test_short_sequences_are_left_alone():
    case = family_case("llama", batch=1, seq=8, attn="sdpa")
    m = effpass.compile(copy.deepcopy(case.model), passes=[TileSequence(tile_rows=16)], lowering="eager")
    m(**case.inputs)
    assert not effpass.report(m).stats("tile_sequence").get("regions")


def test_quantized_base_with_lora_composes():
    """QLoRA-style: int8 base weights (buffers, dequantized in the graph: row-constant weights of a linear)
    with LoRA adapters; the MLP region is tiled the same way and the adapters' gradients equal the untiled."""
    from effpass.passes import InjectLoRA, QuantizeLinear

    case = family_case("llama", batch=2, seq=32, attn="sdpa")
    case.model.train()
    extra = [QuantizeLinear(scheme="int8"), InjectLoRA(targets=("*.gate_proj", "*.up_proj", "*.down_proj"), rank=4)]
    torch.manual_seed(0)
    ref, tiled = _compile_pair(case, extra, tile_rows=16)
    tiled.load_state_dict(ref.state_dict())
    assert effpass.report(tiled).stats("quantize_linear", "module")["quantized"] >= 3 * case.num_layers
    l0, g0 = _grads(ref, case.inputs, case.loss)
    l1, g1 = _grads(tiled, case.inputs, case.loss)
    assert any("lora" in n for n in g0)
    assert abs(l0 - l1) <= 1e-6 * abs(l0)
    assert max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6
    assert effpass.report(tiled).stats("tile_sequence")["regions"] == case.num_layers


def test_packed_rows_with_a_symbolic_length_are_left_alone_with_the_reason():
    """pack_sequences marks the packed length dynamic: tiles cut at fixed offsets would need a fixed length, so
    the pass leaves those regions alone and says why. Oracles: numerical (loss and gradients equal the same
    pipeline without tile_sequence, over two packed lengths, one compiled graph) and structural (no region tiled,
    the skip reason names the symbolic rows; the same model with a fixed length is tiled: the oracle can fail)."""
    import transformers as tf

    from effpass.passes import PackSequences

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # 1 block: 3 compiles
    cfg._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(cfg).train()

    def packed(lens, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 128, (1, sum(lens)), generator=g)
        return dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in lens])[None], labels=ids)

    base = [FuseAttention(), PackSequences()]
    torch._dynamo.reset()
    ref = effpass.compile(copy.deepcopy(model), passes=base, lowering="eager")
    tiled = effpass.compile(copy.deepcopy(model), passes=base + [TileSequence(tile_rows=8)], lowering="eager")
    for lens, seed in (([9, 13, 10], 1),):  # 32 packed rows: 4 tiles of 8 if the length were static
        l0, g0 = _grads(ref, packed(lens, seed), lambda o: o.loss)
        l1, g1 = _grads(tiled, packed(lens, seed), lambda o: o.loss)
        assert abs(l0 - l1) <= 1e-6 * abs(l0) and g0.keys() == g1.keys()
        assert max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6
    recs = [r for r in effpass.report(tiled).records("tile_sequence") if r.phase == "torch_ir"]
    assert recs and not any(r.stats.get("regions") for r in recs), [r.stats for r in recs]
    assert any("symbolic rows" in s["reason"] for r in recs for s in r.skipped), [r.skipped for r in recs]
    assert effpass.report(tiled).stats("pack_sequences")["length_marked_dynamic"] == 1
    # control: a fixed length (no packing) is tiled
    static = effpass.compile(copy.deepcopy(model), passes=[FuseAttention(), TileSequence(tile_rows=8)], lowering="eager")
    static(**packed([32], 3)).loss.backward()
    assert effpass.report(static).stats("tile_sequence")["regions"] >= cfg.num_hidden_layers


_SAVED: list = []


@effpass.register_pass("record_saved_for_backward", phase="post_grad", run_after=("tile_sequence",))
def _record_saved(gm, ctx):
    """Test helper: (shape, dtype, bytes) of every value the forward graph saves for the backward, inputs and views
    (of the weights: a transposed head) left out."""
    if ctx.graph_kind == "forward":
        from effpass.quantized import storage_bytes

        out = next(iter(gm.graph.find_nodes(op="output")))
        for a in out.args[0]:
            v = tensor_meta(a) if isinstance(a, torch.fx.Node) else None
            view = isinstance(a.target, torch._ops.OpOverload) and a.target.is_view
            if isinstance(v, torch.Tensor) and a.op != "placeholder" and not view:
                _SAVED.append((tuple(v.shape), v.dtype, storage_bytes([v])))
    return False


def _qlora_llama(seq=96):
    import transformers as tf

    torch.manual_seed(0)
    # one block: what is checked (a tile's copies of weight-only nodes, what the forward saves) is per block
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(3, 128, (1, seq), generator=torch.Generator().manual_seed(1))
    return tf.LlamaForCausalLM(cfg).train(), dict(input_ids=ids, labels=ids, use_cache=False)


@pytest.mark.parametrize("scheme,ckpt", [("nf4", "full"), ("nf4", "ops"), ("int8", "full"), (None, "full")])
@pytest.mark.sweep
def test_quantized_base_lora_checkpoint_and_tiles_save_no_weight_copy(scheme, ckpt):
    """QLoRA (NF4 / int8 base, LoRA on q/k/v/o) + checkpoint_activations + tiles. Before, every op copied into a
    tile was marked for the tile's recompute, including the dequantization of the tile's weights (parameters only):
    it got the region's ac_graph_id, above the block id of its own input (the int32 copy of NF4's packed codes),
    and torch's cleanup_recompute_tags saved that input for the backward, 2 bytes per weight (Llama-3-8B
    QLoRA + checkpoint(full): +11.5 GiB predicted). Oracles: gradients equal the untiled step's; the values the
    forward saves that have no row (computed from weights alone) are byte for byte the untiled step's, so no
    weight copy is kept per tile or per region; the tiled step saves at most one more row tensor (the last
    region's output) than the untiled one."""
    from effpass.passes import InjectLoRA, QuantizeLinear

    seq = 96
    model, inputs = _qlora_llama(seq)
    extra = ([QuantizeLinear(scheme=scheme, exclude=("lm_head",))] if scheme else []) + [
        InjectLoRA(targets=("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"), rank=4), CheckpointActivations(policy=ckpt)]
    probe = effpass.get_pass_class("record_saved_for_backward")()
    saved, grads, ref = {}, {}, None
    for name, tiles in (("untiled", []), ("tiled", [TileSequence(tile_rows=32)])):
        torch._dynamo.reset()
        _SAVED.clear()
        m = effpass.compile(copy.deepcopy(model), passes=[FuseAttention()] + extra + tiles + [probe], lowering="eager")
        if ref is None:
            ref = m
        else:  # the same adapters' initial values
            m.load_state_dict(ref.state_dict())
        grads[name] = _grads(m, inputs, lambda o: o.loss)
        saved[name] = list(_SAVED)
        if tiles:
            st = effpass.report(m).stats("tile_sequence")
            # the block's MLP region, and the final norm + output head (it widens 64 -> 128: the loss is not fused)
            assert st["regions"] == 2 and st["tiles"] == 6, st
            # nodes a tile copied that read no row (a weight's transpose, cast or dequantization): every tile of
            # a region copies the same ones (3 tiles per region), at least one per linear it holds (3 in each MLP
            # tile, lm_head in each head tile)
            per_tile = 3 + 1
            assert st["weight_nodes_left"] % 3 == 0 and st["weight_nodes_left"] >= 3 * per_tile, st
            if scheme:
                assert effpass.report(m).stats("quantize_linear", "module")["quantized"] >= 7
    (l0, g0), (l1, g1) = grads["untiled"], grads["tiled"]
    assert any("lora" in n for n in g0) and g0.keys() == g1.keys()
    assert abs(l0 - l1) <= 1e-6 * abs(l0)
    assert max(_rel(g1[n], g0[n]) for n in g0) <= 1e-6

    def weights_only(rows):  # saved values without a sequence dimension: computed from weights alone
        return sorted((s, str(d), b) for s, d, b in rows if seq not in s)

    assert weights_only(saved["tiled"]) == weights_only(saved["untiled"]), (weights_only(saved["tiled"]),
                                                                            weights_only(saved["untiled"]))
    row_bytes = {k: sum(b for s, _, b in v if seq in s) for k, v in saved.items()}
    assert row_bytes["tiled"] <= row_bytes["untiled"] + seq * 64 * 4, row_bytes
