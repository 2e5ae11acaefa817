"""Milliseconds fuse_attention's and pack_sequences' torch-IR hooks take (PassRecord.ms, summed over graphs) on a few
families, lowering="eager". Run from a checkout's root: python bench/results/issue22_behaviour/pass_ms.py ROUNDS"""
import sys, json
sys.path.insert(0, "tests")
import torch, effpass
from effpass.passes.fuse_attention import FuseAttention
from effpass.passes.pack_sequences import PackSequences
from _families import family_case

out = {}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    for fam in ("llama", "gpt2", "bloom", "falcon_old"):
        case = family_case(fam)
        torch._dynamo.reset()
        m = effpass.compile(case.model, passes=[FuseAttention(), PackSequences(require_boundaries=False)],
                            lowering="eager")
        m(**case.inputs)
        rep = effpass.report(m)
        for name in ("fuse_attention", "pack_sequences"):
            ms = sum(r.ms for r in rep.records(name) if r.phase == "torch_ir")
            out.setdefault(f"{fam}/{name}", []).append(round(ms, 2))
print(json.dumps(out))
