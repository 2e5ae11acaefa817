"""The planner counts an MoE model as storage holds it: NF4 expert weights by their inner tensors, expert
adapters as trainable parameters with their optimizer states (issue 24, item 4).

Oracles: the prepared real model's storage bytes (structural, exact) and the measured peak of one training
step of the real model compiled with the same passes (within 1%; on CPU with the eager lowering the replay
agrees to the byte)."""
import copy

import torch

import effpass
from effpass.passes import InjectLoRA, QuantizeLinear
from effpass.planning import estimate_memory
from effpass.planning.measure import measure_step
from effpass.quantized import storage_bytes

from _families import family_case


def _passes():
    return [QuantizeLinear(scheme="nf4", exclude=["lm_head"]),
            InjectLoRA(rank=4, targets=["*.q_proj", "*.v_proj", "*.experts.gate_up_proj", "*.experts.down_proj"])]


def test_planner_counts_quantized_experts_and_expert_adapters():
    case = family_case("qwen3_moe")
    model = case.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    prepared = effpass.prepare(copy.deepcopy(model), passes=_passes())
    trainable = [p for p in prepared.parameters() if p.requires_grad]
    expert_adapters = [n for n, p in prepared.named_parameters() if p.requires_grad and "lora_experts" in n]
    assert expert_adapters  # adapters on the experts, not only on attention
    est = estimate_memory(model, case.inputs, passes=_passes(), lowering="eager")
    # the replay's fake copy quantized its experts as the real prepare did (no probe on fake weights)
    q = est.pass_stats["quantize_linear"]
    assert q["quantized_expert_tensors"] == 2, q
    # parameters and buffers as the prepared model holds them (NF4 experts by their inner tensors):
    # 64,544 bytes (the experts in fp32 would be 107,232)
    held = storage_bytes(list(prepared.parameters()) + list(prepared.buffers()))
    assert est.parameters + est.buffers == held == 64_544
    assert held < 0.7 * dense  # the experts really shrank (logical dtype would say otherwise)
    # every trainable tensor (expert adapters included) is counted, and AdamW keeps two fp32 states of each
    assert est.trainable_parameters == storage_bytes(trainable)
    n_train = sum(p.numel() for p in trainable)
    assert 2 * n_train * 4 <= est.optimizer_states <= 2 * n_train * 4 + 64 * len(trainable)
    assert est.gradients == est.trainable_parameters
    # planner vs measured: one real training step of the model compiled with the same passes
    torch._dynamo.reset()
    real = copy.deepcopy(model)
    compiled = effpass.compile(real, passes=_passes(), lowering="eager")
    meas = measure_step(compiled, real, case.inputs, optimizer="adamw")
    assert est.start_bytes == meas.start_bytes, (est.summary(), meas)
    assert abs(est.peak_bytes - meas.peak_bytes) <= 0.01 * meas.peak_bytes, (est.summary(), meas)
