"""TRL's ORPOTrainer with an effpass-compiled policy (issue 27): its trainer-side forward is routed
(effpass/integrations/_trl_orpo.py) so the model returns per-token log-probs and mean logits computed in its graph,
which fuse_cross_entropy fuses (no logits are built), with the same five results as TRL's own method; what cannot be
routed runs TRL's method and the report says why."""
import copy

import pytest
import torch

import effpass
from effpass.integrations import _trl_kernels, _trl_orpo
from effpass.passes import FuseAttention, FuseCrossEntropy, InjectLoRA
from _trl_models import tiny_model

pytest.importorskip("trl")
orpo = pytest.importorskip("trl.experimental.orpo")


def _model(family):
    return tiny_model(family)


def _trainer(model, tmp_path, beta=0.1):
    import datasets
    from effpass.testing.hf import VOCAB, tiny_tokenizer

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{i}" for i in torch.randint(0, VOCAB - 6, (n,), generator=g).tolist())

    # prompts and answers of different lengths: rows are padded, so masks matter
    data = datasets.Dataset.from_dict({"prompt": [words(3 + i) for i in range(4)],
                                       "chosen": [words(5 - i % 3) for i in range(4)],
                                       "rejected": [words(2 + i) for i in range(4)]})
    cfg = orpo.ORPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=0.1,
                          optim="sgd", logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True,
                          disable_tqdm=True, bf16=False, beta=beta)
    return orpo.ORPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tiny_tokenizer())


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral", "llama_lora", "llama_headlora"])
def test_orpo_forward_routed_equals_trls(family, tmp_path, monkeypatch):
    """The routed forward's five results and every gradient equal TRL's own method on the same batch (fp32,
    within 1e-5); the routed call's graph holds the pass's chunked log-prob op and a row-wise op for the mean logit
    (both fused, nothing skipped), and the logits are never returned. ``llama_lora`` (adapters on q/v, the head
    frozen) and ``llama_headlora`` (adapters on the head too): TRL's method run on the same compiled model as
    the reference (its unfused path returns the logits)."""
    monkeypatch.setattr(_trl_kernels, "CALLS", {"forward": 0, "backward": 0})
    torch._dynamo.reset()
    base = _model(family.split("_")[0])
    ref = copy.deepcopy(base)
    if family in ("llama_lora", "llama_headlora"):
        targets = ["*.q_proj", "*.v_proj"] + (["lm_head"] if family == "llama_headlora" else [])
        model = effpass.compile(base, passes=[InjectLoRA(rank=4, init="gaussian", targets=targets),
                                              FuseAttention(), FuseCrossEntropy()], lowering="eager")
        ref = model
    else:
        model = effpass.compile(base, lowering="eager")
    assert _trl_orpo.route() and orpo.ORPOTrainer.concatenated_forward is _trl_orpo.concatenated_forward
    tr = _trainer(model, tmp_path)
    batch = next(iter(tr.get_train_dataloader()))

    def run(fn, m):
        m.zero_grad(set_to_none=True)
        out = fn(tr, m, batch)
        lc, lr, mc, mr, nll = out[:5]
        aux = out[5] if tr.aux_loss_enabled else torch.zeros(())
        assert len(out) == 5 + tr.aux_loss_enabled
        (nll - 0.1 * torch.nn.functional.logsigmoid(lc - lr).mean() + 0.01 * aux).backward()
        return [lc.detach(), lr.detach(), mc.detach().mean(), mr.detach().mean(), nll.detach(), aux.detach()], \
            {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want, want_g = run(_trl_orpo._STATE["original"], ref)  # TRL's method on the eager model: the logits
    got, got_g = run(orpo.ORPOTrainer.concatenated_forward, model)
    assert tr.aux_loss_enabled == (family == "mixtral") and (family != "mixtral" or float(want[5]) > 0)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert set(got_g) == set(want_g) and len(got_g) > 0
    assert "lora" not in family or all("lora" in n for n in got_g), sorted(got_g)
    assert family != "llama_headlora" or any("lm_head" in n for n in got_g), sorted(got_g)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-5, atol=1e-7, msg=n)
    # structural: the routed graph's log-prob and mean-logit sites fused, nothing skipped; TRL's kernel never ran
    rep = effpass.report(model)
    recs = [r for r in rep.records("fuse_cross_entropy") if r.phase == "torch_ir" and r.stats.get("logprob_sites")]
    assert len(recs) == 1, [(r.graph, r.stats) for r in rep.records("fuse_cross_entropy")]
    st = recs[0].stats
    assert st["logprob_sites"] == 1 and st["rowwise_sites"] == 1 and st["skipped"] == 0, (st, recs[0].skipped)
    assert st["logits_returned"] == 0, st
    assert _trl_kernels.CALLS == {"forward": 0, "backward": 0}, _trl_kernels.CALLS
    assert rep.module.notes["trl_orpo"] == {"routed_calls": 1, "unrouted_calls": 0, "reasons": []}
    # one graph per call: TRL's default gradient checkpointing asks for input grads on the embedding
    # (a Tensor.requires_grad_ hook, a graph break), which effpass does not install; MoE router logits are
    # captured by hooks installed before the first call (installed lazily, under a lock, they broke the graph)
    assert len(rep.graphs) == (2 if ref is model else 1), [g.notes.get("dynamo", {}).get("graph_breaks") for g in rep.graphs]
    assert "input_require_grads" in rep.module.notes, rep.module.notes   # TRL asked, with its default checkpointing
    assert got[2].dim() == 0 and got[3].dim() == 0


def test_orpo_trainer_trains_routed(tmp_path):
    """Two ORPOTrainer steps: the routed effpass policy logs TRL's eager losses (within 1e-5), every step fused."""
    torch._dynamo.reset()
    losses = {}
    for arm in ("eager", "effpass"):
        m = _model("llama")
        if arm == "effpass":
            effpass.compile(m, lowering="eager")
        tr = _trainer(m, tmp_path / arm)
        tr.train()
        losses[arm] = [h["loss"] for h in tr.state.log_history if "loss" in h]
        if arm == "effpass":
            assert effpass.report(m).module.notes["trl_orpo"]["routed_calls"] == 2
            assert effpass.report(m).module.notes["trl_orpo"]["unrouted_calls"] == 0
    assert len(losses["eager"]) == 2
    for a, b in zip(losses["eager"], losses["effpass"]):
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), losses


def test_orpo_unrouted_cases_run_trls_method_and_say_why(tmp_path):
    """Opt-out (no fuse_cross_entropy in the pipeline) and labels that differ from the input ids on an answer
    token run TRL's own method (same results) and the report names the reason; a model effpass did not
    compile is left alone (no note)."""
    torch._dynamo.reset()
    m = effpass.compile(_model("llama"), passes=[FuseAttention()], lowering="eager")
    tr = _trainer(m, tmp_path / "optout")
    batch = next(iter(tr.get_train_dataloader()))
    out = tr.concatenated_forward(m, batch)
    assert out[2].dim() == 3  # TRL's method: the chosen logits themselves
    notes = effpass.report(m).module.notes["trl_orpo"]
    assert notes["routed_calls"] == 0 and notes["unrouted_calls"] == 1 and "no fuse_cross_entropy" in notes["reasons"][0]

    m2 = effpass.compile(_model("llama"), lowering="eager")
    tr2 = _trainer(m2, tmp_path / "labels")
    bad = dict(batch)
    bad["chosen_labels"] = batch["chosen_labels"].clone()
    row, col = (bad["chosen_labels"] != -100).nonzero()[0].tolist()
    bad["chosen_labels"][row, col] = (bad["chosen_labels"][row, col] + 1) % 256  # scores a token not in the input
    want = _trl_orpo._STATE["original"](tr2, m2, bad)
    got = tr2.concatenated_forward(m2, bad)
    torch.testing.assert_close(got[0], want[0])
    notes = effpass.report(m2).module.notes["trl_orpo"]
    assert notes["unrouted_calls"] == 1 and "labels differ from the input ids" in notes["reasons"][0]

    plain = _model("llama")
    tr3 = _trainer(plain, tmp_path / "plain")
    assert tr3.concatenated_forward(plain, batch)[2].dim() == 3


def test_orpo_routed_under_bf16_autocast(tmp_path):
    """Under bf16 autocast (what the Trainer enters with ``bf16=True``) the routed call is fused with bf16 matmuls in
    the ops and agrees with TRL's method within bf16 rounding (TRL's rounds the logits to bf16 first: 1e-2)."""
    torch._dynamo.reset()
    base = _model("llama")
    ref = copy.deepcopy(base)
    model = effpass.compile(base, lowering="eager")
    tr = _trainer(model, tmp_path)
    batch = next(iter(tr.get_train_dataloader()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _trl_orpo._STATE["original"](tr, ref, batch)
        got = tr.concatenated_forward(model, batch)
    for i, (a, b) in enumerate(zip(want, got)):
        a = a.detach().float().mean() if a.dim() == 3 else a.detach().float()
        torch.testing.assert_close(b.detach().float(), a, rtol=1e-2, atol=1e-3, msg=f"result {i}")
    st = next(r.stats for r in effpass.report(model).records("fuse_cross_entropy")
              if r.phase == "torch_ir" and r.stats.get("logprob_sites"))
    assert st["logprob_sites"] == 1 and st["rowwise_sites"] == 1 and st["low_precision_matmuls"] == 2, st
