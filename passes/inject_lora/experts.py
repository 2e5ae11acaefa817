"""LoRA on MoE expert parameters (PEFT's ``target_parameters``): :class:`ExpertLoRA` (one adapter per expert on a
3-D weight), the experts forwards that add its terms without materialising a delta, injection and merging.

The grouped matmul they call is :mod:`._expert_mm`; the linear adapters and PEFT interop are :mod:`.lora`.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

from effpass.scope import skip

from .expert_mm import expert_mm

__all__ = ["EXPERT_LAYOUTS", "ExpertLoRA", "expert_layout", "expert_parameters", "expert_lora_modules",
           "inject_experts", "merge_experts"]

#: layouts effpass computes expert adapters for (see :func:`expert_layout`)
EXPERT_LAYOUTS = {
    "routed": "transformers' use_experts_implementation contract: forward(hidden (T, H), top_k_index (T, k), "
              "top_k_weights (T, k)) with flags has_gate / has_bias / is_transposed (Qwen3-MoE, Mixtral, "
              "GPT-OSS, Qwen2-MoE, DeepSeek-V3, OLMoE, ...; a self-written module that declares the flags)",
    "dense": "Llama 4's Llama4TextExperts: every expert on every (pre-weighted) token, batched with bmm",
}


def expert_layout(module: nn.Module) -> str | None:
    """The expert layout of ``module`` (a key of :data:`EXPERT_LAYOUTS`) or None when unsupported."""
    if type(module).__name__ == "Llama4TextExperts" or getattr(module, "__effpass_experts__", None) == "dense":
        return "dense"
    flags = ("has_gate", "has_bias", "is_transposed")
    if all(isinstance(getattr(module, f, None), bool) for f in flags) and isinstance(
            getattr(module, "num_experts", None), int) and not getattr(module, "_is_expert_parallel", False):
        return "routed"
    return None


def expert_parameters(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Module]]:
    """Every 3-D floating parameter of an experts module: full name -> (experts module, attribute, owner name).

    An experts module is one whose class name ends in ``Experts`` or that has an int ``num_experts``."""
    out = {}
    for mn, m in model.named_modules():
        if isinstance(m, ExpertLoRA) or ".lora_experts" in mn:
            continue
        if not (type(m).__name__.endswith("Experts") or isinstance(getattr(m, "num_experts", None), int)):
            continue
        for pn, p in m.named_parameters(recurse=False):
            if p.dim() == 3:
                out[f"{mn}.{pn}" if mn else pn] = (m, pn, mn)
    return out


def _expert_param_roles(module: nn.Module, layout: str) -> dict[str, str]:
    """attribute -> how the forward multiplies it: ``"xWt"`` (``x @ W_e.T``, W_e (out, in)) or ``"xW"``."""
    if layout == "dense":
        return {"gate_up_proj": "xW", "down_proj": "xW"}
    use = "xW" if module.is_transposed else "xWt"
    return {("gate_up_proj" if module.has_gate else "up_proj"): use, "down_proj": use}


@skip("quantize_linear")
class ExpertLoRA(nn.Module):
    """One adapter per expert on a 3-D expert parameter ``W`` (E, d1, d2), as PEFT's ``ParamWrapper``.

    ``lora_A`` (E, r, a) and ``lora_B`` (E, b, r) are PEFT's per-expert ``A_e`` / ``B_e`` (PEFT stores them
    flattened: ``lora_A.weight`` (E*r, a) and ``lora_B.weight`` (b, r*E), expert index fastest in B's
    columns). PEFT's delta is ``scaling * B_e @ A_e`` in ``W``'s (d1, d2) layout, transposed when the
    experts module says ``is_transposed``. Here the delta is never formed: the forward multiplies the routed
    rows ``x`` of expert e by the two factors, ``x @ F1_e @ F2_e * scaling``, with ``(F1, F2) = (A^T, B^T)``
    when the forward computes ``x @ W_e^T`` on a non-transposed weight or ``x @ W_e`` on a transposed one,
    and ``(B, A)`` when it computes ``x @ W_e`` but the module does not declare ``is_transposed`` (Llama 4:
    PEFT reads its (E, in, out) weight as (E, out, in)).
    """

    def __init__(self, weight: torch.Tensor, use: str, peft_transposed: bool, rank: int, alpha: float, *,
                 use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None):
        super().__init__()
        n_exp, d1, d2 = weight.shape
        if dtype is None:
            dtype = weight.dtype if weight.dtype not in (torch.float16, torch.bfloat16) else torch.float32
        if not dtype.is_floating_point:
            dtype = torch.float32
        # PEFT: (experts, in, out) when transposed, else (experts, out, in)
        a_in, b_out = (d1, d2) if peft_transposed else (d2, d1)
        self.lora_A = nn.Parameter(torch.empty(n_exp, rank, a_in, device=weight.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(n_exp, b_out, rank, device=weight.device, dtype=dtype))
        self.n_experts, self.rank, self.alpha = n_exp, rank, float(alpha)
        self.use_rslora, self.dropout_p = use_rslora, 0.0
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        # x @ delta (use xW) or x @ delta^T (use xWt), with delta = B A (or (B A)^T when peft_transposed)
        self.a_first = (use == "xW") == peft_transposed
        self.use, self.peft_transposed = use, peft_transposed
        self.merged = False
        self.reset_lora_parameters(init)

    def reset_lora_parameters(self, init: str = "kaiming") -> None:
        with torch.no_grad():
            if init == "kaiming":  # PEFT's nn.Linear(a, r*E) kaiming_uniform(a=sqrt(5)): U(-1/sqrt(a), 1/sqrt(a))
                bound = 1.0 / math.sqrt(self.lora_A.shape[-1])
                self.lora_A.uniform_(-bound, bound)
            elif init == "gaussian":
                nn.init.normal_(self.lora_A, std=1 / self.rank)
            else:
                raise ValueError(f"init {init!r} is not valid; choose one of ['kaiming', 'gaussian']")
            self.lora_B.zero_()

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(F1, F2, transposed): the term is ``x @ F1_e @ F2_e`` with F1/F2 given as stored (E, ., .) and
        ``transposed`` saying both are used transposed (``x @ A_e^T @ B_e^T``)."""
        return (self.lora_A, self.lora_B, True) if self.a_first else (self.lora_B, self.lora_A, False)

    def delta(self, e: int) -> torch.Tensor:
        """Expert e's delta in the weight's (d1, d2) layout (merging only)."""
        d = (self.lora_B[e].float() @ self.lora_A[e].float()) * self.scaling
        return d.T if self.peft_transposed else d

    # PEFT's flattened layout
    def peft_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, r = self.n_experts, self.rank
        a = self.lora_A.detach().reshape(n * r, -1)
        b = self.lora_B.detach().permute(1, 2, 0).reshape(self.lora_B.shape[1], r * n)
        return a.contiguous(), b.contiguous()

    def load_peft_tensors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        n, r = self.n_experts, self.rank
        with torch.no_grad():
            self.lora_A.copy_(a.reshape(n, r, -1).to(self.lora_A.dtype))
            self.lora_B.copy_(b.reshape(b.shape[0], r, n).permute(2, 0, 1).to(self.lora_B.dtype))

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, A={tuple(self.lora_A.shape)}, B={tuple(self.lora_B.shape)}, "
                f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:.4g}{', merged' if self.merged else ''}")


def _float_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The expert weight as a float tensor: plain weights as they are, quantized ones (quantize_linear's
    int8 experts) dequantized for the base matmul (QLoRA: the adapters stay in full precision)."""
    w = getattr(module, name)
    if type(w) is nn.Parameter or type(w) is torch.Tensor:  # NOTE(compile): is_quantized breaks Dynamo's graph
        return w
    return w.dequantize()  # torchao's Int8Tensor / NF4Tensor; checked at injection (_check_dequantizable)


def _check_dequantizable(full: str, mod: nn.Module, attr: str) -> None:
    w = getattr(mod, attr)
    if type(w) is nn.Parameter or type(w) is torch.Tensor:
        return
    if not callable(getattr(w, "dequantize", None)):
        raise _unsupported(full, mod, f"its weight is a {type(w).__name__} without a dequantize() method")


def _routed_lora_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """transformers' grouped experts forward plus ``scaling * x @ F1_e @ F2_e`` on each adapted projection."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
    n_exp = self.num_experts
    expert_ids = top_k_index.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    ids_sorted, perm = torch.sort(expert_ids, stable=True)
    x = hidden_states[perm // num_top_k]
    counts = torch.zeros(n_exp, dtype=torch.long, device=x.device).scatter_add_(
        0, ids_sorted, torch.ones_like(ids_sorted))
    offs = torch.cumsum(counts, 0)
    adapters = self.lora_experts
    first = "gate_up_proj" if self.has_gate else "up_proj"

    def project(inp, name):
        use_t = not self.is_transposed
        out = expert_mm(inp, _float_weight(self, name), offs, use_t)
        if self.has_bias:
            out = out + getattr(self, f"{name}_bias")[ids_sorted]
        ad = adapters[name] if name in adapters else None
        if ad is not None and not ad.merged:
            f1, f2, tr = ad.factors()
            xa = inp.to(f1.dtype)
            term = expert_mm(expert_mm(xa, f1, offs, tr), f2, offs, tr) * ad.scaling
            out = out + term.type_as(out)
        return out

    h = project(x, first)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = project(h, "down_proj")
    if getattr(self, "has_post_expert_norm", False):
        h = self.post_expert_norm(h)
    h = h * sample_weights[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    out = h[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


def _dense_lora_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts forward (every expert on its slice of rows, bmm) plus the adapter terms."""
    adapters = self.lora_experts
    hidden_size = self.gate_up_proj.shape[1]
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, hidden_size)

    def project(inp, name):
        out = torch.bmm(inp, _float_weight(self, name))
        ad = adapters[name] if name in adapters else None
        if ad is not None and not ad.merged:
            f1, f2, tr = ad.factors()
            if tr:
                f1, f2 = f1.transpose(1, 2), f2.transpose(1, 2)
            out = out + (torch.bmm(torch.bmm(inp.to(f1.dtype), f1), f2) * ad.scaling).type_as(out)
        return out

    gate, up = project(x, "gate_up_proj").chunk(2, dim=-1)
    out = project(up * self.act_fn(gate), "down_proj")
    return out.view(-1, out.shape[-1])


_LORA_EXPERT_CLASSES: dict[tuple[type, str], type] = {}


def _lora_experts_class(cls: type, layout: str) -> type:
    key = (cls, layout)
    if key not in _LORA_EXPERT_CLASSES:
        fwd = _routed_lora_forward if layout == "routed" else _dense_lora_forward
        _LORA_EXPERT_CLASSES[key] = type(f"LoRA{cls.__name__}", (cls,), {
            "forward": fwd, "__effpass_lora_experts__": layout, "__module__": __name__,
            "__doc__": f"{cls.__name__} with effpass expert LoRA adapters in ``lora_experts`` ({layout} layout)."})
    return _LORA_EXPERT_CLASSES[key]


def expert_lora_modules(model: nn.Module) -> dict[str, ExpertLoRA]:
    """Every expert adapter by the full name of the parameter it adapts (``...experts.gate_up_proj``)."""
    out = {}
    for mn, m in model.named_modules():
        ad = getattr(m, "lora_experts", None)
        if getattr(type(m), "__effpass_lora_experts__", None) and isinstance(ad, nn.ModuleDict):
            for pn, a in ad.items():
                out[f"{mn}.{pn}" if mn else pn] = a
    return out


def _unsupported(full: str, module: nn.Module, why: str) -> ValueError:
    supported = "; ".join(f"{k}: {v}" for k, v in EXPERT_LAYOUTS.items())
    return ValueError(f"inject_lora: cannot put LoRA on expert parameter {full!r} of {type(module).__name__} "
                      f"({why}). Supported expert layouts: {supported}")


def inject_experts(model: nn.Module, names: Iterable[str], *, rank: int, alpha: float, dropout: float = 0.0,
                   use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None,
                   rank_of=None, alpha_of=None) -> list[str]:
    """Put one LoRA adapter per expert on the 3-D expert parameters ``names`` (full names, in place).

    The experts module's class is swapped for a subclass whose forward adds ``x @ F1_e @ F2_e`` for the
    routed rows of each expert (no delta weight). Raises on unsupported layouts, dropout, too large a rank.
    """
    params = expert_parameters(model)
    done = []
    for full in names:
        if full not in params:
            raise ValueError(f"inject_lora: {full!r} is not a 3-D expert parameter; expert parameters here: "
                             f"{sorted(params)[:6]}")
        mod, attr, _ = params[full]
        layout = getattr(type(mod), "__effpass_lora_experts__", None) or expert_layout(mod)
        if layout is None:
            why = ("expert parallel sharding" if getattr(mod, "_is_expert_parallel", False) else
                   "its forward is not one effpass knows how to add adapter terms to")
            raise _unsupported(full, mod, f"layout unknown: {why}")
        roles = _expert_param_roles(mod, layout)
        if attr not in roles:
            raise _unsupported(full, mod, f"layout {layout!r} has expert projections {sorted(roles)}, not {attr!r}")
        if dropout > 0:
            raise ValueError(
                f"inject_lora: dropout={dropout} on expert parameter {full!r} ({type(mod).__name__}, {layout} layout): "
                "PEFT's target_parameters LoRA defines expert adapters without dropout (it adds B@A to the "
                "weight), so an adapter trained with dropout would have no PEFT equivalent; use dropout=0, or "
                "exclude the expert parameters from targets and keep dropout on the linears")
        for other in roles:
            _check_dequantizable(f"{full.rpartition('.')[0]}.{other}", mod, other)
        w = getattr(mod, attr)
        r = rank_of(full) if rank_of else rank
        a = alpha_of(full) if alpha_of else alpha
        _, d1, d2 = w.shape
        if r > min(d1, d2):
            raise ValueError(f"inject_lora: rank {r} on expert parameter {full!r} ({type(mod).__name__}, shape "
                             f"{tuple(w.shape)}, {layout} layout) is larger than the expert's dimensions "
                             f"({d1}, {d2}); use a rank <= {min(d1, d2)}")
        if layout == "routed" and not isinstance(getattr(mod, "lora_experts", None), nn.ModuleDict):
            pass
        if not isinstance(getattr(mod, "lora_experts", None), nn.ModuleDict):
            mod.lora_experts = nn.ModuleDict()
        if attr in mod.lora_experts:
            continue
        mod.lora_experts[attr] = ExpertLoRA(w, roles[attr], bool(getattr(mod, "is_transposed", False)), r, a,
                                            use_rslora=use_rslora, init=init, dtype=dtype)
        if not getattr(type(mod), "__effpass_lora_experts__", None):
            mod.__class__ = _lora_experts_class(type(mod), layout)
        done.append(full)
    return done


def merge_experts(root: nn.Module, sign: int) -> int:
    """Add (``sign=+1``) or subtract the expert deltas, one expert at a time (one expert-sized temporary)."""
    from effpass.quantized import is_quantized

    n = 0
    for full, ad in expert_lora_modules(root).items():
        if ad.merged == (sign > 0):
            continue
        mod_name, _, attr = full.rpartition(".")
        w = getattr(root.get_submodule(mod_name) if mod_name else root, attr)
        if is_quantized(w) or not w.is_floating_point():
            raise ValueError(f"cannot merge the expert adapter of {full!r} into a quantized or non-float weight")
        with torch.no_grad():
            for e in range(ad.n_experts):
                w[e].copy_((w[e].float() + sign * ad.delta(e)).to(w.dtype))
        ad.merged = sign > 0
        n += 1
    return n
