"""apply_autocast: parity with eager torch.autocast, fp32 islands, user regions, stats, caches."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn as nn

import effpass
from effpass.passes import ApplyAutocast
from effpass.graph import is_autocast_enter
from effpass.passes.apply_autocast import dtype_counts, node_dtypes
from effpass.testing import compile_and_compare, dynamo_counters, loss_of, model_case, train_steps

BF16 = torch.bfloat16
# Gradients: CPU bf16 gives bit-identical gradients (measured: max abs diff 0 on all four models); the
# bound we state and check is bf16's unit roundoff relative to each gradient.
GRAD_RTOL, GRAD_ATOL = 2.0 ** -8, 1e-6


def _autocast_reference(case, dtype=BF16):
    def ref(m):
        with torch.autocast("cpu", dtype):
            return m(**case.inputs)
    return ref


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "demo"])
def test_apply_autocast_matches_eager_autocast(name):
    case = model_case(name)
    r = compile_and_compare(case, [ApplyAutocast(dtype=BF16)], reference=_autocast_reference(case), check=False,
                            step=False)
    # Forward: identical to eager torch.autocast on CPU bf16.
    assert len(r.compiled_out) == len(r.eager_out)
    for c, e in zip(r.compiled_out, r.eager_out):
        assert c.dtype == e.dtype
        assert torch.equal(c, e)
    # Backward: within bf16 rounding (stated bound above).
    assert r.compiled_grads.keys() == r.eager_grads.keys() and r.compiled_grads
    for k in r.eager_grads:
        torch.testing.assert_close(r.compiled_grads[k], r.eager_grads[k], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)
    # Structural: matmuls moved from fp32 to bf16; no recompiles.
    st = r.report.stats("apply_autocast")
    assert st["regions"] >= 1 and st["fp32_islands"] == 0
    assert set(st["matmuls_by_dtype_before"]) == {"float32"}
    assert st["matmuls_by_dtype_after"].get("bfloat16", 0) > 0
    assert st["matmuls_by_dtype_after"].get("float32", 0) == 0
    assert r.counters["recompiles"] == 0


def test_apply_autocast_differs_from_fp32():
    """The oracle can fail: without the pass the output is not the autocast output."""
    case = model_case("demo")
    r = compile_and_compare(case, [], reference=_autocast_reference(case), check=False, step=False)
    assert not torch.equal(r.compiled_out[0], r.eager_out[0])


def _hand_written_island(model, module_name):
    """The eager reference for an fp32 island: the module runs with autocast off on fp32 inputs."""
    mod = model.get_submodule(module_name)
    orig = mod.forward

    def forward(x, *a, **k):
        with torch.autocast("cpu", enabled=False):
            return orig(x.float(), *a, **k)
    mod.forward = forward
    return model


def test_apply_autocast_fp32_island_from_exclude():
    case = model_case("demo")
    reference = _hand_written_island(copy.deepcopy(case.model), "lm_head")
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16, exclude=["lm_head"])], lowering="eager")
    out = compiled(**case.inputs)
    with torch.autocast("cpu", BF16):
        ref = reference(**case.inputs)
    assert out[1].dtype == torch.float32                    # logits come from the fp32 lm_head
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["fp32_islands"] == 1 and st["island_modules"] == ["lm_head"]
    # module phase: the whole model is one region (its root), lm_head the one island inside it
    assert st["wrapped_regions"] == 1 and st["wrapped_islands"] == 1, st
    # 2 layers x 7 linears + 2 attention matmuls per layer = 18 low-precision matmuls; the lm_head stays fp32.
    assert st["matmuls_by_dtype_after"] == {"bfloat16": 18, "float32": 1}
    assert st["matmuls_by_dtype_before"] == {"float32": 19}


def test_apply_autocast_dtype_of_each_op():
    """Which op runs in which dtype, node by node, on a captured graph."""
    case = model_case("demo", layers=1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(case.model, backend=capture)(**case.inputs)
    gm, ex = graphs[0]
    from effpass.manager import PassContext
    from effpass.pass_api import Phase
    from effpass.scope import Scope

    p = ApplyAutocast(dtype=BF16, exclude=["lm_head"])
    ctx = PassContext(pass_name=p.name, phase=Phase.TORCH_IR, graph_kind="torch_ir",
                      scope=Scope(p.name, p.targets, p.exclude, root=case.model), model=case.model,
                      example_inputs=ex, device=torch.device("cpu"))
    p.transform_torch_ir(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    dtypes = node_dtypes(gm, ex)
    by_module: dict[str, set] = {}
    from effpass.scope import module_path_of_node
    for n, dt in dtypes.items():
        if n.op == "call_function" and "linear" in str(n.target):
            by_module.setdefault(module_path_of_node(n), set()).add(dt)
    assert by_module["lm_head"] == {torch.float32}
    assert by_module["layers.0.self_attn.q_proj"] == {BF16}
    assert by_module["layers.0.mlp.down_proj"] == {BF16}
    softmax = [dt for n, dt in dtypes.items() if "softmax" in str(n.target)]
    assert softmax == [torch.float32]                       # autocast keeps softmax in fp32
    ops, mms = dtype_counts(dtypes)
    assert mms == {"bfloat16": 9, "float32": 1}
    assert sum(is_autocast_enter(n) for n in gm.graph.nodes) == 2   # the region and the island


def test_apply_autocast_fp32_island_from_skip_decorator():
    case = model_case("demo")
    effpass.skip("apply_autocast")(case.model.layers[0].mlp)
    reference = copy.deepcopy(case.model)
    _hand_written_island(reference, "layers.0.mlp")
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16)], lowering="eager")
    out = compiled(**case.inputs)
    with torch.autocast("cpu", BF16):
        ref = reference(**case.inputs)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["fp32_islands"] == 1 and all(m.startswith("layers.0.mlp") for m in st["island_modules"])
    assert st["matmuls_by_dtype_after"]["float32"] == 3     # gate, up and down projections of layer 0


class _UserRegion(nn.Module):
    """A model whose author already wrote an autocast region (fp32 on purpose around `head`)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float()).sum()


def test_apply_autocast_keeps_user_autocast_regions():
    torch.manual_seed(0)
    model = _UserRegion()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16)
    compiled = effpass.compile(model, passes=[ApplyAutocast(dtype=BF16)], lowering="eager")
    out = compiled(x)
    with torch.autocast("cpu", BF16):
        expected = ref(x)
    assert torch.equal(out, expected)
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["user_regions_kept"] == 1
    assert st["regions"] == 1                                 # ours covers the body only
    assert st["matmuls_by_dtype_after"] == {"bfloat16": 1, "float32": 1}


def test_apply_autocast_skips_when_caller_runs_autocast():
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16)], lowering="eager")
    with torch.autocast("cpu", torch.float16):
        compiled(**case.inputs)
    rec = [r for r in effpass.report(compiled).records("apply_autocast") if r.graph == "torch_ir"][0]
    assert not rec.changed and "already enabled" in rec.skipped[0]["reason"]
    assert rec.stats["regions"] == 0 and rec.stats["inherited_regions"] == 1
    assert set(rec.stats["matmuls_by_dtype_after"]) == {"float16"}   # the caller's fp16 won


def test_apply_autocast_tracks_eager_training():
    """20 AdamW steps: the compiled bf16 run tracks eager torch.autocast (stated tolerance 1e-3 relative)."""
    case = model_case("demo")
    eager = copy.deepcopy(case.model)
    with dynamo_counters() as counters:
        compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16)], lowering="eager")
        got = train_steps(compiled, case, 20, lr=3e-3)

    def fwd(m):
        with torch.autocast("cpu", BF16):
            return m(**case.inputs)
    want = train_steps(eager, case, 20, lr=3e-3, forward=fwd)
    assert got[-1] < got[0] - 0.5                            # it trains
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-3 * abs(w), (got, want)
    assert counters["graph_breaks"] == 0 and counters["recompiles"] == 0


def test_apply_autocast_dump_shows_dtype_counts(tmp_path):
    case = model_case("demo", layers=1)
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16)], lowering="eager",
                               dump_dir=str(tmp_path))
    compiled(**case.inputs)
    index = json.load(open(os.path.join(tmp_path, "graph_000", "index.json")))
    text = json.dumps(index)
    assert "ops_by_dtype_before" in text and "ops_by_dtype_after" in text and "bfloat16" in text
    # module capture: the module phase wraps forward (module/index.json); the torch-IR record reports
    rec = next(r for r in index["passes"] if r["name"] == "apply_autocast")
    assert rec["stats"]["capture"] == "module" and rec["stats"]["regions"] == 1
    module_index = json.load(open(os.path.join(tmp_path, "module", "index.json")))
    assert any(r["name"] == "apply_autocast" and r["changed"] for r in module_index["passes"])


def test_apply_autocast_fp16_without_scale_loss_warns():
    case = model_case("demo", layers=1)
    with pytest.warns(UserWarning, match="without scale_loss"):
        compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.float16)], lowering="eager")
        compiled(**case.inputs)


def test_apply_autocast_options_are_validated():
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        ApplyAutocast(dtype=torch.float32)
    with pytest.raises(TypeError, match="not a dtype"):
        ApplyAutocast(dtype="int8")
    assert ApplyAutocast(dtype="fp16").dtype == torch.float16
    assert effpass.make_pass("apply_autocast", {"dtype": "bf16"}).dtype == BF16


def test_apply_autocast_default_is_off_on_cpu():
    assert ApplyAutocast.enabled_by_default("cpu") is False
    assert "off on CPU" in ApplyAutocast.default_note() and "bf16" in ApplyAutocast.default_note()
    assert all(p.name != "apply_autocast" for p in effpass.default_pipeline("cpu"))


# apply_autocast lowered by Inductor against eager torch.autocast (bf16), and that a second process hits the
# AOTAutograd cache with its regions in the graph (its autocast nodes are marked cacheable): both checked on one
# Inductor compile by tests/core/test_backend.py's two-process cache test, whose pipeline includes apply_autocast.
# A failure of the pass itself shows first in the eager tests of this file (bit-identical to eager autocast).


# ---- module capture (issue 14 item 1): bit-identical to eager torch.autocast, fp16 too ---------------
@pytest.mark.parametrize("family", ["qwen3", "olmo2"])   # the families where the old graph capture differed
def test_apply_autocast_fp16_bit_identical_to_eager(family):
    from _families import family_case
    from effpass.testing import grads_of

    case = family_case(family)
    reference = copy.deepcopy(case.model)
    with pytest.warns(UserWarning, match="without scale_loss"):
        compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.float16)], lowering="eager")
    out = compiled(**case.inputs)
    with torch.autocast("cpu", torch.float16):
        expected = reference(**case.inputs)
    loss_of(out).backward()
    loss_of(expected).backward()
    assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)
    got, want = grads_of(case.model), grads_of(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["capture"] == "module" and st["matmuls_by_dtype_after"].get("float16", 0) > 0


def test_apply_autocast_prepared_eager_model_is_the_reference():
    """Reference semantics: after effpass.prepare the eager model itself runs under autocast."""
    case = model_case("demo", layers=1)
    reference = copy.deepcopy(case.model)
    effpass.prepare(case.model, passes=[ApplyAutocast(dtype=BF16, exclude=["lm_head"])])
    eager_copy = copy.deepcopy(case.model)          # the wrappers survive deepcopy, bound to the copy
    _hand_written_island(reference, "lm_head")
    with torch.autocast("cpu", BF16):
        want = reference(**case.inputs)
    for m in (case.model, eager_copy):
        got = m(**case.inputs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert eager_copy.forward.__self__ is eager_copy and eager_copy.lm_head.forward.__self__ is eager_copy.lm_head


def test_apply_autocast_targets_make_regions_of_those_modules_only():
    case = model_case("demo", layers=2)
    reference = copy.deepcopy(case.model)
    layer = reference.layers[1]
    orig = layer.forward

    def forward(*a, **k):
        with torch.autocast("cpu", BF16):
            return orig(*a, **k)
    layer.forward = forward
    compiled = effpass.compile(case.model, passes=[ApplyAutocast(dtype=BF16, targets=["layers.1"])], lowering="eager")
    out = compiled(**case.inputs)
    want = reference(**case.inputs)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    st = effpass.report(compiled).stats("apply_autocast")
    assert st["region_modules"] == ["layers.1"] and st["regions"] == 1
    assert st["wrapped_regions"] == 1 and st["wrapped_islands"] == 0, st  # nothing excluded inside layers.1
    assert st["matmuls_by_dtype_after"] == {"bfloat16": 9, "float32": 10}   # 7 linears + 2 attention matmuls


def test_apply_autocast_string_backend_edits_the_graph_and_says_so():
    """No module phase through torch.compile(backend="effpass"): graph capture, with a warning saying it may
    differ from eager autocast and how to get the bit-identical path."""
    case = model_case("demo", layers=1)
    reference = copy.deepcopy(case.model)
    m = torch.compile(case.model, backend="effpass",
                      options={"passes": {"apply_autocast": {"dtype": "bf16"}}, "lowering": "eager"})
    with pytest.warns(UserWarning, match=r"without its module phase.*effpass\.compile"):
        out = m(**case.inputs)
    with torch.autocast("cpu", BF16):
        want = reference(**case.inputs)
    assert torch.equal(out[0], want[0])                  # the demo model reads no dtype: equal here
    st = effpass.report().stats("apply_autocast")
    assert st["capture"] == "graph" and st["regions"] == 1


def test_fp32_routers_through_the_string_backend_says_it_is_not_applied():
    """fp32_routers=True cannot be kept on a traced graph alone (the routers are found on the eager model): the
    string backend says so, naming the option and the path that keeps it, and the graph is autocast as eager
    autocast would run it (routers included)."""
    case = model_case("demo", layers=1)
    m = torch.compile(case.model, backend="effpass",
                      options={"passes": {"apply_autocast": {"dtype": "bf16", "fp32_routers": True}},
                               "lowering": "eager"})
    with pytest.warns(UserWarning, match=r"fp32_routers=True\) is not applied through torch\.compile.*"
                                         r"effpass\.compile"):
        m(**case.inputs)
    st = effpass.report().stats("apply_autocast")
    assert st["capture"] == "graph" and st["regions"] == 1 and "fp32_router_islands" not in st


def test_fp32_routers_departure_is_named_on_every_graph_it_touches():
    """fp32_routers=True departs from eager torch.autocast on MoE models: the routers' logits are fp32 (eager
    autocast: bf16), and the module phase and every graph holding a router island say so, naming the option that
    reproduces eager autocast; a dense model says nothing of it. The default (False) is eager autocast's."""
    import warnings

    from _families import family_case

    case = family_case("mixtral")
    gate = dict(case.model.named_modules())["model.layers.0.mlp.gate"]
    seen = []
    gate.register_forward_hook(lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        case.model(**case.inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        effpass.prepare(case.model, passes=[ApplyAutocast(dtype=torch.bfloat16, fp32_routers=True)])
        case.model(**case.inputs)
    assert seen == [torch.bfloat16, torch.float32]
    assert ApplyAutocast().fp32_routers is False
    case = family_case("mixtral")
    m = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.bfloat16)], lowering="eager")
    m(**case.inputs)  # the default: routers as eager autocast runs them, nothing to name
    assert not any("departs_from_eager_autocast" in r.stats for g in effpass.report(m).graphs for r in g.records)
    case = family_case("mixtral")
    m = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.bfloat16, fp32_routers=True)], lowering="eager")
    m(**case.inputs).loss.backward()
    recs = [r for g in effpass.report(m).graphs for r in g.records if r.name == "apply_autocast"]
    graph_recs = [r for r in recs if r.phase == "torch_ir"]
    assert graph_recs and all(r.stats.get("fp32_router_islands") == 1 and "fp32_routers=False reproduces eager "
                              "autocast" in r.stats["departs_from_eager_autocast"] for r in graph_recs)
    case = family_case("llama")
    m = effpass.compile(case.model, passes=[ApplyAutocast(dtype=torch.bfloat16)], lowering="eager")
    m(**case.inputs)
    assert not any("departs_from_eager_autocast" in r.stats for g in effpass.report(m).graphs for r in g.records)
    # the graph hook changes nothing under module capture, and says why (issue 38.3)
    graph = [r for g in effpass.report(m).graphs for r in g.records if r.phase == "torch_ir"]
    assert graph and all(not r.changed and r.why_unchanged.startswith("the module phase's wrappers entered this "
                                                                      "graph's autocast regions (1 region(s)")
                         for r in graph)
