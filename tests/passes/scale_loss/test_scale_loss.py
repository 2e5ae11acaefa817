"""scale_loss: GradScaler parity, fault injection, collapse, checkpoints, bf16 no-op, no recompiles."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import effpass
from effpass.passes import ApplyAutocast, ScaleLoss
from effpass.passes.scale_loss import LossScaleCollapsedError, loss_scaler
from effpass.testing import dynamo_counters, grads_of, loss_of, model_case

FP16 = torch.float16


def _poison(model, step, at, value):
    if step in at:
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = value


def _run_effpass(case, steps, *, fused=False, inject=(), value=float("inf"), init_scale=2.0 ** 10,
                 growth_interval=3, **kw):
    passes = [ApplyAutocast(dtype=FP16), ScaleLoss(init_scale=init_scale, growth_interval=growth_interval, **kw)]
    compiled = effpass.compile(case.model, passes=passes, lowering="eager")
    scaler = loss_scaler(compiled)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2, fused=fused)
    losses, scales = [], []
    for i in range(steps):
        loss = loss_of(compiled(**case.inputs))
        loss.backward()
        _poison(case.model, i, inject, value)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, compiled, opt


def _run_grad_scaler(model, case, steps, *, fused=False, inject=(), value=float("inf"), init_scale=2.0 ** 10,
                     growth_interval=3):
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    losses, scales = [], []
    for i in range(steps):
        with torch.autocast("cpu", FP16):
            loss = loss_of(model(**case.inputs))
        scaler.scale(loss).backward()
        _poison(model, i, inject, value)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales


@pytest.mark.parametrize("name,fused", [("demo", False), ("llama", True)])
def test_scale_loss_matches_grad_scaler(name, fused):
    """Same loss and scale history as eager torch.autocast + GradScaler, through growth and backoff."""
    case = model_case(name)
    eager = copy.deepcopy(case.model)
    inject = {4}
    with dynamo_counters() as counters:
        losses, scales, compiled, _ = _run_effpass(case, 9, fused=fused, inject=inject)
    want_losses, want_scales = _run_grad_scaler(eager, case, 9, fused=fused, inject=inject)
    assert scales == want_scales
    assert 2.0 ** 11 in scales and scales[4] < scales[3]      # it grew, and backed off at the injected step
    assert losses == want_losses
    # No graph breaks, no recompiles although the scale changed in place.
    assert counters["graph_breaks"] == 0 and counters["recompiles"] == 0 and counters["unique_graphs"] == 1
    assert effpass.report(compiled).stats("scale_loss")["scaled_losses"] == 1


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
             for k, v in opt.state.items()}
    return params, state


def _assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert sa.keys() == sb.keys()
    for k in sa:
        for kk in sa[k]:
            va, vb = sa[k][kk], sb[k][kk]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, kk


@pytest.mark.parametrize("fused", [False, True])
def test_scale_loss_skips_poisoned_steps_and_loses_nothing(fused):
    """An inf gradient at step 1 and a NaN gradient at step 2."""
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss(init_scale=2.0 ** 12)],
                               lowering="eager")
    scaler = loss_scaler(compiled)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2, fused=fused)
    poisoned = {1, 2}
    losses = []
    with dynamo_counters() as counters:
        for i in range(5):
            loss = loss_of(compiled(**case.inputs))
            loss.backward()
            _poison(case.model, i, poisoned, float("inf") if i == 1 else float("nan"))
            before = _snapshot(case.model, opt)
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if i in poisoned:
                _assert_same(_snapshot(case.model, opt), before)            # bit-identical: nothing applied
                assert scaler.get_scale() == scale_before * 0.5             # the scale backed off
            else:
                assert not torch.equal(next(case.model.parameters()), before[0][next(iter(before[0]))])
    assert scaler.skipped_steps == 2
    assert losses[3] < losses[0] and losses[4] < losses[3]                 # training continued
    assert next(iter(opt.state.values()))["step"].item() == 3               # only the clean steps counted
    assert counters["recompiles"] == 0


class _Bumped(nn.Module):
    """The demo model with a loss multiplier buffer: set it to inf to make the forward's loss inf."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("bump", torch.ones(()))

    def forward(self, tokens, labels):
        loss, logits = self.inner(tokens, labels)
        return loss * self.bump, logits


def test_scale_loss_handles_inf_loss_from_forward():
    case = model_case("demo")
    model = _Bumped(case.model)
    compiled = effpass.compile(model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss()], lowering="eager")
    scaler = loss_scaler(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dynamo_counters() as counters:
        for i in range(3):
            model.bump.fill_(float("inf") if i == 1 else 1.0)
            loss = compiled(**case.inputs)[0]
            loss.backward()
            before = _snapshot(model, opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if i == 1:
                assert torch.isinf(loss)
                _assert_same(_snapshot(model, opt), before)
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0 ** 15
    assert counters["recompiles"] == 0


@pytest.mark.parametrize("fused", [False, True])
def test_scale_loss_raises_when_scale_collapses(fused):
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss(init_scale=2.0 ** 4)],
                               lowering="eager")
    scaler = loss_scaler(compiled)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2, fused=fused)
    with pytest.raises(LossScaleCollapsedError, match="below min_scale"):
        for i in range(40):  # a model whose gradients always overflow
            loss_of(compiled(**case.inputs)).backward()
            _poison(case.model, i, range(40), float("inf"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    # 16 -> 0.5 < min_scale=1 after 5 skipped steps; the fused (sync-free) path checks every check_every steps.
    assert i == 4 if not fused else i == scaler.check_every - 1


def test_scale_loss_state_dict_and_checkpoint_restart():
    """3 steps, checkpoint, restart in a new model, 3 more == 6 uninterrupted steps."""
    case = model_case("demo", layers=1)
    fresh = copy.deepcopy(case.model)
    straight, straight_scales, _, _ = _run_effpass(case.fresh(), 6, inject={1})

    first = case.fresh()
    losses, scales, compiled, opt = _run_effpass(first, 3, inject={1})
    scaler = loss_scaler(compiled)
    ckpt = {"model": copy.deepcopy(first.model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "scaler": scaler.state_dict()}
    assert set(ckpt["scaler"]) == set(torch.amp.GradScaler("cpu").state_dict())   # same keys as GradScaler
    assert "effpass_loss_scale" not in ckpt["model"]          # the model's own state_dict is unchanged

    torch._dynamo.reset()
    model2 = fresh
    compiled2 = effpass.compile(model2, passes=[ApplyAutocast(dtype=FP16), ScaleLoss(init_scale=2.0 ** 10,
                                                                                      growth_interval=3)],
                                lowering="eager")
    model2.load_state_dict(ckpt["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    scaler2 = loss_scaler(compiled2)
    scaler2.load_state_dict(ckpt["scaler"])
    assert scaler2.get_scale() == scales[-1]
    for i in range(3):
        loss = loss_of(compiled2(**case.inputs))
        loss.backward()
        scaler2.step(opt2)
        scaler2.update()
        opt2.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler2.get_scale())
    assert losses == straight and scales == straight_scales


def test_scale_loss_loads_grad_scaler_state():
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss()], lowering="eager")
    gs = torch.amp.GradScaler("cpu", init_scale=123.0)
    gs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    loss_scaler(compiled).load_state_dict(gs.state_dict())
    assert loss_scaler(compiled).get_scale() == 123.0


def test_scale_loss_is_noop_with_bf16():
    case = model_case("demo", layers=1)
    ref = copy.deepcopy(case.model)
    with pytest.warns(UserWarning, match="bfloat16"):
        compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.bfloat16), ScaleLoss()],
                                   lowering="eager")
    scaler = loss_scaler(compiled)
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert not hasattr(case.model, "effpass_loss_scale")
    loss_of(compiled(**case.inputs)).backward()
    with torch.autocast("cpu", torch.bfloat16):
        loss_of(ref(**case.inputs)).backward()
    got, want = grads_of(case.model), grads_of(ref)
    for k in want:                                            # gradients are not scaled
        torch.testing.assert_close(got[k], want[k], rtol=2.0 ** -8, atol=1e-6)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    before = next(case.model.parameters()).detach().clone()
    scaler.step(opt)                                          # a plain optimizer step
    scaler.update()
    assert not torch.equal(before, next(case.model.parameters()))
    assert effpass.report(compiled).stats("scale_loss")["enabled"] is False
    assert "bfloat16" in effpass.report(compiled).records("scale_loss")[0].skipped[0]["reason"]


def test_scale_loss_scales_eager_gradients_by_the_scale():
    """Reference semantics: the prepared eager model scales its gradients exactly as the compiled one."""
    case = model_case("demo", layers=1)
    plain = copy.deepcopy(case.model)
    effpass.prepare(case.model, passes=[ScaleLoss(init_scale=256.0)])
    out = case.model(**case.inputs)
    torch.testing.assert_close(out[0], plain(**case.inputs)[0], rtol=0, atol=0)   # forward unchanged
    out[0].backward()
    loss_of(plain(**case.inputs)).backward()
    scaled, unscaled = grads_of(case.model), grads_of(plain)
    for k in unscaled:
        torch.testing.assert_close(scaled[k], unscaled[k] * 256.0, rtol=1e-6, atol=0)
    # prepared a second time (another prepare or compile of the same model): the scaler and its state are kept
    scaler = loss_scaler(case.model)
    assert "reused" not in effpass.report(case.model).stats("scale_loss")
    effpass.prepare(case.model, passes=[ScaleLoss(init_scale=2.0)])
    assert effpass.report(case.model).stats("scale_loss")["reused"] == 1
    assert loss_scaler(case.model) is scaler and float(scaler.get_scale()) == 256.0


def test_scale_loss_skips_graph_without_loss():
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss()], lowering="eager")
    logits = compiled(case.inputs["tokens"])                 # no labels: no loss
    rec = effpass.report(compiled).records("scale_loss")[-1]
    assert rec.stats["scaled_losses"] == 0 and "no scalar loss" in rec.skipped[0]["reason"]
    scaler = loss_scaler(compiled)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), case.inputs["labels"].flatten())
    loss.backward()
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        scaler.step(opt)
    # A loss computed outside the model is scaled with scaler.scale().
    opt.zero_grad()
    logits = compiled(case.inputs["tokens"])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), case.inputs["labels"].flatten())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_scale_loss_unscale_then_clip_matches_grad_scaler():
    case = model_case("demo", layers=1)
    eager = copy.deepcopy(case.model)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16), ScaleLoss()], lowering="eager")
    scaler, gs = loss_scaler(compiled), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(case.model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    for _ in range(2):
        loss_of(compiled(**case.inputs)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.autocast("cpu", FP16):
            ref_loss = loss_of(eager(**case.inputs))
        gs.scale(ref_loss).backward()
        gs.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
        gs.step(ref_opt)
        gs.update()
        ref_opt.zero_grad()
    for (n, p), q in zip(case.model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(RuntimeError, match="without a step"):
        scaler.update()
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0


def test_scale_loss_keeps_module_paths_for_scoping():
    """The forward wrapper must not hide module names: apply_autocast's exclude still makes its island."""
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=FP16, exclude=["lm_head"]), ScaleLoss()],
                               lowering="eager")
    with dynamo_counters() as counters:
        loss_of(compiled(**case.inputs)).backward()
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["island_modules"] == ["lm_head"] and st["matmuls_by_dtype_after"] == {"float16": 9, "float32": 1}
    assert counters["graph_breaks"] == 0
    copy.deepcopy(case.model)(**case.inputs)                 # the wrapped model still deep-copies and runs


def test_scale_loss_options_and_api_errors():
    with pytest.raises(ValueError, match="backoff_factor"):
        ScaleLoss(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_factor"):
        ScaleLoss(growth_factor=1.0)
    with pytest.raises(ValueError, match="init_scale"):
        ScaleLoss(init_scale=0)
    with pytest.raises(TypeError, match="growth_interval"):
        ScaleLoss(growth_interval="often")
    with pytest.raises(ValueError, match="no loss scaler"):
        loss_scaler(nn.Linear(2, 2))
    assert ScaleLoss.scaler is loss_scaler
    assert ScaleLoss.enabled_by_default("cpu") is False


def test_loss_scaler_is_a_grad_scaler_and_state_dicts_move_both_ways():
    """The scaler reuses GradScaler's code: a GradScaler checkpoint restores into effpass's scaler and back."""
    case = model_case("demo", layers=1)
    _, scales, compiled, _ = _run_effpass(case.fresh(), 3, inject={1})
    scaler = loss_scaler(compiled)
    assert isinstance(scaler, torch.amp.GradScaler)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 7, growth_interval=11)
    theirs.scale(torch.ones((), requires_grad=True))            # GradScaler makes its scale lazily
    scaler.load_state_dict(theirs.state_dict())
    assert scaler.get_scale() == 2.0 ** 7 and scaler.state_dict() == theirs.state_dict()
    assert float(scaler.scale_tensor) == 2.0 ** 7                 # the graph reads the restored scale
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(loss_scaler(_run_effpass(case.fresh(), 3, inject={1})[2]).state_dict())
    assert back.get_scale() == scales[-1]
