"""step_in_backward with AdamW on the host (effpass.HostOffloadAdamW): each gradient handed to the optimizer inside the
compiled backward graph, the host step in opt.step(); parameters equal an eager model trained with torch's AdamW."""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from effpass.passes import StepInBackward
from effpass.passes.step_in_backward import StepInBackwardError, attach
from effpass.testing import model_case


def _params(m):
    return {n.replace("_orig_mod.", ""): p for n, p in m.named_parameters()}


def _run(case, kind, *, steps=3, attach_now=True, minimal_size=100):
    """``steps`` training steps with an LR schedule: ``eager`` (no effpass, torch.optim.AdamW fused) or ``host``
    (effpass.compile + StepInBackward, HostOffloadAdamW). Returns (model, optimizer, losses, .grad counts after
    each backward)."""
    torch.manual_seed(0)
    m = copy.deepcopy(case.model)
    kw = dict(lr=1e-2, weight_decay=0.1)
    if kind == "eager":
        opt = torch.optim.AdamW(m.parameters(), **kw, fused=True)
    else:
        m = effpass.compile(m, passes=[StepInBackward()], lowering="eager")
        opt = effpass.HostOffloadAdamW(m.parameters(), **kw, minimal_size=minimal_size)
        if attach_now:
            attach(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    losses, grads = [], []
    for _ in range(steps):
        loss = case.loss(m(**case.inputs))
        loss.backward()
        grads.append(sum(p.grad is not None for p in m.parameters()))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return m, opt, losses, grads


@pytest.mark.parametrize("attach_now", [True, False])
def test_parameters_bit_identical_to_eager_adamw_and_no_gradient_kept(attach_now):
    """Numerical oracle: an eager model (no compile) trained with torch.optim.AdamW(fused=True): the same losses and
    bit-identical parameters after 3 steps. Structural: one step op per parameter in the backward graph
    (steps_in_graph), the optimizer's counts of gradients taken and bytes moved, and no parameter holding a
    gradient after backward (from the first step when attached at once, else from the second)."""
    case = model_case("llama", layers=1)
    ref, _, ref_losses, _ = _run(case, "eager")
    got, opt, losses, grads = _run(case, "host", attach_now=attach_now)
    n = len(list(got.parameters()))
    assert effpass.report(got).stats("step_in_backward", "joint") == {"steps_in_graph": n}
    assert grads == ([0, 0, 0] if attach_now else [n, 0, 0])
    assert losses == ref_losses
    pr, pg = _params(ref), _params(got)
    assert pr.keys() == pg.keys() and all(torch.equal(pr[k], pg[k]) for k in pr)
    big = [p for p in got.parameters() if p.numel() >= 100]
    small = [p for p in got.parameters() if p.numel() < 100]  # the RMSNorm weights: stepped on the device
    assert big and small and all(opt.offloaded(p) for p in big) and not any(opt.offloaded(p) for p in small)
    moved = sum(p.numel() * p.element_size() for p in big)
    assert opt.counters == {"gradients_taken": 3 * len(big), "d2h_bytes": 3 * moved, "h2d_bytes": 3 * moved,
                            "host_updates": 3 * len(big), "device_updates": 3 * len(small)}


def test_gradient_accumulation_still_refused():
    case = model_case("llama", layers=1)
    m = effpass.compile(copy.deepcopy(case.model), passes=[StepInBackward()], lowering="eager")
    opt = effpass.HostOffloadAdamW(m.parameters(), lr=1e-3)
    attach(opt)
    case.loss(m(**case.inputs)).backward()
    assert opt.counters["gradients_taken"] == sum(1 for p in m.parameters() if opt.offloaded(p)) > 0
    with pytest.raises(StepInBackwardError, match="gradient accumulation"):
        case.loss(m(**case.inputs)).backward()


def test_an_optimizer_that_takes_gradients_is_accepted_by_its_contract():
    """step_in_backward accepts any optimizer with ``takes_gradients = True`` and ``take_gradient`` (the core's
    contract), not only HostOffloadAdamW; an optimizer with neither is refused naming the contract."""
    from effpass.passes.step_in_backward import _check_optimizer

    class Taker(torch.optim.Adagrad):  # not a supported class: accepted by the contract alone
        takes_gradients = True
        taken = 0

        def take_gradient(self, p, g):
            self.taken += 1

    p = torch.nn.Parameter(torch.zeros(3))
    _check_optimizer(Taker([p], lr=0.1))
    Taker.takes_gradients = False
    with pytest.raises(StepInBackwardError, match="Taker is not supported"):
        _check_optimizer(Taker([p], lr=0.1))
    with pytest.raises(StepInBackwardError, match="effpass.takes_gradients"):
        _check_optimizer(torch.optim.Adagrad([p]))
