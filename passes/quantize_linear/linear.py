"""``quantize_linear``'s per-linear helpers: fp8 modules (torchao's ``Float8Linear``), outlier columns kept in
the original precision (buffers plus a forward hook), ``nn.Linear`` subclasses with their own forward (a probe,
then ``nn.Linear.forward``), GPT-2's ``Conv1D``, and the module-tree edits. torchao loads on first use only.
"""
from __future__ import annotations

import torch
from torch import nn

from effpass.quantized import is_quantized

__all__ = ["fp8_supported", "float8_linear", "is_float8_linear", "outlier_hook", "outlier_load_pre_hook",
           "dequantized_weight", "with_linear_forward", "conv1d_class", "probe_matches", "set_submodule",
           "weight_problem"]


def fp8_supported(device: torch.device | str | None = None) -> bool:
    """torchao's float8 training (``torch._scaled_mm``) needs a CUDA GPU with compute capability >= 8.9
    (Ada, Hopper and later)."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def float8_linear(lin: nn.Linear, granularity: str, emulate: bool, fsdp_all_gather: bool) -> nn.Module:
    """``lin`` as torchao's ``Float8Linear`` (float8 training: dynamic scales, fp8 matmuls forward and
    backward; ``emulate`` runs the casts with ordinary matmuls, for tests)."""
    import dataclasses

    from effpass.quantized import quiet_torchao_import

    with quiet_torchao_import():  # torchao's first import logs its CUDA-only libraries failing to load on CPU
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

    cfg = Float8LinearConfig.from_recipe_name(granularity)
    # pad_inner_dim: torch._scaled_mm needs every inner dimension divisible by 16, and the backward's weight
    # gradient contracts over the tokens (40 tokens failed on an H100 without it).
    cfg = dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather, pad_inner_dim=True)
    return Float8Linear.from_float(lin, config=cfg)


def is_float8_linear(m) -> bool:
    return type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao.")


# ------------------------------------------------------------------------------------------------------
# outlier columns (kept in the original precision): buffers on the linear plus a forward hook
# ------------------------------------------------------------------------------------------------------
def outlier_hook(mod: nn.Module, args, out):
    if not mod.outlier_idx.numel():
        return out
    x = args[0]
    return out + (x.index_select(-1, mod.outlier_idx) @ mod.outlier_weight.to(x.dtype).t()).to(out.dtype)


def outlier_load_pre_hook(mod, state_dict, prefix, *args):
    """Outlier buffers are data-dependent in size: take the loaded sizes."""
    for name in ("outlier_idx", "outlier_weight"):
        t = state_dict.get(prefix + name)
        buf = mod._buffers.get(name)
        if buf is not None and t is not None and t.shape != buf.shape:
            mod._buffers[name] = torch.empty(t.shape, dtype=buf.dtype, device=buf.device)


# ------------------------------------------------------------------------------------------------------
# linears with their own forward, GPT-2's Conv1D, probes, module-tree edits
# ------------------------------------------------------------------------------------------------------
def dequantized_weight(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight a (quantized) linear computes with, ``[out, in]``, outlier columns included."""
    from effpass.quantized import dequantize

    w = dequantize(module.weight, dtype)
    idx = getattr(module, "outlier_idx", None)
    if idx is not None and idx.numel():
        w = w.index_copy(1, idx, module.outlier_weight.to(w.dtype))
    return w


_LINEAR_FORWARD_CLASSES: dict[type, type] = {}


def with_linear_forward(cls: type) -> type:
    """A subclass of ``cls`` whose forward is ``nn.Linear.forward`` (made once per class)."""
    if cls not in _LINEAR_FORWARD_CLASSES:
        _LINEAR_FORWARD_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": nn.Linear.forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__effpass_linear_forward__": True})
    return _LINEAR_FORWARD_CLASSES[cls]


def conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - transformers is optional
        return None
    return Conv1D


def probe_matches(fn, ref, atol=1e-5) -> str | None:
    try:
        with torch.no_grad():
            got = fn()
    except Exception as e:  # the module's own code rejects the probe
        return f"{type(e).__name__}: {str(e)[:200]}"
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return f"output shape {tuple(getattr(got, 'shape', ()))} != {tuple(ref.shape)}"
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return None if err <= atol * max(1.0, scale) else f"max difference {err:.3g}"


def weight_problem(w: torch.Tensor, tied: set[int]) -> str | None:
    """Why the weight ``w`` cannot be quantized (already quantized, tied to another parameter by ``id``, on
    the meta device, not floating point), or None."""
    if is_quantized(w):
        return f"already quantized ({type(w).__name__})"
    if id(w) in tied:
        return "weight is tied to another parameter (quantizing it would untie them)"
    if w.device.type == "meta":
        return "weight is on the meta device"
    if not w.is_floating_point():
        return f"weight dtype {w.dtype} is not floating point"
    return None


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
