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
           "weight_problem", "direct_weight_use"]


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


#: attributes of a weight that read its metadata only (a quantized weight keeps the original's)
_METADATA = frozenset({"dtype", "device", "shape", "size", "ndim", "dim", "is_cuda", "is_meta", "requires_grad",
                       "numel"})
#: calls that read no values of their argument
_TYPE_CHECKS = frozenset({"isinstance", "hasattr", "getattr", "type"})
#: methods that do not run in a step (besides every method with "init" in its name: construction, initialisation)
_NOT_IN_A_STEP = frozenset({"reset_parameters", "_reset_parameters", "extra_repr"})
_UNKNOWN = object()


def _value(node, module):
    """The value of a branch condition built from constants and ``self``'s attributes (``self.pretraining_tp > 1
    and self.slow_but_exact``), else ``_UNKNOWN`` (locals, calls: decided only when the step runs)."""
    import ast
    import operator

    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return getattr(module, node.attr, _UNKNOWN)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _value(node.operand, module)
        return _UNKNOWN if v is _UNKNOWN else not v
    if isinstance(node, ast.BoolOp):
        vals = [_value(v, module) for v in node.values]
        decided = [bool(v) for v in vals if v is not _UNKNOWN]
        if isinstance(node.op, ast.And):
            return False if False in decided else (True if len(decided) == len(vals) else _UNKNOWN)
        return True if True in decided else (False if len(decided) == len(vals) else _UNKNOWN)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        ops = {ast.Gt: operator.gt, ast.Lt: operator.lt, ast.GtE: operator.ge, ast.LtE: operator.le,
               ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not}
        a, b = _value(node.left, module), _value(node.comparators[0], module)
        op = ops.get(type(node.ops[0]))
        if op is None or a is _UNKNOWN or b is _UNKNOWN:
            return _UNKNOWN
        try:
            return op(a, b)
        except TypeError:
            return _UNKNOWN
    return _UNKNOWN


def _direct_read(fn, module, child: str) -> int | None:
    """The first line of ``fn`` (a method of ``module``'s class) that reads ``self.<child>.weight`` for its values
    (not its metadata, not a type check) in a branch that can run for ``module`` (branches whose condition
    ``_value`` decides false are skipped); None when there is none."""
    import ast
    import inspect
    import textwrap

    try:
        src, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(src)))
    except (OSError, TypeError, SyntaxError):
        return None

    def is_read(node, parent) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.value, ast.Attribute)
                and node.value.attr == child and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                and not (isinstance(parent, ast.Attribute) and parent.attr in _METADATA)
                and not (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                         and parent.func.id in _TYPE_CHECKS))

    def walk(node, parent):
        if isinstance(node, (ast.If, ast.IfExp)):
            v = _value(node.test, module)
            branches = [node.body] if v is True else [node.orelse] if v is False else [node.body, node.orelse]
            found = walk(node.test, node)
            for b in branches:
                for child_node in (b if isinstance(b, list) else [b]):
                    found = found or walk(child_node, node)
            return found
        if is_read(node, parent):
            return node.lineno
        for c in ast.iter_child_nodes(node):
            line = walk(c, node)
            if line:
                return line
        return None

    line = walk(tree, None)
    return None if line is None else first + line - 1


def direct_weight_use(model: nn.Module, name: str) -> str | None:
    """Why the linear at ``name`` keeps its weight: a method of its parent module reads ``self.<child>.weight`` for
    its values, outside the linear's own forward (Mamba's training path computes ``self.dt_proj.weight @ x``;
    its fused CUDA kernels' path passes ``x_proj.weight`` and ``out_proj.weight`` to the kernel), where a quantized
    weight supports only the linear's matmul; None when nothing can. Read from the parent class's source (the
    methods that run in a step); a branch whose condition is decided by the module's own attributes and is false
    here does not count (Bloom's ``if self.pretraining_tp > 1 and self.slow_but_exact``: its ``dense`` slices).

    NOTE(direct reads): quantizing such a weight failed in the step with an error from the quantized tensor
    (torchao's "no aten.expand") that names neither effpass nor the module. A branch decided only at run time
    (locals, calls) counts as one that can run: the weight stays, with the reason, rather than fail there."""
    parent_name, _, child = name.rpartition(".")
    if not child.isidentifier():
        return None  # an element of a ModuleList/Sequential: no attribute to read it by
    parent = model.get_submodule(parent_name) if parent_name else model
    import inspect

    for cls in type(parent).__mro__:
        if cls.__module__.startswith("torch.") or cls is object:
            break
        for attr, fn in vars(cls).items():
            if attr in _NOT_IN_A_STEP or "init" in attr or not inspect.isfunction(fn):
                continue
            line = _direct_read(fn, parent, child)
            if line is not None:
                return (f"{cls.__name__}.{attr} (line {line}) reads self.{child}.weight directly, outside the "
                        "linear's forward: a quantized weight supports only the linear's own matmul")
    return None
