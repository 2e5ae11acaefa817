"""pack_sequences: packed rows equal the examples run alone, on several Hugging Face families.

Oracles: numerical (each example's logits vs the example run alone, 1e-5 relative in fp32; the loss vs the
token-weighted loss of separate runs; gradients vs the padded batch with padding masked; other examples
bit-unchanged when one changes) and structural (the pass's statistics: attention sites rewritten, the
boundary it used; recompiles and graph breaks counted by Dynamo)."""
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.exc import BackendCompilerFailed

import effpass
from effpass.passes import (ApplyAutocast, CheckpointActivations, FuseAttention, InjectLoRA, PackSequences)
from effpass.passes.pack_sequences import packing_stats
from effpass.testing import dynamo_counters, model_case

VOCAB = 128
LENS = [5, 9, 3]


def _family(name: str, attn: str = "eager", layers: int = 1) -> nn.Module:
    """A tiny random-weight model of a Hugging Face family."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=64)
    if name == "llama":
        cfg, cls = tf.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common), tf.LlamaForCausalLM
    elif name == "gpt2":
        cfg, cls = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                                 bos_token_id=0, eos_token_id=0), tf.GPT2LMHeadModel
    elif name == "falcon_alibi":
        cfg, cls = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   alibi=True, multi_query=False, new_decoder_architecture=False), tf.FalconForCausalLM
    elif name == "qwen2":
        cfg, cls = tf.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common), tf.Qwen2ForCausalLM
    elif name == "gemma2":  # soft-capped scores: fuse_attention leaves it alone, pack_sequences masks the softmax
        cfg, cls = tf.Gemma2Config(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                   **common), tf.Gemma2ForCausalLM
    elif name == "bert":  # an encoder: block-diagonal and bidirectional
        cfg, cls = tf.BertConfig(intermediate_size=64, **common), tf.BertForMaskedLM
    else:  # pragma: no cover
        raise ValueError(name)
    cfg._attn_implementation = attn
    model = cls(cfg)
    model.set_attn_implementation(attn)
    return model.eval()


def _packed(lens=LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


def _alone(ref, ids, lens):
    out, s = [], 0
    for n in lens:
        with torch.no_grad():
            out.append(ref(input_ids=ids[:, s:s + n]).logits)
        s += n
    return out


def _assert_rel(actual, expected, tol, what):
    err = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:g}"


def _stats(compiled):
    return effpass.report(compiled).stats("pack_sequences")


# ------------------------------------------------------------------------------------------------------
# five families: each example equals the example alone; the others are bit-unchanged when one changes
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,attn,path", [
    ("llama", "eager", "sdpa_rewritten"),        # hand-written -> fuse_attention -> block-diagonal SDPA; rotary
    ("gpt2", "sdpa", "sdpa_rewritten"),          # the model's own SDPA; learned position embeddings
    ("falcon_alibi", "eager", "sdpa_rewritten"),  # in-place /= *= and ALiBi; fused then packed
    ("gemma2", "eager", "softmax_masked"),       # soft-capping (tanh): not fused, the softmax is masked
    ("bert", "sdpa", "sdpa_rewritten"),          # encoder: bidirectional within each example
])
def test_each_packed_example_equals_the_example_alone(name, attn, path):
    model = _family(name, attn)
    ref = copy.deepcopy(model)
    ids, pos = _packed()
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    with dynamo_counters() as counters, torch.no_grad():
        out = compiled(input_ids=ids, position_ids=pos).logits
        changed = ids.clone()
        changed[0, LENS[0]:LENS[0] + LENS[1]] = (changed[0, LENS[0]:LENS[0] + LENS[1]] + 7) % VOCAB  # example 2
        out2 = compiled(input_ids=changed, position_ids=pos).logits
    s = 0
    for i, (n, want) in enumerate(zip(LENS, _alone(ref, ids, LENS))):
        _assert_rel(out[:, s:s + n], want, 1e-5, f"{name} example {i}")   # positions restart per example too
        s += n
    assert torch.equal(out2[:, :LENS[0]], out[:, :LENS[0]]), "example 1 changed when example 2 did"
    assert torch.equal(out2[:, LENS[0] + LENS[1]:], out[:, LENS[0] + LENS[1]:]), "example 3 changed"
    assert not torch.equal(out2[:, LENS[0]:LENS[0] + LENS[1]], out[:, LENS[0]:LENS[0] + LENS[1]])
    stats = _stats(compiled)
    assert stats[path] == 1 and stats["skipped"] == 0 and stats["boundary_position_ids"] == 1, stats
    assert counters["graph_breaks"] == 0 and counters["recompiles"] == 0, counters
    # without the pass the same packed row mixes the examples (the bug this pass fixes)
    with torch.no_grad():
        plain = ref(input_ids=ids, position_ids=pos).logits
    assert (plain[:, LENS[0]:] - out[:, LENS[0]:]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------
# loss, gradients, dynamic lengths
# ------------------------------------------------------------------------------------------------------
def test_loss_gradients_and_no_recompile_across_packed_lengths():
    """Loss = token-weighted loss of the examples alone; gradients = padded batch with padding masked
    (1e-4); four packed lengths compile one graph: the boundary hook runs eagerly and marks the packed
    length dynamic from the first call (no recompile; the issue allows at most one), no graph break."""
    model = _family("llama", "eager").train()
    padded_model = copy.deepcopy(model)
    ids, pos = _packed()
    labels = ids.clone()
    starts = torch.tensor([0, LENS[0], LENS[0] + LENS[1]])
    labels[0, starts] = -100  # what DataCollatorWithFlattening does: no prediction across examples
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    with dynamo_counters() as counters:
        loss = compiled(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
        for lens, seed in (([4, 12, 6, 2], 3), ([20, 7], 4), ([3] * 9, 5)):  # other packed lengths
            i2, p2 = _packed(lens, seed=seed)
            compiled(input_ids=i2, position_ids=p2, labels=i2.clone()).loss.backward()  # own tensor (no alias)
    # one Dynamo frame (the model: the hook's frame runs eagerly), compiled once, never again
    assert counters == {"graph_breaks": 0, "unique_graphs": 1, "recompiles": 0, "frames": 1}, counters
    assert _stats(compiled)["length_marked_dynamic"] == 1
    # the reference: the same examples as a right-padded batch, padding masked
    width = max(LENS)
    rows, mask, plabels, s = [], [], [], 0
    for n in LENS:
        row = torch.zeros(width, dtype=torch.long)
        row[:n] = ids[0, s:s + n]
        rows.append(row)
        mask.append((torch.arange(width) < n).long())
        lab = row.clone()
        lab[n:] = -100
        plabels.append(lab)
        s += n
    padded_model.zero_grad()
    ref_loss = padded_model(input_ids=torch.stack(rows), attention_mask=torch.stack(mask),
                            labels=torch.stack(plabels), use_cache=False).loss
    # token-weighted: every example contributes (len - 1) predictions
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    ref_loss.backward()
    model.zero_grad()
    compiled(input_ids=ids, position_ids=pos, labels=labels).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), padded_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"grad {n}: {m}")
    # one graph (symbolic length) rewritten
    records = [r for r in effpass.report(compiled).records("pack_sequences") if r.phase == "torch_ir" and r.changed]
    assert len(records) == 1 and records[0].stats["sdpa_rewritten"] == 1


def test_cu_seq_lens_without_position_ids_and_flash_kwargs_are_used():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False): boundaries from
    cu_seq_lens_q; the Python-int max_length_q/k are dropped (they would recompile every step)."""
    model = _family("qwen2", "sdpa")
    ref = copy.deepcopy(model)
    ids, _ = _packed()
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[PackSequences()], lowering="eager", strict=True)
    with torch.no_grad(), dynamo_counters() as counters:
        out = compiled(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
        lens2 = [4, 12, 6, 2]  # another length and another number of examples: no recompile either
        ids2, _ = _packed(lens2, seed=2)
        cu2 = torch.tensor([0, 4, 16, 22, 24], dtype=torch.int32)
        out2 = compiled(input_ids=ids2, cu_seq_lens_q=cu2, cu_seq_lens_k=cu2, max_length_q=12, max_length_k=12).logits
    assert counters["recompiles"] == 0 and counters["graph_breaks"] == 0 and counters["frames"] == 1, counters
    for o, i, lens in ((out, ids, LENS), (out2, ids2, lens2)):
        s = 0
        for n, want in zip(lens, _alone(ref, i, lens)):
            _assert_rel(o[:, s:s + n], want, 1e-5, "qwen2 via cu_seq_lens")
            s += n
    assert _stats(compiled)["sdpa_rewritten"] == 1


# ------------------------------------------------------------------------------------------------------
# with the other passes; with Trainer + DataCollatorWithFlattening and TRL's padding-free collator
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", [True])  # fp32 exactness is covered above; [False, True] checks both
def test_with_lora_checkpointing_and_autocast(autocast):
    """inject_lora + fuse_attention + pack_sequences + checkpoint_activations (+ apply_autocast bf16): every
    example within 1e-5 (fp32) / 3e-2 (bf16) of the same prepared model run on the example alone."""
    ids, pos = _packed()
    if True:
        model = _family("llama", "eager").train()
        passes = [InjectLoRA(rank=4, targets=["*.q_proj", "*.v_proj"]), FuseAttention(), PackSequences(),
                  CheckpointActivations()]
        if autocast:
            passes.append(ApplyAutocast(dtype="bfloat16"))
        torch._dynamo.reset()
        compiled = effpass.compile(model, passes=passes, lowering="eager", strict=True)
        ref = copy.deepcopy(model)  # prepared (LoRA injected, hook installed): the eager reference
        out = compiled(input_ids=ids, position_ids=pos).logits
        out.float().pow(2).mean().backward()
        assert any(p.grad is not None for n, p in model.named_parameters() if "lora" in n)
        s = 0
        for n in LENS:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                want = ref(input_ids=ids[:, s:s + n], position_ids=torch.arange(n)[None]).logits.float()
            _assert_rel(out[:, s:s + n].float(), want, 3e-2 if autocast else 1e-5, f"autocast={autocast}")
            s += n
        assert _stats(compiled)["sdpa_rewritten"] == 1


def test_trainer_with_flattening_collator_and_trl_padding_free(tmp_path):
    """Plain Trainer on an effpass-compiled model with DataCollatorWithFlattening: the first step's loss is
    the token-weighted loss of the examples alone. TRL's padding-free collator builds the same batch."""
    import transformers as tf
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = _family("llama", "eager")
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    examples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in LENS]
    batch = tf.DataCollatorWithFlattening()(examples)
    trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    assert torch.equal(trl_batch["position_ids"], batch["position_ids"])
    assert torch.equal(trl_batch["input_ids"], batch["input_ids"])
    torch._dynamo.reset()
    effpass.prepare(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    model.compile(backend=effpass.backend_of(model))  # in place: Trainer keeps reading forward's signature

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(examples)

        def __getitem__(self, i):
            return examples[i]

    losses = []

    class Record(tf.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1,
                                logging_steps=1, learning_rate=0.0, report_to=[], use_cpu=True,
                                save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = tf.Trainer(model=model, args=args, train_dataset=Data(), data_collator=tf.DataCollatorWithFlattening(),
                         callbacks=[Record()])
    trainer.train()
    # the token-weighted loss of the examples run alone
    total, count = 0.0, 0
    for ex in examples:
        t = torch.tensor([ex["input_ids"]])
        with torch.no_grad():
            total += ref(input_ids=t, labels=t).loss.item() * (t.shape[1] - 1)
        count += t.shape[1] - 1
    assert losses and abs(losses[0] - total / count) < 1e-4 * (total / count), (losses, total / count)
    assert effpass.report(model).stats("pack_sequences")["sdpa_rewritten"] == 1


def test_trl_sft_trainer_padding_free(tmp_path):
    """TRL's SFTTrainer(padding_free=True) on an effpass model with pack_sequences: every step's logged loss is
    the token-weighted loss of that step's examples run alone (an untouched eager copy: per-example
    separation), effpass's rewritten graph runs (no graph break), and the report counts the packed steps. TRL's collator also sends cu_seq_lens_q/k,
    max_length_q/k (Python ints, dropped by the hook) and seq_idx."""
    import transformers as tf

    from effpass.testing.hf import examples_alone_losses, sft_padding_free

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = model_case("llama", layers=1).model.train()   # vocabulary 256, the tiny tokenizer's
    ref = copy.deepcopy(model)
    effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    with dynamo_counters() as counters:  # uneven lengths: each step packs a different total length
        losses, batches, _ = sft_padding_free(model, tmp_path, [3, 11, 6, 8, 2, 14, 5, 9], steps=2)
    assert len(losses) == 2 and len(batches) == 2
    assert batches[0]["input_ids"].shape != batches[1]["input_ids"].shape  # two packed lengths
    for b in batches:
        assert int((b["position_ids"] == 0).sum()) == 4 and (b["labels"][b["position_ids"] == 0] == -100).all()
    for loss, want in zip(losses, examples_alone_losses(ref, batches)):
        assert abs(loss - want) <= 1e-4 * want, (loss, want)
    # TRL's fused LM head runs as effpass's opaque custom op (effpass/integrations/_trl_kernels.py), so its
    # Python loop over token chunks does not fix the packed length (tests/integrations/test_trl_kernels.py: many lengths)
    assert counters["graph_breaks"] == 0 and counters["recompiles"] <= 1 and counters["frames"] <= 2, counters
    st = effpass.report(model).stats("pack_sequences")
    assert st["sdpa_rewritten"] >= 1 and st["packed_steps"] == 2 and st["packed_examples"] == 8, st
    # Dynamo compiled TRL's forward (the model's call) through effpass: the rewritten graph is what ran
    assert counters["unique_graphs"] >= 1 and all(g.belongs_to(model) for g in effpass.report(model).graphs)


# ------------------------------------------------------------------------------------------------------
# bad input: clear errors
# ------------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    model = _family("llama", "sdpa").train()
    effpass.prepare(model, passes=[PackSequences()], lowering="eager")  # the hook runs eagerly too
    ids, pos = _packed()
    with pytest.raises(ValueError, match="without example boundaries"):
        model(input_ids=ids)                                    # packed, but nothing says where examples start
    bad = pos.clone()
    bad[0, 7] = 3                                               # not a restart of 0..n-1
    with pytest.raises(RuntimeError, match="not restarts of 0..n-1"):
        model(input_ids=ids, position_ids=bad)
    long_ids = torch.randint(1, VOCAB, (1, 70))
    with pytest.raises(RuntimeError, match="longer than the model's maximum of 64"):
        model(input_ids=long_ids, position_ids=torch.arange(70)[None])
    model.eval()
    model(input_ids=ids)                                        # not training: an ordinary call is fine
    # models that cannot follow per-example positions, or that mix tokens outside attention
    with pytest.raises(ValueError, match="takes no position_ids"):
        demo = model_case("demo", layers=1).model
        effpass.prepare(demo, passes=[PackSequences()], lowering="eager")
        demo(tokens=ids, position_ids=pos)

    class ConvLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.mix = nn.Conv1d(8, 8, kernel_size=4, padding=3)
            self.rnn = nn.GRU(8, 8)

        def forward(self, input_ids, position_ids=None):
            return self.mix(self.emb(input_ids).transpose(1, 2))

    with pytest.raises(ValueError, match=r"mix tokens across positions.*mix \(convolution Conv1d.*rnn \(recurrent"):
        effpass.prepare(ConvLM(), passes=[PackSequences()], lowering="eager")
    with pytest.raises(ValueError, match="max_positions must be >= 0"):
        PackSequences(max_positions=-1)


def test_packing_statistics_in_the_report_and_the_dump_without_host_sync(tmp_path):
    """Examples per row, padding avoided and attention FLOPs (block-diagonal vs dense) in
    effpass.report(model).stats('pack_sequences') and in the dump's index.json, counted on device: a step
    reads nothing back to the host (no aten._local_scalar_dense, what .item()/bool() dispatch to)."""
    import json

    from torch.utils._python_dispatch import TorchDispatchMode

    model = _family("llama", "eager", layers=1).train()  # the figures per layer: one layer counts them
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True,
                               dump_dir=str(tmp_path))
    batches = [_packed([5, 9, 3], seed=1), _packed([4, 12, 6, 2], seed=2)]
    i, p = batches[0]
    compiled(input_ids=i, position_ids=p, labels=i.clone()).loss.backward()  # compiles

    class HostReads(TorchDispatchMode):
        ops: list = []

        @classmethod
        def ignore_compile_internals(cls):
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with HostReads() as mode, dynamo_counters() as counters:
        i, p = batches[1]
        compiled(input_ids=i, position_ids=p, labels=i.clone()).loss.backward()
    assert counters["recompiles"] == 0 and counters["frames"] == 0, counters
    assert len(mode.ops) > 50 and torch.ops.aten._local_scalar_dense.default not in mode.ops
    with torch.no_grad():  # an evaluation forward is not a training step: not counted
        compiled(input_ids=i, position_ids=p, labels=i.clone())
    st = _stats(compiled)
    # 1 layer x 4 heads x (q.k + p.v, head dim 8): 2*4*(8+8) FLOPs per attended pair, per layer
    per_pair = 1 * 2 * 4 * (8 + 8)
    pairs_block = (15 + 45 + 6) + (10 + 78 + 21 + 3)                  # causal: sum of len*(len+1)/2
    pairs_dense = 17 * 18 // 2 + 24 * 25 // 2
    want = {"packed_steps": 2, "packed_rows": 2, "packed_examples": 7, "examples_per_row": 3.5,
            "packed_tokens": 41, "padding_tokens_avoided": (3 * 9 - 17) + (4 * 12 - 24),
            "attention_flops_block_diagonal": per_pair * pairs_block, "attention_flops_dense": per_pair * pairs_dense}
    assert {k: st[k] for k in want} == want, st
    assert st["attention_flops_ratio"] == pytest.approx(pairs_block / pairs_dense)
    # the module phase: one boundary hook; Llama's forward takes position_ids; positions bounded by its config
    assert st["boundary_hook"] == 1 and st["position_ids_accepted"] == 1, st
    assert st["max_positions"] == model.config.max_position_embeddings > 0, st
    # the host helper (for logging a batch) agrees, batch by batch
    host = [packing_stats({"position_ids": p}, attention_layers=1, heads=4, head_dim=8) for _, p in batches]
    assert sum(h["attention_flops_block_diagonal"] for h in host) == want["attention_flops_block_diagonal"]
    assert sum(h["padding_tokens_avoided"] for h in host) == want["padding_tokens_avoided"]
    # the dump: the module phase's index.json holds the figures as of the last effpass.report call
    module = json.load(open(tmp_path / "module" / "index.json"))
    rec = next(r for r in module["passes"] if r["name"] == "pack_sequences")
    assert {k: rec["stats"][k] for k in want} == want
    graph = next(r for d in tmp_path.glob("graph_*") for r in json.load(open(d / "index.json"))["passes"]
                 if r["name"] == "pack_sequences" and r["phase"] == "torch_ir")
    assert graph["stats"]["attention_flops_per_pair"] == per_pair and graph["stats"]["sdpa_rewritten"] == 1
    cu = packing_stats({"cu_seq_lens_q": torch.tensor([0, 5, 14, 17, 18])})
    assert cu["examples"] == 4 and cu["tokens"] == 18
    with pytest.raises(ValueError, match="no example boundaries"):
        packing_stats({"input_ids": i})


# ------------------------------------------------------------------------------------------------------
# packing cannot fail open: the three mechanisms that leaked, on real families and on self-written models
# ------------------------------------------------------------------------------------------------------
class _Out:
    def __init__(self, logits, loss):
        self.logits, self.loss = logits, loss


class _ToyLM(nn.Module):
    """A plain-PyTorch causal LM with one of the mechanisms that made packing leak:
    ``"break"``: a layer-drop check (``torch.rand([]) < p``, as OPT) splits each layer into its own graph,
    which has no ``position_ids``; ``"sinks"``: a learned sink column concatenated to the scores (N x (N+1),
    as GPT-OSS); ``"positions"``: a chunked local mask and a query temperature computed from ``arange(N)``
    (absolute row positions, as Llama 4)."""

    def __init__(self, mechanism: str, d: int = 16, heads: int = 2, layers: int = 2, chunk: int = 4):
        super().__init__()
        self.mechanism, self.heads, self.chunk = mechanism, heads, chunk
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(64, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.sinks = nn.Parameter(torch.randn(layers, heads))
        self.head = nn.Linear(d, VOCAB)
        self.layerdrop = 1e-9

    def attend(self, i, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv[i](x).chunk(3, -1))
        idx = torch.arange(n, device=x.device)
        allowed = idx[None, :] <= idx[:, None]
        if self.mechanism == "positions":
            allowed = allowed & ((idx[None, :] // self.chunk) == (idx[:, None] // self.chunk))
            q = q * (torch.log1p(torch.floor((idx.float() + 1) / 2)) * 0.5 + 1)[:, None]
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if self.mechanism == "sinks":
            sink = self.sinks[i].view(1, -1, 1, 1).expand(b, -1, n, 1)
            p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            p = scores.softmax(-1)
        return self.out[i]((p @ v).transpose(1, 2).reshape(b, n, d))

    def forward(self, input_ids, position_ids=None, labels=None):
        n = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        for i in range(len(self.qkv)):
            if self.mechanism == "break" and self.training and torch.rand([]) < self.layerdrop:
                continue  # a data-dependent branch: Dynamo breaks the graph here
            x = x + self.attend(i, x)
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                               ignore_index=-100)
        return _Out(logits, loss)


def _hf_maker(name: str):
    import transformers as tf

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfgs = {
        "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0, pad_token_id=1,
            dropout=0.0, attention_dropout=0.0, layerdrop=1e-9)),  # > 0: the layer-drop branch is taken in training
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(
            base, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])),
        "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM, dict(
            base, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
            attention_chunk_size=4, no_rope_layers=[1, 0], interleave_moe_layer_step=1, attn_temperature_tuning=True,
            floor_scale=2, attn_scale=0.5, layer_types=["chunked_attention", "full_attention"])),
    }
    cfg_cls, cls, kw = cfgs[name]

    def make():
        torch.manual_seed(0)
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = "eager"
        m = cls(cfg)
        m.set_attn_implementation("eager")
        return m
    return make


def _toy_maker(mechanism):
    def make():
        torch.manual_seed(0)
        return _ToyLM(mechanism)
    return make


@pytest.mark.parametrize("maker,stat", [
    pytest.param(lambda: _hf_maker("opt"), "boundary_from_context", id="opt-graph-break"),
    pytest.param(lambda: _toy_maker("break"), "boundary_from_context", id="toy-graph-break"),
    pytest.param(lambda: _hf_maker("gpt_oss"), "sink_columns_kept", id="gpt_oss-sinks"),
    pytest.param(lambda: _toy_maker("sinks"), "sink_columns_kept", id="toy-sinks"),
    pytest.param(lambda: _hf_maker("llama4"), "positions_per_example", id="llama4-chunked-temperature"),
    pytest.param(lambda: _toy_maker("positions"), "positions_per_example", id="toy-chunked-temperature"),
])
def test_mechanisms_that_leaked_are_isolated(maker, stat):
    """Each example's logits, the loss and every gradient equal the examples run alone (training mode), and
    the statistics say which mechanism the pass handled; plain eager on the same packed row leaks."""
    from effpass.testing.packing import packed_vs_alone

    r = packed_vs_alone(maker(), [FuseAttention(), PackSequences()], lens=(5, 9, 7))
    assert max(r.logits_err) <= 1e-5 and r.loss_err <= 1e-5 and r.grad_err <= 1e-4, r
    assert r.stats[stat] >= 1 and r.stats["skipped"] == 0, r.stats
    assert r.stats["sdpa_rewritten"] + r.stats["softmax_masked"] >= 1, r.stats
    assert r.plain_err > 1e-3, "the packed row does not leak without the pass: the test would not catch a leak"


def test_graph_without_boundary_outside_a_packed_call_is_unchanged():
    """A graph that reads the per-call context computes what the model does when the call is not packed
    (evaluation without boundaries), and the context of an earlier packed call is not reused."""
    model = _toy_maker("break")()
    ref = copy.deepcopy(model)
    model.train()
    ref.train()
    ids, pos = _packed()
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[PackSequences(require_boundaries=False)], lowering="eager",
                               strict=True)
    compiled(input_ids=ids, position_ids=pos)  # a packed call sets the context
    out = compiled(input_ids=ids).logits       # then one that is not packed
    _assert_rel(out, ref(input_ids=ids).logits, 1e-5, "unpacked call after a packed one")
    assert _stats(compiled)["boundary_from_context"] >= 1


def test_prepared_model_inside_the_users_compiled_step_with_a_graph_break():
    """The boundary hook traced inline into the user's own compiled function (whose inputs have other names):
    the op that sets the per-call context is the boundary, and the graphs after the layer-drop break read it."""
    model = _toy_maker("break")().train()
    ref = copy.deepcopy(model)
    effpass.prepare(model, passes=[PackSequences()], lowering="eager")   # the boundary, not Inductor, is tested
    torch._dynamo.reset()

    @torch.compile(backend=effpass.backend_of(model))
    def step(a, b):
        return model(input_ids=a, position_ids=b).logits

    ids, pos = _packed()
    out = step(ids, pos)
    s = 0
    for i, n in enumerate(LENS):
        _assert_rel(out[:, s:s + n], ref(input_ids=ids[:, s:s + n]).logits, 1e-5, f"example {i}")
        s += n
    stats = _stats(model)
    assert stats["boundary_from_context"] >= 1 and stats["softmax_masked"] >= 2 and stats["skipped"] == 0, stats


def test_absolute_positions_with_several_rows_and_unisolated_sites_raise():
    """Fail closed: a chunked mask from absolute positions with two packed rows (one position vector cannot
    stand for both), and an attention site left out by ``exclude``, raise WrongResultError naming the site and
    the graph, at compile time in the packed call and again at the next packed call; never a warning."""
    model = _toy_maker("positions")().train()
    ids = torch.randint(1, VOCAB, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[PackSequences()], lowering="eager", strict=True)
    # NOTE: raised while Dynamo compiles the first call, so Dynamo wraps it (inner_exception is ours)
    with pytest.raises(BackendCompilerFailed, match=r"absolute row positions.*2 rows") as e:
        compiled(input_ids=ids, position_ids=pos)
    assert isinstance(e.value.inner_exception, effpass.WrongResultError)
    assert "graph #1 (inputs" in str(e.value) and "<root>:p in" in str(e.value)
    with pytest.raises(effpass.WrongResultError, match="could not be made block-diagonal"):
        compiled(input_ids=ids, position_ids=pos)
    assert _stats(compiled)["packed_steps"] == 0  # training calls that raised are not reported as packed
    # one row per call is isolated (the substitution), several rows of the causal-only toy need none
    model = _toy_maker("sinks")()
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[PackSequences()], lowering="eager", strict=True)
    compiled(input_ids=ids, position_ids=pos)
    assert _stats(compiled)["positions_per_example"] == 0 and _stats(compiled)["softmax_masked"] == 2
    # an attention site left out by exclude
    model = _family("llama")
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences(exclude=["model.layers.0.*"])],
                               lowering="eager", strict=True)
    ids, pos = _packed()
    with pytest.raises(BackendCompilerFailed, match=r"model.layers.0.self_attn.*excluded by targets/exclude"):
        compiled(input_ids=ids, position_ids=pos)


# ------------------------------------------------------------------------------------------------------
# Inductor and GPU
# ------------------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_packed_llama_with_inductor():
    model = _family("llama", "eager")
    ref = copy.deepcopy(model)
    ids, pos = _packed()
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[FuseAttention(), PackSequences()], strict=True)
    with torch.no_grad():
        out = compiled(input_ids=ids, position_ids=pos).logits
    s = 0
    for n, want in zip(LENS, _alone(ref, ids, LENS)):
        _assert_rel(out[:, s:s + n], want, 1e-4, "inductor")
        s += n


class _SdpaLM(nn.Module):
    """Self-written causal LM whose attention is ``F.scaled_dot_product_attention(is_causal=True)`` with no mask:
    the sites torch's varlen kernel can take."""

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(64, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, position_ids=None):
        b, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, -1))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(a.transpose(1, 2).reshape(b, n, -1))
        return _Out(self.head(x), None)


@pytest.mark.gpu
def test_torch_varlen_on_gpu():
    """Ran on an H100 (2026-11-27) in its first form: a Hugging Face Llama got SDPA with the block-diagonal mask,
    not the varlen kernel, because transformers builds a mask from packed ``position_ids`` (the site has a mask;
    the pass ANDs it rather than proving it causal). Now: the self-written unmasked causal model takes the varlen
    kernel at every layer; the HF model stays correct on the masked path."""
    pytest.importorskip("torch.nn.attention.varlen")
    ids, pos = (t.cuda() for t in _packed())
    for model, want_varlen in ((_SdpaLM(), 2), (_family("llama", "sdpa"), 0)):
        torch.manual_seed(0)
        model = model.cuda().to(torch.bfloat16)
        ref = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = effpass.compile(model, passes=[PackSequences()], lowering="eager", strict=True)
        with torch.no_grad():
            out = compiled(input_ids=ids, position_ids=pos).logits.float()
        s = 0
        for n, want in zip(LENS, _alone(ref, ids, LENS)):
            _assert_rel(out[:, s:s + n], want.float(), 3e-2, f"{type(model).__name__} packed on CUDA")
            s += n
        st = _stats(compiled)
        assert st["varlen"] == want_varlen and st["sdpa_rewritten"] >= 1 and st["skipped"] == 0, st
