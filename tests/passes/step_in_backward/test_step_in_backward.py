"""step_in_backward: each parameter's optimizer update inside backward, gradients freed at once."""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from effpass.passes import StepInBackward
from effpass.passes.step_in_backward import StepInBackwardError, attach, detach, hooked_parameters
from effpass.testing import model_case
from effpass.testing.memory import peak_memory

from _helpers import TanhStack


def _params(m):
    return {n.replace("_orig_mod.", ""): p for n, p in m.named_parameters()}


def _train(model, make_opt, case, *, steps=4, use_pass=False, attach_now=False, check_grads=None):
    if use_pass:
        model = effpass.compile(model, passes=[StepInBackward()], lowering="eager")
    else:
        model = effpass.compile(model, passes=[], lowering="eager")
    opt = make_opt(model.parameters())
    if attach_now:
        assert attach(opt) == len(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    losses = []
    for i in range(steps):
        loss = case.loss(model(**case.inputs))
        loss.backward()
        if check_grads is not None:
            check_grads(i, model)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=0.01),
}


@pytest.mark.parametrize("kind,attach_now", [(k, True) for k in OPTIMIZERS] + [("adamw", False)])
def test_parameters_and_state_bit_identical_to_usual_step(kind, attach_now):
    case = model_case("llama", layers=1)
    seen = []

    def grads_freed(i, model):  # structural: after backward, which gradients still exist
        seen.append(sum(p.grad is not None for p in model.parameters()))

    ref, ref_opt, ref_losses = _train(copy.deepcopy(case.model), OPTIMIZERS[kind], case)
    got, opt, losses = _train(copy.deepcopy(case.model), OPTIMIZERS[kind], case, use_pass=True,
                              attach_now=attach_now, check_grads=grads_freed)
    n = len(list(got.parameters()))
    assert hooked_parameters(got) == n
    # found by attach() at once, or by the global hook on the first step (an ordinary one)
    assert seen == ([0] * 4 if attach_now else [n, 0, 0, 0])
    assert losses == ref_losses
    pr, pg = _params(ref), _params(got)
    assert pr.keys() == pg.keys()
    assert all(torch.equal(pr[k], pg[k]) for k in pr)
    sr, sg = ref_opt.state_dict(), opt.state_dict()
    assert sr["param_groups"] == sg["param_groups"]          # LR the scheduler set, identical bookkeeping
    assert sr["state"].keys() == sg["state"].keys() and sg["state"]
    for k in sr["state"]:
        for f, v in sr["state"][k].items():
            assert torch.equal(v, sg["state"][k][f]) if isinstance(v, torch.Tensor) else v == sg["state"][k][f]


def test_checkpoint_round_trip_continues_exactly():
    """opt.state_dict() / load_state_dict() into a fresh optimizer: the in-backward steps go on from it."""
    case = model_case("llama", layers=1)
    make = OPTIMIZERS["adamw"]
    ref, ref_opt, _ = _train(copy.deepcopy(case.model), make, case, steps=3)
    got = effpass.compile(copy.deepcopy(case.model), passes=[StepInBackward()], lowering="eager")
    opt = make(got.parameters())
    for _ in range(2):
        case.loss(got(**case.inputs)).backward(); opt.step(); opt.zero_grad()
    opt2 = make(got.parameters())
    opt2.load_state_dict(opt.state_dict())
    detach(opt)  # the replaced optimizer (it may stay alive: captured logs, user code) steps nothing more
    del opt
    attach(opt2)
    case.loss(got(**case.inputs)).backward()
    assert all(p.grad is None for p in got.parameters())     # stepped in backward by the new optimizer
    opt2.step()
    # reference: 3 plain steps without a scheduler
    plain = effpass.compile(copy.deepcopy(case.model), passes=[], lowering="eager")
    popt = make(plain.parameters())
    for _ in range(3):
        case.loss(plain(**case.inputs)).backward(); popt.step(); popt.zero_grad()
    pr, pg = _params(plain), _params(got)
    assert all(torch.equal(pr[k], pg[k]) for k in pr)


def test_gradient_accumulation_refused():
    case = model_case("llama", layers=1)
    m = effpass.compile(copy.deepcopy(case.model), passes=[StepInBackward()], lowering="eager")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    attach(opt)
    case.loss(m(**case.inputs)).backward()
    with pytest.raises(StepInBackwardError, match="gradient accumulation"):
        case.loss(m(**case.inputs)).backward()


def test_unsupported_optimizer_refused():
    case = model_case("llama", layers=1)
    m = effpass.compile(copy.deepcopy(case.model), passes=[StepInBackward()], lowering="eager")
    opt = torch.optim.Adagrad(m.parameters(), lr=1e-3)
    with pytest.raises(StepInBackwardError, match="Adagrad is not supported.*AdamW"):
        attach(opt)
    with pytest.raises(StepInBackwardError, match="closure"):
        opt2 = torch.optim.SGD(m.parameters(), lr=1e-3)
        attach(opt2)
        opt2.step(lambda: None)


def test_frozen_and_excluded_parameters_keep_their_gradients():
    case = model_case("llama", layers=1)
    model = copy.deepcopy(case.model)
    model.model.embed_tokens.weight.requires_grad_(False)
    m = effpass.compile(model, passes=[StepInBackward(exclude=("lm_head",))], lowering="eager")
    stats = effpass.report(m).stats("step_in_backward", "module")
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert stats["parameters"] == len(trainable) - 1 == hooked_parameters(m)
    hooked = [p for n, p in m.named_parameters() if p.requires_grad and "lm_head" not in n]
    assert stats["elements"] == sum(p.numel() for p in hooked)
    assert stats["gradient_bytes"] == sum(p.numel() * p.element_size() for p in hooked)
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    attach(opt)
    case.loss(m(**case.inputs)).backward()
    # one graph holds the whole step: every hooked parameter is one of its inputs
    assert effpass.report(m).stats("step_in_backward", "torch_ir")["graph_parameters"] == len(hooked)
    assert [n.replace("_orig_mod.", "") for n, p in m.named_parameters() if p.grad is not None] == ["lm_head.weight"]
    opt.step()      # steps the excluded one in the usual way
    assert m.lm_head.weight.grad is not None


def test_step_peak_memory_lower_by_the_gradients():
    """A step's peak (forward, backward, opt.step) with the pass is lower than without by about the
    gradient bytes minus the largest parameter's (its gradient exists while it is stepped)."""
    torch.manual_seed(0)
    base, x = TanhStack(), torch.randn(2, 256)
    peaks, params = {}, {}
    for use in (False, True):
        # eager (effpass.prepare runs the module phase only): autograd hands each gradient over on its own.
        # One compiled backward graph returns all its gradients at once (see the docs): no saving there.
        m = effpass.prepare(copy.deepcopy(base), passes=[StepInBackward()] if use else [])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        attach(opt)

        def step():
            m(x).backward()
            opt.step()
            opt.zero_grad()
        for _ in range(2):
            step()            # optimizer states exist from here on
        _, peaks[use] = peak_memory(step)
        params[use] = _params(m)
    assert all(torch.equal(params[False][k], params[True][k]) for k in params[False])
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    largest = max(p.numel() * p.element_size() for p in base.parameters())
    saved = peaks[False] - peaks[True]
    assert 0.9 * (grad_bytes - largest) <= saved <= grad_bytes, (peaks, grad_bytes, largest)


def test_trainer_losses_and_state_equal_a_normal_run(tmp_path):
    transformers = pytest.importorskip("transformers")
    from effpass.testing.hf import lm_dataset

    data, runs = lm_dataset(8), {}
    for use in (False, True):
        torch.manual_seed(0)
        model = model_case("llama", layers=1).model
        model = effpass.compile(model, passes=[StepInBackward()] if use else [], lowering="eager")
        args = transformers.TrainingArguments(
            str(tmp_path / str(use)), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=1,
            max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True,
            disable_tqdm=True, lr_scheduler_type="linear", learning_rate=1e-2)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        runs[use] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], _params(model),
                     trainer.optimizer.state_dict(), trainer.lr_scheduler.get_last_lr())
    (l0, p0, s0, lr0), (l1, p1, s1, lr1) = runs[False], runs[True]
    assert len(l1) == 3 and l1 == l0 and lr1 == lr0
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(torch.equal(s0["state"][k]["exp_avg"], s1["state"][k]["exp_avg"]) for k in s0["state"])


def test_trainer_refuses_clipping_and_accumulation(tmp_path):
    transformers = pytest.importorskip("transformers")
    from effpass.integrations.huggingface import check_training_args

    model = effpass.compile(model_case("llama", layers=1).model, passes=[StepInBackward()], lowering="eager")
    for kw, what in ((dict(max_grad_norm=1.0), "max_grad_norm=1.0"),
                     (dict(max_grad_norm=0.0, gradient_accumulation_steps=2), "gradient_accumulation_steps=2")):
        args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)
        with pytest.raises(ValueError, match=what):
            check_training_args(args, model)
    check_training_args(transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True,
                                                       max_grad_norm=0.0), model)


# ------------------------------------------------------------------------------------------------------
# under effpass.compile: the update inside the compiled backward graph
# ------------------------------------------------------------------------------------------------------
_BACKWARDS: list[dict] = []


class _RecordBackward(effpass.Pass):
    """Test pass: what each backward graph returns and how many step ops it holds."""

    def transform_post_grad(self, gm, ctx):
        if ctx.graph_kind == "backward":
            out = next(iter(gm.graph.find_nodes(op="output")))
            leaves = torch.utils._pytree.arg_tree_leaves(*out.args)
            _BACKWARDS.append({"gradients": sum(isinstance(x, torch.fx.Node) for x in leaves),
                               "steps": sum(1 for n in gm.graph.nodes if n.target is torch.ops.effpass.step_parameter.default)})
        return effpass.PassResult(False, {})


@pytest.fixture
def record_backward():
    import dataclasses

    from effpass.pass_api import _REGISTRY

    effpass.registered_passes()
    saved = dict(_REGISTRY)
    effpass.register_pass("record_backward", run_after=("step_in_backward",))(
        dataclasses.dataclass(frozen=True, kw_only=True)(type("_RecordBackward", (_RecordBackward,), {})))
    _BACKWARDS.clear()
    yield _REGISTRY["record_backward"]
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def test_compiled_backward_steps_in_graph_and_frees_each_gradient(record_backward):
    """One compiled graph: the backward graph returns no parameter gradient (each one goes to a step op
    where it is complete), and the step's peak falls by about the gradient bytes, as eagerly."""
    torch.manual_seed(0)
    base, x = TanhStack(), torch.randn(2, 256)
    peaks, params = {}, {}
    for use in (False, True):
        m = effpass.compile(copy.deepcopy(base), passes=[record_backward(), *([StepInBackward()] if use else [])],
                            lowering="eager")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        attach(opt)

        def step():
            m(x).backward()
            opt.step()
            opt.zero_grad()
        for _ in range(2):
            step()
        _, peaks[use] = peak_memory(step)
        params[use] = _params(m)
        if use:
            assert effpass.report(m).stats("step_in_backward", "joint") == {"steps_in_graph": 8}
    n = len(list(base.parameters()))
    assert _BACKWARDS == [{"gradients": n, "steps": 0}, {"gradients": 0, "steps": n}]
    assert all(torch.equal(params[False][k], params[True][k]) for k in params[False])
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    largest = max(p.numel() * p.element_size() for p in base.parameters())
    saved = peaks[False] - peaks[True]
    assert 0.9 * (grad_bytes - largest) <= saved <= grad_bytes, (peaks, grad_bytes, largest)


def test_inductor_backward_steps_bit_identical():
    """Inductor computes a pointwise read of a parameter lazily inside a later kernel: the step op must
    still see every read of the old parameter done (its ``after`` operands). AdamW foreach, 3 steps."""
    case = model_case("llama", layers=1)
    runs = {}
    for use in (False, True):
        m = effpass.compile(copy.deepcopy(case.model), passes=[StepInBackward()] if use else [], lowering="inductor")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        attach(opt)
        losses = []
        for _ in range(3):
            loss = case.loss(m(**case.inputs))
            loss.backward()
            assert not use or all(p.grad is None for p in m.parameters())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[use] = (losses, _params(m), opt.state_dict())
        if use:
            assert effpass.report(m).stats("step_in_backward", "joint")["steps_in_graph"] == len(list(m.parameters()))
    (l0, p0, s0), (l1, p1, s1) = runs[False], runs[True]
    assert l0 == l1
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(torch.equal(s0["state"][k]["exp_avg_sq"], s1["state"][k]["exp_avg_sq"]) for k in s0["state"])


def test_torchao_adamw8bit_steps_in_graph_bit_identical(record_backward):
    """torchao's AdamW8bit (uint8 states, a tensor subclass) steps inside the compiled backward: its first step
    creates the states there (``Tensor.to`` on the subclass, which needs the autograd keys a custom op's kernel
    lacks), and parameters and states equal the usual step after 2 steps."""
    AdamW8bit = pytest.importorskip("torchao.optim").AdamW8bit
    torch.manual_seed(0)
    base, x = TanhStack(depth=2), torch.randn(2, 256)
    runs = {}
    for use in (False, True):
        _BACKWARDS.clear()
        m = effpass.compile(copy.deepcopy(base), passes=[record_backward(), *([StepInBackward()] if use else [])],
                            lowering="eager")
        opt = AdamW8bit(m.parameters(), lr=1e-2, weight_decay=0.01)
        attach(opt)
        for _ in range(2):
            m(x).backward()
            assert not use or all(p.grad is None for p in m.parameters())
            opt.step()
            opt.zero_grad()
        states = {(name, k): (v.dequantize() if hasattr(v, "dequantize") else v)
                  for name, p in m.named_parameters() for k, v in opt.state[p].items()}
        runs[use] = (_params(m), states, [dict(b) for b in _BACKWARDS])
    (p0, s0, b0), (p1, s1, b1) = runs[False], runs[True]
    n = len(list(base.parameters()))
    assert b1 == [{"gradients": 0, "steps": n}] and b0 == [{"gradients": n, "steps": 0}]  # one backward graph each
    assert type(next(iter(s1.values()))).__name__ != "OptimState8bit"  # compared dequantized
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert s0.keys() == s1.keys() and all(torch.equal(torch.as_tensor(s0[k]), torch.as_tensor(s1[k])) for k in s0)


class _Shared(torch.nn.Module):
    """A linear used on both sides of a graph break: each compiled graph sees only part of its gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).tanh()
        torch._dynamo.graph_break()
        return self.lin(y).square().mean()


def test_parameter_in_two_graphs_stepped_by_the_usual_step():
    """Each graph's gradient is a part: the in-graph op accumulates instead of stepping, opt.step() steps it;
    parameters equal a plain run's."""
    torch.manual_seed(0)
    base, x = _Shared(), torch.randn(2, 8)
    runs = {}
    for use in (False, True):
        m = effpass.compile(copy.deepcopy(base), passes=[StepInBackward()] if use else [], lowering="eager")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        attach(opt)
        for _ in range(2):
            m(x).backward()
            assert all(p.grad is not None for p in m.parameters())
            opt.step()
            opt.zero_grad()
        runs[use] = _params(m)
        if use:
            assert effpass.report(m).stats("step_in_backward", "torch_ir")["shared_parameters"] == 2
    assert all(torch.equal(runs[False][k], runs[True][k]) for k in runs[False])


_STEPS: list = []


class _RecordSteps(effpass.Pass):
    """Test pass: the step ops of each backward graph."""

    def transform_post_grad(self, gm, ctx):
        if ctx.graph_kind == "backward":
            _STEPS.extend(n for n in gm.graph.nodes if n.target is torch.ops.effpass.step_parameter.default)
        return effpass.PassResult(False, {})


def test_with_tiles_the_step_holds_no_value_of_the_backward():
    """tile_sequence + step_in_backward: the step op waits for empty tokens of the parameter's backward reads,
    not for the reads themselves (which would keep every tile's reads of a weight alive until its whole gradient
    is complete: measured 844 against 826 MiB at 8,192 tokens before). Oracles: structural (every operand of a
    step op other than the parameter and its gradient holds 0 elements; tiles exist) and numerical (parameters
    bit-identical to the usual step after two steps, eager lowering)."""
    import dataclasses

    from effpass.pass_api import _REGISTRY
    from effpass.passes import TileSequence

    case = model_case("llama", layers=1, batch=1, seq=32)  # the step ops' waits are per parameter: one block has them
    case.model.train()
    effpass.registered_passes()
    saved = dict(_REGISTRY)
    record = effpass.register_pass("record_steps", run_after=("step_in_backward",))(
        dataclasses.dataclass(frozen=True, kw_only=True)(_RecordSteps))
    _STEPS.clear()
    params = {}
    try:
        for use in (False, True):
            torch.manual_seed(0)
            passes = [TileSequence(tile_rows=8), record()] + ([StepInBackward()] if use else [])
            m = effpass.compile(copy.deepcopy(case.model), passes=passes, lowering="eager")
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
            attach(opt)
            for _ in range(2):
                case.loss(m(**case.inputs)).backward()
                opt.step()
                opt.zero_grad()
            assert effpass.report(m).stats("tile_sequence")["regions"] >= 1
            params[use] = _params(m)
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
    seen = list(_STEPS)
    assert seen and all(isinstance(a, torch.fx.Node) for s in seen for a in s.args[2])
    after = [a for s in seen for a in s.args[2]]
    assert after, "no step op waits for a read of its parameter (the oracle could not fail)"
    assert all(a.meta["val"].numel() == 0 for a in after), [(a.name, tuple(a.meta["val"].shape)) for a in after]
    assert all(torch.equal(params[False][k], params[True][k]) for k in params[False])
