"""``quantize_linear``'s MoE experts path: which 3-D parameters are expert weights, quantizing them per expert
(int8, NF4: ``_quant_experts.ExpertsWeightTensor``), the probe that checks the experts' output before and after
(SQNR floor), and the switch of transformers' experts implementation to its ``"eager"`` loop.
"""
from __future__ import annotations

import torch
from torch import nn

from effpass.quantized import storage_bytes

from .linear import weight_problem

__all__ = ["expert_tensors", "quantize_experts"]


def _formats():
    from . import formats as _quant_formats

    return _quant_formats


def _experts_format():
    from . import experts as _quant_experts

    return _quant_experts


def expert_tensors(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(full parameter name, owning module, attribute) of every 3-D floating parameter of an experts module."""
    out = []
    for mname, mod in model.named_modules():
        if not (type(mod).__name__.endswith("Experts") or hasattr(mod, "num_experts")):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and p.is_floating_point():
                out.append((f"{mname}.{pname}" if mname else pname, mod, pname))
    return out


def quantize_experts(qpass, model, experts, ctx, tied, report, skipped, storages) -> str | None:
    """Quantize 3-D expert weights per expert (int8, nf4: :class:`ExpertsWeightTensor`); list the others
    as skipped. Returns the experts implementation switch made (``"grouped_mm -> eager"``) or None."""
    switched = None
    by_module: dict[int, list] = {}
    for full, mod, attr in experts:
        if not ctx.scope.allows_module(full, mod):
            continue
        by_module.setdefault(id(mod), []).append((full, mod, attr))
    for group in by_module.values():
        mod = group[0][1]

        def skip_all(reason, group=group):
            for full, _, _ in group:
                report[full] = {"status": "skipped", "kind": "experts", "reason": reason}
                skipped.append({"site": full, "reason": reason})

        if qpass.scheme not in ("int8", "nf4"):
            skip_all(f"scheme {qpass.scheme!r} has no 3-D (per-expert) format: int4 is 2-D, fp8 wraps "
                     "nn.Linear; use scheme='int8' or 'nf4' to quantize experts")
            continue
        transposed = _experts_transposed(mod)
        problems = [(full, weight_problem(getattr(mod, attr), tied)) for full, _, attr in group]
        if qpass.scheme == "nf4":
            problems = [(f, p or _nf4_expert_problem(getattr(mod, a), qpass.block_size))
                        for (f, p), (_, _, a) in zip(problems, group)]
        todo = [(f, m, a) for (f, m, a), (_, p) in zip(group, problems) if not p]
        for full, p in problems:
            if p:
                report[full] = {"status": "skipped", "kind": "experts", "reason": p}
                skipped.append({"site": full, "reason": p})
        if not todo:
            continue
        # Probe: the experts module (transformers' "eager" experts loop where it has one) on inputs that
        # reach every expert, before and after quantizing.
        config = getattr(mod, "config", None)
        impl = getattr(config, "_experts_implementation", None)
        switch = config is not None and impl not in (None, "eager") and hasattr(mod, "is_transposed")
        # NOTE(fake weights): the memory planner's replay prepares a copy whose weights are fake tensors
        # (no values): the probe cannot run (routing is data-dependent) and its SQNR means nothing there.
        # The copy is quantized as the real model is (the real prepare runs the probe).
        fake = not _has_values(getattr(mod, todo[0][2]))
        probe = _experts_probe(mod, transposed) if not fake else (lambda: None)
        if switch:
            _set_experts_impl(model, config, "eager")
        try:
            with torch.no_grad():
                ref = probe()
        except Exception as e:
            if switch:
                _set_experts_impl(model, config, impl)
            skip_all(f"experts module {type(mod).__name__} does not run on a probe (hidden, top_k_index, "
                     f"top_k_weights) or (hidden): {type(e).__name__}: {str(e)[:150]}")
            continue
        originals = {a: getattr(mod, a) for _, _, a in todo}
        ewt = _experts_format().ExpertsWeightTensor
        for full, _, attr in todo:
            q = ewt.from_float(originals[attr], qpass.scheme, transposed, qpass.block_size)
            setattr(mod, attr, nn.Parameter(q, requires_grad=False))
        try:
            with torch.no_grad():
                q_out = probe()
        except Exception as e:
            bad = f"{type(e).__name__}: {str(e)[:150]}"
        else:
            bad = None
            if not fake:
                s = _formats().sqnr(ref, q_out)
                floor = 25 if qpass.scheme == "int8" else 10
                bad = None if s > floor else f"probe output SQNR {s:.1f} dB after quantizing (floor {floor} dB)"
        if bad:
            for a, p in originals.items():
                setattr(mod, a, p)
            if switch:
                _set_experts_impl(model, config, impl)
            skip_all(f"the experts' forward fails on {qpass.scheme} weights: {bad}")
            continue
        if switch:
            switched = f"{impl} -> eager"
        for full, _, attr in todo:
            p0 = originals[attr]
            b0, b1 = storage_bytes(p0), storage_bytes(getattr(mod, attr), storages)
            how = ("per expert: F.linear / matmul / bmm dequantize one expert at a time in forward and "
                   "backward (autograd function saving the quantized tensor)")
            report[full] = {"status": "quantized", "kind": "experts", "scheme": qpass.scheme,
                            "weight_type": "ExpertsWeightTensor", "shape": list(p0.shape),
                            "experts": int(p0.shape[0]), "layout": "transposed [experts, in, out]" if transposed
                            else "[experts, out, in]", "bytes_before": b0, "bytes_after": b1,
                            "numel": p0.numel(), "kernel": how, "kernel_grad": how}
    return switched


def _set_experts_impl(model: nn.Module, config, impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(impl)
            return
        except Exception:  # noqa: BLE001 - fall back to the config attribute
            pass
    config._experts_implementation = impl


def _experts_transposed(mod: nn.Module) -> bool:
    """Whether the module stores its experts ``[experts, in, out]`` (GPT-OSS, Llama 4): transformers'
    ``is_transposed`` flag, else a forward that multiplies with ``bmm`` / ``@`` rather than ``F.linear``."""
    flag = getattr(mod, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    import inspect

    try:
        src = inspect.getsource(type(mod).forward)
    except (OSError, TypeError):
        return False
    return ("bmm(" in src or " @ self." in src) and "linear(" not in src


def _has_values(t: torch.Tensor) -> bool:
    """False for tensors without values: fake tensors (the memory planner's replay) and meta tensors."""
    from torch._subclasses.fake_tensor import is_fake

    return not (t.device.type == "meta" or is_fake(t))


def _nf4_expert_problem(w: torch.Tensor, block_size: int) -> str | None:
    per_expert = w[0].numel() if w.dim() == 3 else w.numel()
    if per_expert % block_size:
        return f"{per_expert} weights per expert are not divisible by block_size={block_size}"
    return None


def _experts_probe(mod: nn.Module, transposed: bool):
    """A call of the experts module on fixed inputs that route tokens to every expert."""
    import inspect

    params = [p for p in inspect.signature(mod.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    w = next(p for p in mod.parameters(recurse=False) if p.dim() == 3)
    n_exp = int(getattr(mod, "num_experts", w.shape[0]))
    first = getattr(mod, "gate_up_proj", w)
    hidden = int(getattr(mod, "hidden_dim", 0) or getattr(mod, "hidden_size", 0)
                 or (first.shape[1] if transposed else first.shape[-1]))
    g = torch.Generator(device="cpu").manual_seed(0)
    if len(params) == 1:  # Llama 4: every expert sees its slice of the tokens (tokens ordered by expert)
        x = torch.randn(n_exp * 2, hidden, generator=g).to(w.device, w.dtype)
        return lambda: mod(x)
    x = torch.randn(n_exp, hidden, generator=g).to(w.device, w.dtype)
    idx = torch.arange(n_exp, device=w.device)[:, None]
    wts = torch.ones(n_exp, 1, device=w.device, dtype=w.dtype)
    return lambda: mod(x, idx, wts)
