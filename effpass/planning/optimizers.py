"""Optimizers the memory planner may choose: torchao's 8-bit AdamW (built on fake parameters by its replay, so its
states are sized by the real optimizer) and, for CUDA plans, AdamW with its states on the host: torchao's
CPUOffloadOptimizer (``adamw_offload``, which needs CUDA: sized by :mod:`effpass.planning.host_memory`) and
effpass's own :class:`effpass.HostOffloadAdamW` (``adamw_host``: replayed, the optimizer of the
``step_in_backward`` + host plan, whose gradients go to the host inside the backward)."""
from __future__ import annotations

import effpass

from .host_memory import HOST_OPTIMIZERS, REPLAYED_HOST_OPTIMIZERS


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


def _adamw_offload(params, lr=1e-3, device=None):
    import torch

    from effpass.quantized import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(params, torch.optim.AdamW, lr=lr, offload_gradients=False)


HOST_OPTIMIZERS["adamw_offload"] = {"offload_gradients": False}  # sized by effpass.planning.host_memory
effpass.register_optimizer("adamw_offload", _adamw_offload,
                           "torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW): AdamW's states and step on "
                           "the host (CUDA only)")


@effpass.register_memory_option
def _host_optimizer_options(model, *, world_size=1, device=None):
    """AdamW's states on the host: offered for CUDA plans (and when the device is not known)."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return []
    return [effpass.MemoryOption(
        technique="adamw_offload", lossless=True, group="optimizer", changes="optimizer_states", phase="module",
        optimizer="adamw_offload", replaces_optimizer="adamw", label="adamw on host", order=1,
        cost="AdamW's states and step on the host (torchao CPUOffloadOptimizer): gradients to the host and "
             "parameters back over the host link every step; build the optimizer as "
             "torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW)")]


def _adamw_host(params, lr=1e-3, device=None):
    from effpass.host_optim import HostOffloadAdamW

    return HostOffloadAdamW(params, lr=lr)


REPLAYED_HOST_OPTIMIZERS.add("adamw_host")  # its host buffers sized by the replay (host_memory.replayed_host_optimizer)
effpass.register_optimizer("adamw_host", _adamw_host,
                           "effpass.HostOffloadAdamW(params): AdamW's states and step on the host, gradients taken "
                           "one at a time (from step_in_backward inside the backward, or in step())", replayed=True)
