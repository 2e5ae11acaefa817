"""TRL's DPO, KTO and GRPO trainers on effpass's fused ops (issue 40): the fused LM head TRL adds to the policy and
the reference (``add_fused_lm_head``) is routed for effpass-compiled models (effpass/integrations/_trl_fused_head.py),
so its per-token outputs are computed in the compiled graph and fused by fuse_cross_entropy (no logits, and not
TRL's kernel); the trainer's loss, every metric it logs and every gradient equal TRL's own method (fp32, 1e-5);
what cannot be routed runs TRL's kernel and the report says why."""
import copy

import pytest
import torch

import effpass
from effpass.integrations import _trl_fused_head, _trl_kernels
from effpass.passes import FuseAttention, FuseCrossEntropy, InjectLoRA, QuantizeLinear
from _trl_models import tiny_model

trl = pytest.importorskip("trl")


def _words(g, n):
    from effpass.testing.hf import VOCAB

    return " ".join(f"w{i}" for i in torch.randint(0, VOCAB - 6, (n,), generator=g).tolist())


def _dataset(kind, n=4):
    """Prompts and answers of different lengths: rows are padded, so masks matter."""
    import datasets

    g = torch.Generator().manual_seed(0)
    if kind == "kto":
        return datasets.Dataset.from_dict({"prompt": [_words(g, 3 + i) for i in range(n)],
                                           "completion": [_words(g, 5 - i % 3) for i in range(n)],
                                           "label": [bool(i % 2) for i in range(n)]})
    if kind in ("grpo", "rloo"):
        return datasets.Dataset.from_dict({"prompt": [_words(g, 3 + i % 2) for i in range(n)]})
    return datasets.Dataset.from_dict({"prompt": [_words(g, 3 + i) for i in range(n)],
                                       "chosen": [_words(g, 5 - i % 3) for i in range(n)],
                                       "rejected": [_words(g, 2 + i) for i in range(n)]})


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def _trainer(kind, policy, ref, tmp_path, peft_config=None, **extra):
    from effpass.testing.hf import tiny_tokenizer

    common = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, learning_rate=0.1,
                  optim="sgd", logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True,
                  disable_tqdm=True, bf16=False, gradient_checkpointing=False)
    common.update(extra)
    tok, data = tiny_tokenizer(), _dataset(kind)
    if kind == "dpo":
        tr = trl.DPOTrainer(model=policy, ref_model=ref, args=trl.DPOConfig(**common, beta=0.1), train_dataset=data,
                            processing_class=tok, peft_config=peft_config)
    elif kind == "kto":
        tr = trl.KTOTrainer(model=policy, ref_model=ref, args=trl.KTOConfig(**common, beta=0.1), train_dataset=data,
                            processing_class=tok, peft_config=peft_config)
    else:
        config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig,
                                                                                          trl.RLOOTrainer)
        cfg = config_cls(**common, beta=0.04, num_generations=2, max_completion_length=4, generation_batch_size=4,
                         temperature=0.7)
        tr = trainer_cls(model=policy, reward_funcs=_reward, args=cfg, train_dataset=data, processing_class=tok,
                         peft_config=peft_config)
    tr.current_gradient_accumulation_steps = 1  # set by train(); the step is called alone here
    return tr


def _perturbed(model, seed=1):
    """A reference that differs from the policy (so the log-ratios, rewards and margins are not all zero)."""
    ref = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return ref


def _step(tr, model, batch):
    model.zero_grad(set_to_none=True)
    loss = tr.training_step(model, batch)
    metrics = {k: list(v) for k, v in tr._metrics["train"].items() if k != "step_time"}
    return float(loss), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(want, got):
    (wl, wm, wg), (gl, gm, gg) = want, got
    assert abs(wl - gl) <= 1e-5 * max(abs(wl), 1e-2), (wl, gl)
    assert set(wm) == set(gm) and wm, (sorted(wm), sorted(gm))
    for k in wm:
        torch.testing.assert_close(torch.tensor(gm[k], dtype=torch.float64), torch.tensor(wm[k], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6, msg=k)
    assert set(gg) == set(wg) and gg
    for n in wg:
        torch.testing.assert_close(gg[n], wg[n], rtol=1e-5, atol=1e-7, msg=n)


def _fused_stats(model):
    recs = [r for r in effpass.report(model).records("fuse_cross_entropy") if r.phase == "torch_ir"
            and (r.stats.get("logprob_sites") or r.stats.get("rowwise_sites") or r.stats.get("trl_logprob_sites"))]
    assert recs, [r.stats for r in effpass.report(model).records("fuse_cross_entropy")]
    return recs


def _assert_routed(model, outputs):
    """Structural: the model's head routed, its graph(s) fused with nothing skipped, TRL's kernel not in them."""
    notes = effpass.report(model).module.notes["trl_fused_head"]
    assert notes["routed_models"] == 1 and notes["unrouted_models"] == 0 and notes["reasons"] == [], notes
    assert notes["outputs"] == list(outputs), notes
    for r in _fused_stats(model):
        st = r.stats
        assert st["trl_logprob_sites"] == 0 and st["skipped"] == 0 and st["logits_returned"] == 0, (st, r.skipped)
        assert st["logprob_sites"] + st["rowwise_sites"] == 1, st


def _trls_step(kind, family, tmp_path):
    """TRL's own step on eager copies of a policy and a perturbed reference: ``(policy, reference, TRL's trainer,
    the batch, the step's loss, metrics and gradients)``."""
    base = tiny_model(family)
    ref_base = _perturbed(base)
    want_tr = _trainer(kind, copy.deepcopy(base), copy.deepcopy(ref_base), tmp_path / "eager")
    batch = want_tr._prepare_inputs(next(iter(want_tr.get_train_dataloader())))
    assert (batch["attention_mask"] == 0).any()  # padded
    return base, ref_base, want_tr, batch, _step(want_tr, want_tr.model, batch)


def _eager_and_routed(kind, family, tmp_path):
    """TRL's step (:func:`_trls_step`), then the routed step on effpass-compiled copies, on the same batch:
    ``(TRL's trainer, its step, the routed trainer, its step)``."""
    base, ref_base, want_tr, batch, want = _trls_step(kind, family, tmp_path)
    policy = effpass.compile(copy.deepcopy(base), lowering="eager")
    ref = effpass.compile(copy.deepcopy(ref_base), lowering="eager")
    tr = _trainer(kind, policy, ref, tmp_path / "effpass")
    return want_tr, want, tr, _step(tr, policy, batch)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral"])
@pytest.mark.sweep
def test_dpo_step_routed_equals_trls(family, tmp_path, monkeypatch):
    """One DPOTrainer step, policy and a separate reference both effpass-compiled: the loss, every logged metric
    (rewards, margins, log-probs, entropy, mean logits, token accuracy, the router's loss for Mixtral) and every
    gradient equal TRL's own step on eager copies (its fused kernel), within 1e-5; both heads routed and fused
    (the policy's outputs in one trained row-wise op, the reference's log-probs in the log-prob op), TRL's kernel
    never called. Padded rows of different lengths; Qwen2 and Gemma 2 have tied heads, Gemma 2's soft-capped."""
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    want_tr, want, tr, got = _eager_and_routed("dpo", family, tmp_path)
    policy, ref = tr.model, tr.ref_model
    _assert_same(want, got)
    assert family != "mixtral" or got[1]["aux_loss"][0] > 0, got[1]
    assert abs(got[1]["rewards/margins"][0]) > 0, got[1]
    _assert_routed(policy, ("log_probs", "entropy", "mean_logits", "is_top1"))
    _assert_routed(ref, ("log_probs",))
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS


def test_dpo_step_routed_with_lora_on_the_head(tmp_path):
    """LoRA on q/v and on the head (effpass's inject_lora): the routed head calls the head as a module, so the
    head's adapter is trained (TRL's own kernel reads ``lm_head.weight`` alone and cannot be the oracle here). The
    oracle is the routed forward run eagerly on the prepared model's eager copy (the logits built, unfused): loss,
    metrics and the adapters' gradients within 1e-5; fused: the head's adapter counted in ``lora_heads``."""
    torch._dynamo.reset()
    base = tiny_model("llama")
    ref_base = _perturbed(base)
    lora = InjectLoRA(rank=4, init="gaussian", targets=["*.q_proj", "*.v_proj", "lm_head"])
    policy = effpass.compile(base, passes=[lora, FuseAttention(), FuseCrossEntropy()], lowering="eager")
    eager = copy.deepcopy(policy)  # the prepared model (adapters in place), eager
    want_tr = _trainer("dpo", eager, copy.deepcopy(ref_base), tmp_path / "eager")
    _route_eagerly(want_tr.model, want_tr.ref_model)
    batch = want_tr._prepare_inputs(next(iter(want_tr.get_train_dataloader())))
    want = _step(want_tr, want_tr.model, batch)

    ref = effpass.compile(copy.deepcopy(ref_base), lowering="eager")
    tr = _trainer("dpo", policy, ref, tmp_path / "effpass")
    got = _step(tr, policy, batch)
    _assert_same(want, got)
    assert all("lora" in n for n in got[2]) and any("lm_head" in n for n in got[2]), sorted(got[2])
    _assert_routed(policy, ("log_probs", "entropy", "mean_logits", "is_top1"))
    assert sum(r.stats["lora_heads"] for r in _fused_stats(policy)) == 1


def _route_eagerly(*models):
    """Give eager models the routed forward (the oracle where TRL's kernel cannot be: it reads ``lm_head.weight``
    alone, so it ignores a head's adapter and cannot slice a quantized head's weight)."""
    for m in models:
        fwd = m.__dict__["forward"]
        m.forward = type(fwd)(_trl_fused_head._routed_forward(m, fwd, _trl_fused_head._cells(fwd)), m)


def _perturb_ref_adapter(model):
    """TRL copies a PEFT model's adapter into a frozen "ref" adapter: move it off the policy's (a non-zero margin)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".ref." in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("how", ["peft_config", "peft_model"])
def test_dpo_step_routed_with_peft_adapters(how, tmp_path, monkeypatch):
    """PEFT LoRA, with no separate reference model (TRL scores the reference with the policy's adapter disabled, or
    with its frozen "ref" copy of a pretrained adapter): ``peft_config``: the base compiled by effpass and wrapped by
    the trainer (reference = adapters disabled); ``peft_model``: a ``PeftModel`` compiled by effpass (TRL adds a
    "ref" adapter; perturbed here in both arms so the margins are not zero). Loss, metrics and the adapters'
    gradients equal TRL's own step on an eager copy within 1e-5; the head TRL patched (inside PEFT's wrapper) is
    routed, both calls (policy, reference) fused, TRL's kernel never called."""
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    base = tiny_model("llama")

    def cfg():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    torch.manual_seed(3)
    if how == "peft_config":
        want_tr = _trainer("dpo", copy.deepcopy(base), None, tmp_path / "eager", peft_config=cfg())
        adapters = {k: v.clone() for k, v in want_tr.model.state_dict().items() if "lora_" in k}
        policy = effpass.compile(copy.deepcopy(base), lowering="eager")
        tr = _trainer("dpo", policy, None, tmp_path / "effpass", peft_config=cfg())
        assert not tr.model.load_state_dict(adapters, strict=False).unexpected_keys  # the same adapters
        compiled = policy
    else:
        pm = peft.get_peft_model(base, cfg())
        want_tr = _trainer("dpo", copy.deepcopy(pm), None, tmp_path / "eager")
        compiled = effpass.compile(copy.deepcopy(pm), lowering="eager")
        tr = _trainer("dpo", compiled, None, tmp_path / "effpass")
        for t in (want_tr, tr):
            assert "ref" in t.model.peft_config
            _perturb_ref_adapter(t.model)
    assert want_tr.ref_model is None and tr.ref_model is None
    batch = want_tr._prepare_inputs(next(iter(want_tr.get_train_dataloader())))
    want = _step(want_tr, want_tr.model, batch)
    got = _step(tr, tr.model, batch)
    _assert_same(want, got)
    assert got[2] and all("lora_" in n and ".default." in n for n in got[2]), sorted(got[2])
    assert abs(got[1]["rewards/margins"][0]) > 0, got[1]
    _assert_routed(compiled, ("log_probs", "entropy", "mean_logits", "is_top1"))
    assert len(_fused_stats(compiled)) == 2  # the policy's call and the reference's (adapter off or "ref")
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS


@pytest.mark.parametrize("scheme,head", [("nf4", False), ("int8", True)])
def test_dpo_step_routed_on_quantized_bases(scheme, head, tmp_path):
    """QLoRA-style DPO: quantized bases (effpass's quantize_linear; nf4 with the head kept in full precision, as
    QLoRA does, and int8 with the head quantized too), LoRA on q/v of the policy, a quantized separate reference.
    Oracle: TRL's own step on the prepared models' eager copies (the same quantized weights); with a quantized head,
    whose weight TRL's kernel cannot slice (torchao's int8 tensor refuses it), the routed forward run eagerly (the
    logits built). Loss, metrics and the adapters' gradients within 1e-5; both heads routed and fused."""
    torch._dynamo.reset()
    base = tiny_model("llama")
    ref_base = _perturbed(base)

    def quant():
        return QuantizeLinear(scheme=scheme, exclude=[] if head else ["lm_head"],
                              **({"block_size": 32} if scheme == "nf4" else {}))  # the tiny model's in_features: 32

    torch.manual_seed(0)
    lora = InjectLoRA(rank=4, init="gaussian", targets=["*.q_proj", "*.v_proj"])
    policy = effpass.compile(base, passes=[quant(), lora, FuseAttention(), FuseCrossEntropy()], lowering="eager")
    ref = effpass.compile(ref_base, passes=[quant(), FuseAttention(), FuseCrossEntropy()], lowering="eager")
    for m in (policy, ref):
        st = effpass.report(m).stats("quantize_linear")
        assert st["quantized"] == 7 + head, st  # every linear, the head too when asked
    want_tr = _trainer("dpo", copy.deepcopy(policy), copy.deepcopy(ref), tmp_path / "eager")
    if head:
        _route_eagerly(want_tr.model, want_tr.ref_model)
    batch = want_tr._prepare_inputs(next(iter(want_tr.get_train_dataloader())))
    want = _step(want_tr, want_tr.model, batch)
    tr = _trainer("dpo", policy, ref, tmp_path / "effpass")
    got = _step(tr, policy, batch)
    _assert_same(want, got)
    assert got[2] and all("lora_" in n for n in got[2]), sorted(got[2])
    _assert_routed(policy, ("log_probs", "entropy", "mean_logits", "is_top1"))
    _assert_routed(ref, ("log_probs",))
    for m in (policy, ref):
        assert sum(r.stats["dequantized_heads"] for r in _fused_stats(m)) == int(head)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral"])
@pytest.mark.sweep
def test_packed_rows_through_the_routed_head_equal_trls_kernel(family, monkeypatch):
    """Padding-free rows (three examples in one row, ``position_ids`` restarting at 0, no attention mask, the label of
    each example's first token -100: what TRL's padding-free collators feed; TRL 1.16 turns DPO's ``padding_free``
    off, so the head is called directly here as a trainer would): every output of the routed head (log-probs,
    entropy, mean logits, top-1, the loss, the router's loss for Mixtral) and every gradient equal TRL's kernel on an
    eager copy within 1e-5, and each example's log-probs equal the example scored alone (nothing leaks across the
    boundaries); one row-wise site fused, TRL's kernel never called."""
    import trl.trainer.utils as trl_utils  # its add_fused_lm_head read after effpass.compile (which routes it)

    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    base = tiny_model(family)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    eager = copy.deepcopy(base)
    trl_utils.add_fused_lm_head(eager, outputs=outputs)
    policy = effpass.compile(copy.deepcopy(base), lowering="eager")
    trl_utils.add_fused_lm_head(policy, outputs=outputs)
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 7]
    ids = torch.randint(1, 250, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    labels = ids.clone()
    labels[0, starts] = -100
    res = []
    for m in (eager, policy):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum() + out.loss).backward()
        res.append((out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (want, want_g), (got, got_g) = res
    for k in (*outputs, "loss", "aux_loss"):
        a, b = getattr(want, k), getattr(got, k)
        assert (a is None) == (b is None) and (k != "aux_loss" or (a is not None) == (family == "mixtral")), k
        if a is not None:
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5, msg=k)
    assert set(got_g) == set(want_g) and got_g
    for n in want_g:  # summation order: within 1e-5 of each gradient's scale (Gemma 2's tied embedding: up to 8.5)
        scale = float(want_g[n].abs().max())
        torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-5, atol=1e-5 * scale, msg=n)
    with torch.no_grad():  # each example alone: the packed row's log-probs over its labels (its last is the next's -100)
        for s, n in zip(starts.tolist(), lens):
            alone = eager(input_ids=ids[:, s:s + n], labels=labels[:, s:s + n], fused_lm_head=True).log_probs
            torch.testing.assert_close(got.log_probs[:, s:s + n - 1], alone, rtol=1e-5, atol=1e-5)
    _assert_routed(policy, outputs)
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS


def test_unrouted_cases_run_trls_kernel_and_say_why(tmp_path):
    """A pipeline without fuse_cross_entropy keeps TRL's kernel (through effpass's op) and its report says why; a
    routed policy whose trainer's reference effpass did not compile says so in its report (TRL's kernel scores the
    reference); a model effpass did not compile gets no note. Results as TRL's in every case."""
    torch._dynamo.reset()
    base, ref_base, _, batch, want = _trls_step("dpo", "llama", tmp_path)

    optout = effpass.compile(copy.deepcopy(base), passes=[FuseAttention()], lowering="eager")
    tr = _trainer("dpo", optout, copy.deepcopy(ref_base), tmp_path / "optout")
    _assert_same(want, _step(tr, optout, batch))
    notes = effpass.report(optout).module.notes["trl_fused_head"]
    assert notes["routed_models"] == 0 and notes["unrouted_models"] == 1, notes
    assert "no fuse_cross_entropy" in notes["reasons"][0], notes

    policy = effpass.compile(copy.deepcopy(base), lowering="eager")
    tr = _trainer("dpo", policy, copy.deepcopy(ref_base), tmp_path / "eager_ref")
    _assert_same(want, _step(tr, policy, batch))
    notes = effpass.report(policy).module.notes["trl_fused_head"]
    assert notes["routed_models"] == 1 and notes["unrouted_models"] == 1, notes
    assert "reference model is not compiled by effpass" in notes["reasons"][0], notes
    assert not getattr(tr.ref_model, "_effpass_fused_head", False)


def _grpo_inputs(tr):
    """One generation batch, scored: completions sampled by the eager policy, rewards, advantages, reference log-probs."""
    torch.manual_seed(0)
    return tr._prepare_inputs(next(iter(tr.get_train_dataloader())))


@pytest.mark.parametrize("kind,family", [("grpo", "llama"), ("grpo", "gemma2"), ("rloo", "llama")])
def test_grpo_and_rloo_steps_routed_equal_trls(kind, family, tmp_path, monkeypatch):
    """GRPOTrainer and RLOOTrainer (temperature 0.7, beta 0.04): on the same sampled completions, the reference's
    per-token log-probs (the reference TRL loads from the policy's path, compiled with effpass after the trainer built
    it: its fused head was added before the compile) and the policy's step (loss, logged metrics incl. entropy and
    the KL where the trainer logs it, every gradient) equal TRL's own (eager) within 1e-5; both heads routed and
    fused, TRL's kernel never called."""
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    base = tiny_model(family)
    base.save_pretrained(tmp_path / "base")  # GRPO loads its reference from the policy's path
    base.config._name_or_path = str(tmp_path / "base")
    want_tr = _trainer(kind, copy.deepcopy(base), None, tmp_path / "eager")
    inputs = _grpo_inputs(want_tr)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keep = inputs["completion_ids"].shape[1]
    want_ref = want_tr._get_per_token_logps_and_entropies(want_tr.ref_model, ids, mask, keep)[0]
    want_tr._metrics["train"].clear()

    def step(tr, model):
        model.zero_grad(set_to_none=True)
        loss = tr.compute_loss(model, inputs)
        loss.backward()
        metrics = {k: list(v) for k, v in tr._metrics["train"].items()}
        return float(loss), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = step(want_tr, want_tr.model)
    policy = effpass.compile(copy.deepcopy(base), lowering="eager")
    tr = _trainer(kind, policy, None, tmp_path / "effpass")
    effpass.compile(tr.ref_model, lowering="eager")
    tr._metrics["train"].clear()
    with torch.no_grad():
        got_ref = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, mask, keep)[0]
    torch.testing.assert_close(got_ref, want_ref, rtol=1e-5, atol=1e-6)
    got = step(tr, policy)
    _assert_same(want, got)
    assert {"entropy", "kl"} <= set(got[1]) if kind == "grpo" else "entropy" in got[1], sorted(got[1])
    _assert_routed(policy, ("log_probs", "entropy"))
    _assert_routed(tr.ref_model, ("log_probs",))
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.sweep
def test_kto_step_routed_equals_trls(family, tmp_path, monkeypatch):
    """One KTOTrainer step (desirable and undesirable examples, the KL term's mismatched pairs: three forwards of the
    policy and three of the reference per step): loss, every logged metric and every gradient equal TRL's own step
    within 1e-5; both heads routed and fused, TRL's kernel never called."""
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    want_tr, want, tr, got = _eager_and_routed("kto", family, tmp_path)
    policy, ref = tr.model, tr.ref_model
    _assert_same(want, got)
    assert want_tr.calculate_KL and "kl" in got[1], sorted(got[1])
    _assert_routed(policy, tuple(_trl_fused_head._cells(want_tr.model.__dict__["forward"])["outputs"]))
    _assert_routed(ref, ("log_probs",))
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS


def test_dpo_step_routed_under_bf16_autocast(tmp_path):
    """The step under bf16 autocast (what accelerate wraps the forward in with ``bf16=True``; entered explicitly
    here, as ``training_step`` alone does not prepare the model): the routed heads are fused with bf16 matmuls inside
    the ops (TRL's kernel projects in the autocast dtype too) and the loss and metrics agree with TRL's own step
    within bf16 rounding (1e-2 relative), while TRL's bf16 and fp32 steps differ."""
    torch._dynamo.reset()
    base, ref_base, want_tr, batch, fp32 = _trls_step("dpo", "llama", tmp_path)
    want_tr._metrics["train"].clear()
    want_tr._total_train_tokens = 0  # the num_tokens metric counts every step's tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _step(want_tr, want_tr.model, batch)
    assert want[1]["logps/chosen"] != fp32[1]["logps/chosen"]  # autocast really changed TRL's step
    policy = effpass.compile(copy.deepcopy(base), lowering="eager")
    ref = effpass.compile(copy.deepcopy(ref_base), lowering="eager")
    tr = _trainer("dpo", policy, ref, tmp_path / "effpass")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _step(tr, policy, batch)
    assert abs(want[0] - got[0]) <= 1e-2 * abs(want[0]), (want[0], got[0])
    for k in want[1]:
        torch.testing.assert_close(torch.tensor(got[1][k]), torch.tensor(want[1][k]), rtol=1e-2, atol=1e-3, msg=k)
    for m in (policy, ref):
        assert sum(r.stats["low_precision_matmuls"] for r in _fused_stats(m)) >= 1, [r.stats for r in _fused_stats(m)]
        assert all(r.stats["skipped"] == 0 for r in _fused_stats(m))
