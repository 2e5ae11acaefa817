"""``quantize_linear`` (and ``inject_lora``, whose adapter would be bypassed there) leave a linear whose parent module reads its weight directly (``self.dt_proj.weight @ x``:
Mamba's training path) unquantized, with the method and line as the reason; a read in a branch the module's own
attributes decide is not taken (Bloom's ``if self.pretraining_tp > 1 and self.slow_but_exact``), a read of the
weight's metadata (``self.proj.weight.dtype``, common in Hugging Face attention code) or a type check does not count.
Before, Mamba's int8 step failed with torchao's "Int8WeightTensor dispatch: ... aten.expand", which names neither
effpass nor the module."""
from __future__ import annotations

import copy

import torch
from torch import nn

import effpass
from _auto_families import build
from effpass.passes.quantize_linear import Int8WeightTensor, QuantizeLinear


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.dt = nn.Linear(16, 64, bias=False)  # read directly below: must keep its weight
        self.down = nn.Linear(64, 32)
        self.slices = 1  # > 1: a path that reads down.weight directly (as Bloom's pretraining_tp); not taken here

    def forward(self, x):
        h = self.up(x.to(self.up.weight.dtype))  # a metadata read only: up is still quantized
        assert isinstance(self.up.weight, torch.Tensor)  # a type check: no value read
        t = (self.dt.weight @ x[..., :16].transpose(-1, -2)).transpose(-1, -2)
        if self.slices > 1:
            return torch.nn.functional.linear(torch.relu(h + t), self.down.weight)
        return self.down(torch.relu(h + t))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()

    def forward(self, x):
        return self.mixer(x).pow(2).mean()


def test_a_weight_read_outside_its_linear_keeps_it_unquantized_with_the_reason():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 5, 32)
    compiled = effpass.compile(model, passes=[QuantizeLinear(scheme="int8")], lowering="eager")
    m = model.mixer
    # structural: dt kept with a reason naming the method, the others quantized
    assert not isinstance(m.dt.weight, Int8WeightTensor)
    assert isinstance(m.up.weight, Int8WeightTensor) and isinstance(m.down.weight, Int8WeightTensor)
    rec = effpass.report(model).records("quantize_linear")
    left = {s["site"]: s["reason"] for r in rec for s in r.skipped}
    assert list(left) == ["mixer.dt"], left
    assert "Mixer.forward" in left["mixer.dt"] and "self.dt.weight" in left["mixer.dt"], left
    # numerical: the step runs (compiled, eager lowering) and equals the prepared eager model
    eager = copy.deepcopy(model)  # a copy of a model compiled in place is the eager, prepared model
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-6, rtol=1e-6)


def test_mamba_int8_keeps_dt_proj_and_quantizes_the_rest():
    model, inputs = build("mamba")
    effpass.prepare(model, passes=[QuantizeLinear(scheme="int8")])
    mixer = model.backbone.layers[0].mixer
    # dt_proj: read by the training path; x_proj, out_proj: by the fused CUDA kernels' path, whose condition is
    # decided only when the step runs (kept: it may)
    assert not any(isinstance(getattr(mixer, n).weight, Int8WeightTensor) for n in ("dt_proj", "x_proj", "out_proj"))
    assert isinstance(mixer.in_proj.weight, Int8WeightTensor)
    left = {s["site"]: s["reason"] for r in effpass.report(model).records("quantize_linear") for s in r.skipped}
    assert "MambaMixer.forward" in left["backbone.layers.0.mixer.dt_proj"], left
    with torch.no_grad():
        out = model(**inputs)  # failed before: torchao's Int8WeightTensor has no aten.expand
    assert torch.isfinite(out.loss)


def test_a_branch_the_modules_attributes_take_counts():
    model = Net()
    model.mixer.slices = 2  # the branch that reads down.weight directly now runs
    effpass.prepare(model, passes=[QuantizeLinear(scheme="int8")])
    left = {s["site"]: s["reason"] for r in effpass.report(model).records("quantize_linear") for s in r.skipped}
    assert sorted(left) == ["mixer.down", "mixer.dt"], left
    assert isinstance(model.mixer.up.weight, Int8WeightTensor)
    model(torch.randn(2, 5, 32))  # runs: nothing quantized is read outside its linear


def test_inject_lora_leaves_a_directly_read_linear_without_an_adapter():
    """An adapter on ``dt`` would be bypassed by ``self.dt.weight @ x``: it would not train while the statistics
    counted it. The other linears get adapters, and every adapter gets a gradient."""
    from effpass.passes import InjectLoRA

    torch.manual_seed(0)
    model = Net()
    effpass.prepare(model, passes=[InjectLoRA(rank=2)])
    st = effpass.report(model).stats("inject_lora")
    assert sorted(st["modules"]) == ["mixer.down", "mixer.up"], st["modules"]
    left = {s["site"]: s["reason"] for r in effpass.report(model).records("inject_lora") for s in r.skipped}
    assert "bypassed" in left["mixer.dt"] and "Mixer.forward" in left["mixer.dt"], left
    for lin in (model.mixer.up, model.mixer.down):  # no adapter starts at zero: give B a value, then check its grad
        torch.nn.init.normal_(lin.lora_B.weight)
    model(torch.randn(2, 5, 32)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if p.requires_grad)
