"""TRL's fused LM-head kernel (trl.kernels.ChunkedLogProbFunction) as effpass's opaque custom op
(effpass/integrations/_trl_kernels.py): the op's numbers are TRL's, and a compiled SFTTrainer(padding_free=True)
step does not recompile for every packed length."""
import copy

import pytest
import torch

import effpass
from effpass.integrations import _trl_kernels
from effpass.integrations.huggingface import allow_trl_kernels
from effpass.testing import dynamo_counters, model_case
from effpass.passes import FuseAttention, PackSequences

import trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS, ChunkedLogProbFunction

ALL = ("log_probs",) + OPTIONAL_OUTPUTS


def _run(fn, h, w, b, t, dtype, **kw):
    """Outputs and gradients of one call: loss = sum(logprobs) + 0.3 * sum(entropy) when entropy is asked for."""
    x, y = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    z = b.to(dtype).requires_grad_() if b is not None else None
    out = fn(x, y, z, t, kw.get("temperature", 1.0), kw.get("chunk", 16), kw.get("softcap"), kw.get("scale", 1.0),
             kw.get("outputs", ALL))
    loss = out[0].sum() + (0.3 * out[1].sum() if out[1] is not None else 0)
    loss.backward()
    return [o.detach() if o is not None else None for o in out] + [x.grad, y.grad, z.grad if z is not None else None]


@pytest.mark.parametrize("case", [
    dict(n=37, bias=True, softcap=5.0, scale=0.7, temperature=0.9, chunk=16, outputs=ALL),
    dict(n=5, bias=False, chunk=64, outputs=("log_probs",)),  # vocabulary in one tile, log-probs only
    dict(n=4100, bias=False, chunk=32, outputs=("log_probs", "entropy")),  # two token chunks (4096 + 4)
])
def test_op_matches_trl_function(case):
    """Forward outputs and gradients of hidden, weight, bias: the op equals TRL's Function bit for bit (fp32),
    and within 1e-6 under bf16 autocast (TRL's compute dtype follows autocast in both)."""
    assert _trl_kernels.install() and trl_utils._ChunkedLogProbFunction is _trl_kernels.ChunkedLogProb
    g = torch.Generator().manual_seed(case["n"])
    h, w = torch.randn(case["n"], 24, generator=g), torch.randn(50, 24, generator=g) * 0.3
    b = torch.randn(50, generator=g) if case["bias"] else None
    t = torch.randint(0, 50, (case["n"],), generator=g)
    kw = {k: case[k] for k in ("softcap", "scale", "temperature", "chunk", "outputs") if k in case}
    want = _run(ChunkedLogProbFunction.apply, h, w, b, t, torch.float32, **kw)
    got = _run(_trl_kernels.chunked_logprob, h, w, b, t, torch.float32, **kw)
    assert len(want) == len(got) == 8
    for name, a, c in zip(list(ALL) + ["grad_hidden", "grad_weight", "grad_bias"], want, got):
        assert (a is None) == (c is None), name
        if a is not None:
            assert a.dtype == c.dtype and a.shape == c.shape and torch.equal(a, c), name
    if case["n"] == 37:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _run(ChunkedLogProbFunction.apply, h, w, b, t, torch.float32, **kw)
            got = _run(_trl_kernels.chunked_logprob, h, w, b, t, torch.float32, **kw)
        ref32 = _run(ChunkedLogProbFunction.apply, h, w, b, t, torch.float32, **kw)
        assert not torch.equal(want[0], ref32[0])  # autocast really changed TRL's compute dtype
        for a, c in zip(want, got):
            if a is not None:
                assert torch.allclose(a.float(), c.float(), rtol=1e-6, atol=0), (a - c).abs().max()


def test_opcheck_schema_fake_and_autograd():
    """torch.library.opcheck: schema, fake implementation (shapes), autograd registration and AOT dispatch
    with dynamic shapes, for both ops."""
    assert _trl_kernels.install()
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(9, 8, generator=g), torch.randn(20, 8, generator=g), torch.randn(20, generator=g)
    t = torch.randint(0, 20, (9,), generator=g)
    fwd = (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), t, 0.8, 8, 2.0, 1.0,
           "log_probs,entropy,is_top1", None)
    bwd = (h.detach(), w.detach(), b.detach(), t, torch.zeros(9), torch.zeros(9), torch.ones(9), None, 0.8, 8, 2.0,
           1.0, torch.float32, True, True, False)
    for op, args in ((torch.ops.effpass.trl_chunked_logprob.default, fwd),
                     (torch.ops.effpass.trl_chunked_logprob_backward.default, bwd)):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_op_flop_formulas():
    """The planner's FLOP formulas for TRL's op: forward 2*N*H*V; backward the projection again plus dx and dw."""
    from torch.utils.flop_counter import FlopCounterMode

    assert _trl_kernels.install()
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(20, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 20, (9,), generator=g)
    with FlopCounterMode(display=False) as fc:
        out = _trl_kernels.chunked_logprob(h, w, None, t, 1.0, 8, None, 1.0, ("log_probs",))[0]
    assert fc.get_total_flops() == 2 * 9 * 8 * 20
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    assert fc.get_total_flops() == 3 * 2 * 9 * 8 * 20


def test_op_compiles_once_for_every_length():
    """Compiled (aot_eager) with the op: one recompile (to a dynamic length) over 4 lengths, no graph break,
    loss and gradients equal to TRL's Function run eagerly."""
    assert _trl_kernels.install()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 16, generator=g)

    def step(x, y, t):
        return trl_utils._ChunkedLogProbFunction.apply(x, y, None, t, 1.0, 16, None, 1.0, ("log_probs",))[0].sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    with dynamo_counters() as counters:
        for n in (7, 9, 13, 21):
            h, t = torch.randn(n, 16, generator=g), torch.randint(0, 40, (n,), generator=g)
            got = _run(lambda x, y, z, t, *a: (compiled(x, y, t), None), h, w, None, t, torch.float32)
            want = _run(lambda x, y, z, t, *a: (step(x, y, t), None), h, w, None, t, torch.float32)
            assert all(torch.equal(a, c) for a, c in zip(got, want) if a is not None), n
    assert counters["graph_breaks"] == 0 and counters["recompiles"] == 1, counters


def test_install_falls_back_when_trl_kernel_is_unknown(monkeypatch):
    """A kernel whose signature differs, or a fused head that calls something else, is not wrapped:
    allow_trl_kernels keeps today's allow_in_graph and TRL's name is left alone."""
    assert _trl_kernels.install()
    monkeypatch.setitem(_trl_kernels._STATE, "installed", False)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ChunkedLogProbFunction)
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(lambda ctx, hidden, weight, targets: hidden))
    assert not _trl_kernels.install()
    assert allow_trl_kernels() == ["trl.kernels.ChunkedLogProbFunction"]
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    monkeypatch.undo()

    class Other(torch.autograd.Function):
        pass

    monkeypatch.setitem(_trl_kernels._STATE, "installed", False)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Other)
    assert not _trl_kernels.install() and trl_utils._ChunkedLogProbFunction is Other
    monkeypatch.undo()
    assert allow_trl_kernels() == ["effpass::trl_chunked_logprob", "trl.kernels.ChunkedLogProbFunction"]
    assert trl_utils._ChunkedLogProbFunction is _trl_kernels.ChunkedLogProb


def test_sft_trainer_padding_free_many_lengths(tmp_path, monkeypatch):
    """SFTTrainer(padding_free=True) over 4 steps of different packed lengths on an effpass model: each step's
    loss equals the token-weighted loss of its examples run alone in an untouched eager copy, with no graph
    break, at most one recompile (the length turns dynamic once), and TRL's kernel ran as effpass's op."""
    import transformers as tf

    from effpass.testing.hf import examples_alone_losses, sft_padding_free

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = model_case("llama", layers=1).model.train()
    ref = copy.deepcopy(model)
    effpass.compile(model, passes=[FuseAttention(), PackSequences()], lowering="eager", strict=True)
    # installed by the Trainer's first compiled call (allow_trl_kernels), as for a user
    monkeypatch.setitem(_trl_kernels._STATE, "installed", False)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ChunkedLogProbFunction)
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    words = [3, 11, 6, 8, 2, 14, 5, 9, 7, 4, 12, 9, 10, 6, 5, 21]  # each step of 4 packs a different length
    with dynamo_counters() as counters:
        losses, batches, _ = sft_padding_free(model, tmp_path, words, steps=4)
    assert _trl_kernels.installed()
    assert len(losses) == 4 and len(batches) == 4
    assert len({b["input_ids"].shape[1] for b in batches}) == 4, [b["input_ids"].shape for b in batches]
    for loss, want in zip(losses, examples_alone_losses(ref, batches)):
        assert abs(loss - want) <= 1e-4 * want, (loss, want)
    print("dynamo counters", counters)
    assert counters["graph_breaks"] == 0 and counters["recompiles"] <= 1, counters
    # every step ran TRL's forward and backward through effpass's op
    assert _trl_kernels.CALLS == {"forward": 4, "backward": 4}, _trl_kernels.CALLS


# ------------------------------------------------------------------------------------------------------
# TRL's preference / RL trainers end to end (issue 27): an effpass-compiled policy (and reference) trains
# with the eager losses, and the log-probs run as TRL's chunked op inside effpass's graph
# ------------------------------------------------------------------------------------------------------
def _words(g, n):
    from effpass.testing.hf import VOCAB

    return " ".join(f"w{i}" for i in torch.randint(0, VOCAB - 6, (n,), generator=g).tolist())


def _pref_dataset(kind, n=4):
    import datasets

    g = torch.Generator().manual_seed(0)
    if kind == "kto":
        return datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(n)],
                                           "completion": [_words(g, 5) for _ in range(n)],
                                           "label": [bool(i % 2) for i in range(n)]})
    if kind == "grpo":
        return datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(n)]})
    return datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(n)],
                                       "chosen": [_words(g, 5) for _ in range(n)],
                                       "rejected": [_words(g, 5) for _ in range(n)]})


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def _train_trl(kind, policy, ref, tmp_path, compile_ref=False):
    import trl
    from effpass.testing.hf import tiny_tokenizer

    common = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=0.1,
                  optim="sgd", logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True,
                  disable_tqdm=True, bf16=False, gradient_checkpointing=False)
    tok = tiny_tokenizer()
    data = _pref_dataset(kind)
    if kind == "dpo":
        cfg = trl.DPOConfig(**common, beta=0.1)
        tr = trl.DPOTrainer(model=policy, ref_model=ref, args=cfg, train_dataset=data, processing_class=tok)
    elif kind == "kto":
        cfg = trl.KTOConfig(**common, beta=0.1)
        tr = trl.KTOTrainer(model=policy, ref_model=ref, args=cfg, train_dataset=data, processing_class=tok)
    elif kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        cfg = ORPOConfig(**common, beta=0.1)
        tr = ORPOTrainer(model=policy, args=cfg, train_dataset=data, processing_class=tok)
    elif kind == "grpo":
        cfg = trl.GRPOConfig(**common, beta=0.04, num_generations=2, max_completion_length=4,
                             generation_batch_size=2)
        tr = trl.GRPOTrainer(model=policy, reward_funcs=_reward, args=cfg, train_dataset=data,
                             processing_class=tok)
        assert tr.ref_model is not None  # loaded by TRL from the policy's saved copy
        if compile_ref:
            effpass.compile(tr.ref_model, lowering="eager")
    tr.train()
    return [h["loss"] for h in tr.state.log_history if "loss" in h]


# NOTE(time): KTO (three forwards per step) and GRPO (generation with the compiled policy recompiles per
# length) take 40-160 s on the shared 2-core CPU under load: marked slow
@pytest.mark.parametrize("kind", ["dpo", pytest.param("kto", marks=pytest.mark.slow),
                                  pytest.param("grpo", marks=pytest.mark.slow), "orpo"])
def test_trl_trainer_end_to_end(kind, tmp_path, monkeypatch):
    """TRL's DPO / KTO / GRPO / ORPO trainer, 2 SGD steps on a tiny Llama: the effpass-compiled policy (and
    reference, compiled with effpass) gives the eager run's losses; DPO/KTO/GRPO's fused LM head is routed to
    effpass's fused ops (effpass/integrations/_trl_fused_head.py: TRL's kernel never runs); ORPO's trainer-side forward is routed so that the model returns log-probs, which
    fuse_cross_entropy fuses (effpass/integrations/_trl_orpo.py)."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    torch._dynamo.reset()
    base = model_case("llama", layers=1).model.train()
    if kind == "grpo":  # GRPO loads its reference from the policy's path
        base.save_pretrained(tmp_path / "base")
        base.config._name_or_path = str(tmp_path / "base")
    runs = {}
    for arm in ("eager", "effpass"):
        policy = copy.deepcopy(base)
        ref = copy.deepcopy(base).eval() if kind in ("dpo", "kto") else None
        if arm == "effpass":
            monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
            effpass.compile(policy, lowering="eager")
            if ref is not None:
                effpass.compile(ref, lowering="eager")
        runs[arm] = _train_trl(kind, policy, ref, tmp_path / arm, compile_ref=arm == "effpass")
        if arm == "effpass":
            st = effpass.report(policy).stats("fuse_cross_entropy")
            if kind == "orpo":  # TRL's trainer-side forward routed to effpass's own fused log-probs (_trl_orpo)
                assert st["logprob_sites"] >= 1 and st["rowwise_sites"] >= 1, st
                assert effpass.report(policy).module.notes["trl_orpo"]["routed_calls"] == 2
            else:  # TRL's fused head routed to effpass's fused ops (_trl_fused_head): TRL's kernel never runs
                assert st["trl_logprob_sites"] == 0 and st["logprob_sites"] + st["rowwise_sites"] >= 1, st
                assert effpass.report(policy).module.notes["trl_fused_head"]["routed_models"] == 1
                assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS
    eager, fused = runs["eager"], runs["effpass"]
    assert len(eager) == len(fused) == 2, (eager, fused)
    for a, b in zip(eager, fused):
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (eager, fused)
