"""One-off GPU diagnostics for the failures scripts/gpu_check.sh found (not a test)."""
import copy, sys, traceback
sys.path.insert(0, ".")
import torch, torch.nn as nn
import effpass

def section(name, fn):
    print(f"===== {name}", flush=True)
    try:
        fn()
    except Exception:
        traceback.print_exc(limit=6)

def offload():
    from tests.test_offload_activations import _mlp, _grads
    from effpass.passes import CheckpointActivations, OffloadActivations
    model, inputs = _mlp("cuda")
    inputs = {k: v.repeat(16, 4) for k, v in inputs.items()}
    passes = [CheckpointActivations(policy="full")]
    ref = effpass.compile(copy.deepcopy(model), passes=passes, lowering="eager")
    cm = effpass.compile(copy.deepcopy(model), passes=passes + [OffloadActivations(min_bytes=1 << 20)], lowering="eager")
    _grads(ref, inputs); _grads(cm, inputs)
    l0, g0 = _grads(ref, inputs); l0b, g0b = _grads(ref, inputs); l1, g1 = _grads(cm, inputs)
    for k in g0:
        d_ref = (g0[k] - g0b[k]).abs().max().item(); d = (g0[k] - g1[k]).abs().max().item()
        print(f"{k:18s} ref-vs-ref {d_ref:.3e}  ref-vs-offload {d:.3e}  |g| {g0[k].abs().max().item():.3e}")
    print("stats", effpass.report(cm).stats("offload_activations"))
    torch.use_deterministic_algorithms(True)
    l0, g0 = _grads(ref, inputs); l1, g1 = _grads(cm, inputs)
    print("deterministic: all equal", all(torch.equal(g0[k], g1[k]) for k in g0),
          {k: (g0[k] - g1[k]).abs().max().item() for k in g0})
    torch.use_deterministic_algorithms(False)

def varlen():
    import tests.test_pack_sequences as T
    from effpass.passes import PackSequences
    model = T._family("llama", "sdpa").cuda().to(torch.bfloat16)
    ids, pos = (t.cuda() for t in T._packed())
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=[PackSequences()], lowering="eager", strict=True)
    with torch.no_grad():
        compiled(input_ids=ids, position_ids=pos)
    rep = effpass.report(compiled)
    print("stats", T._stats(compiled))
    print(rep.summary() if hasattr(rep, "summary") else rep)

def int4():
    from tests.test_quantize_linear import _prepare, SCHEMES, sqnr, dequantized_weight
    import torch.nn.functional as F
    lin = nn.Linear(256, 384).cuda().bfloat16()
    _prepare(nn.Sequential(lin), scheme="int4", outlier_threshold=3.5, **SCHEMES["int4"])
    print("weight type", type(lin.weight).__name__, type(lin.weight).__module__)
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x); ref = F.linear(x, dequantized_weight(lin, torch.bfloat16), lin.bias)
    gy = torch.randn_like(y)
    print("sqnr fwd", sqnr(ref, y), "bwd", sqnr(torch.autograd.grad(ref, x, gy)[0], torch.autograd.grad(y, x, gy)[0]))
    with torch.no_grad():
        x1 = x[:1].detach(); print("decode sqnr", sqnr(F.linear(x1, dequantized_weight(lin, torch.bfloat16), lin.bias), lin(x1)))

for name in sys.argv[1:] or ["offload", "varlen", "int4"]:
    section(name, globals()[name])
