"""Optimizers the memory planner may choose (built on fake parameters by its replay, so their states are
sized by the real optimizer): torchao's 8-bit AdamW."""
from __future__ import annotations

import effpass


def _adamw8bit(params, lr=1e-3, device=None):
    from effpass.quantized import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=lr)


effpass.register_optimizer("adamw8bit", _adamw8bit,
                           "torchao.optim.AdamW8bit (uint8 states in blocks of 256 with fp32 scales)")
effpass.register_memory_option(effpass.MemoryOption(
    technique="adamw8bit", lossless=False, group="optimizer", changes="optimizer_states", phase="module",
    optimizer="adamw8bit", replaces_optimizer="adamw",
    cost="quantizes AdamW's states to 8 bits; build the optimizer as torchao.optim.AdamW8bit"))
