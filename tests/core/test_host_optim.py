"""effpass.HostOffloadAdamW on its own (CPU): the same parameters as torch's AdamW, what it holds on the host, what it
moves, and what it refuses. With step_in_backward: tests/passes/step_in_backward/test_step_in_backward_host.py."""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from effpass.host_optim import HostOffloadAdamW, takes_gradients


class _Net(torch.nn.Module):
    """Two weights of >= 4,096 elements (offloaded) and two biases and a norm below it (kept on the device)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 96)
        self.norm = torch.nn.LayerNorm(96)
        self.b = torch.nn.Linear(96, 48)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x)))).square().mean()


def _train(model, opt, x, steps=3, sched=True):
    s = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1)) if sched else None
    for _ in range(steps):
        model(x).backward()
        opt.step()
        if s is not None:
            s.step()
        opt.zero_grad()


@pytest.mark.parametrize("fused", [True, False])
def test_parameters_and_states_bit_identical_to_torch_adamw(fused):
    """Numerical: 3 steps with an LR schedule equal torch.optim.AdamW stepping the parameters in place (fused: its
    fused kernel; else its single-tensor one). Structural: which parameters are offloaded, the counters."""
    torch.manual_seed(0)
    base, x = _Net(), torch.randn(8, 64)
    ref, got = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True)
    ropt = torch.optim.AdamW(ref.parameters(), **kw, **({"fused": True} if fused else {"foreach": False}))
    gopt = HostOffloadAdamW(got.parameters(), **kw, fused=fused)
    _train(ref, ropt, x)
    _train(got, gopt, x)
    for (n, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), n
    offloaded = [n for n, p in got.named_parameters() if gopt.offloaded(p)]
    assert offloaded == ["a.weight", "b.weight"]  # 6,144 and 4,608 elements; the rest under 4,096
    big = sum(p.numel() * p.element_size() for p in got.parameters() if gopt.offloaded(p))
    assert gopt.counters == {"gradients_taken": 3 * 2, "d2h_bytes": 3 * big, "h2d_bytes": 3 * big,
                             "host_updates": 3 * 2, "device_updates": 3 * 4}
    rs, gs = ropt.state_dict(), gopt.state_dict()
    assert [g["lr"] for g in rs["param_groups"]] == [g["lr"] for g in gs["param_groups"]]
    for k in rs["state"]:
        for f, v in rs["state"][k].items():
            assert torch.equal(v, gs["state"][k][f]), (k, f)


def test_host_buffers_are_the_parameters_copies_gradients_and_states():
    """Structural: per offloaded parameter a host copy and a gradient buffer (pinned on CUDA) and AdamW's states on
    the host, sized from the parameter's shape; the small parameters' states are on the parameter's device."""
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 64)
    opt = HostOffloadAdamW(model.parameters(), lr=1e-3, minimal_size=5000)  # only a.weight (6,144) offloaded
    _train(model, opt, x, steps=1, sched=False)
    bufs = opt.host_buffers()
    w = model.a.weight
    assert [(tuple(t.shape), pinned) for t, pinned in bufs] == [((96, 64), True), ((96, 64), True), ((), False),
                                                                  ((96, 64), False), ((96, 64), False)]
    assert sum(t.numel() * t.element_size() for t, _ in bufs) == 4 * w.numel() * 4 + 4
    assert not any(t.is_pinned() for t, _ in bufs)  # no CUDA here: nothing pinned
    assert opt.offloaded(w) and not opt.offloaded(model.b.weight)
    states = {id(v) for s in opt.state.values() for v in s.values()}
    assert {id(t) for t, _ in bufs[2:]} <= states


def test_take_gradient_is_the_step_of_that_gradient():
    """take_gradient(p, g) then step() == p.grad = g then step(): the offloaded gradient goes to the host (the caller
    keeps nothing), a small parameter is updated at once; a second gradient before step() is refused."""
    torch.manual_seed(0)
    base, x = _Net(), torch.randn(8, 64)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = HostOffloadAdamW(a.parameters(), lr=1e-2), HostOffloadAdamW(b.parameters(), lr=1e-2)
    assert takes_gradients(ob) and not takes_gradients(torch.optim.AdamW(a.parameters()))
    a(x).backward()
    oa.step()
    b(x).backward()
    for p in b.parameters():
        g, p.grad = p.grad, None
        ob.take_gradient(p, g)
    assert ob.counters["device_updates"] == 4 and ob.counters["gradients_taken"] == 2  # small ones already updated
    assert all(p.grad is None for p in b.parameters())
    with pytest.raises(RuntimeError, match="effpass HostOffloadAdamW.take_gradient: a second gradient"):
        ob.take_gradient(b.a.weight, torch.zeros_like(b.a.weight))
    ob.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="does not hold"):
        ob.take_gradient(torch.nn.Parameter(torch.zeros(3)), torch.zeros(3))


def test_state_dict_round_trip_continues_exactly_with_states_on_the_host():
    torch.manual_seed(0)
    base, x = _Net(), torch.randn(8, 64)
    ref, got = copy.deepcopy(base), copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train(ref, ropt, x, steps=3, sched=False)
    opt = HostOffloadAdamW(got.parameters(), lr=1e-2)
    _train(got, opt, x, steps=2, sched=False)
    opt2 = HostOffloadAdamW(got.parameters(), lr=1e-2)  # built after the weights changed: its host copies are these
    opt2.load_state_dict(opt.state_dict())
    assert all(v.device.type == "cpu" for p in got.parameters() if opt2.offloaded(p) for v in opt2.state[p].values())
    _train(got, opt2, x, steps=1, sched=False)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), got.parameters()))


def test_bad_arguments_name_effpass_and_the_value():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"effpass HostOffloadAdamW: minimal_size must be an int >= 0, got -1"):
        HostOffloadAdamW(p, minimal_size=-1)
    with pytest.raises(ValueError, match=r"effpass HostOffloadAdamW: fused must be True or False, got 'yes'"):
        HostOffloadAdamW(p, fused="yes")
    assert effpass.HostOffloadAdamW is HostOffloadAdamW and effpass.takes_gradients is takes_gradients
