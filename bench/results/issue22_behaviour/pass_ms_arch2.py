"""Milliseconds fuse_cross_entropy's torch-IR hook (a LoRA head) and checkpoint_activations' joint hook take
(PassRecord.ms, summed over graphs): effpass's one-layer DemoLM with LoRA on lm_head and q_proj, lowering="eager",
one forward+backward per round, ROUNDS rounds (default 3) in one process. Run from a checkout's root:
python bench/results/issue22_behaviour/pass_ms_arch2.py [ROUNDS]   (prints one JSON line: lists per round)."""
import json
import sys

import torch

import effpass
from effpass.passes import CheckpointActivations, FuseCrossEntropy, InjectLoRA
from effpass.testing.models import DemoConfig, DemoLM

out = {}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    torch.manual_seed(0)
    model = DemoLM(DemoConfig(vocab_size=512, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=128)).train()
    torch._dynamo.reset()
    m = effpass.compile(model, passes=[InjectLoRA(rank=4, alpha=8, targets=["lm_head", "*.q_proj"]),
                                       CheckpointActivations(), FuseCrossEntropy()], lowering="eager")
    ids = torch.randint(0, 512, (2, 16))
    loss, _ = m(ids, ids)
    loss.backward()
    rep = effpass.report(m)
    for name, phase in (("fuse_cross_entropy", "torch_ir"), ("checkpoint_activations", "joint")):
        out.setdefault(name, []).append(round(sum(r.ms for r in rep.records(name) if r.phase == phase), 2))
    out.setdefault("lora_heads", []).append(rep.stats("fuse_cross_entropy").get("lora_heads"))
print(json.dumps(out))
