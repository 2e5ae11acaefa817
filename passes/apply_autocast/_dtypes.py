"""Which ops of a graph run in which dtype: the graph run on fake tensors (autocast applies to them as to real
ones), for apply_autocast's statistics."""
from __future__ import annotations

import collections
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from effpass.graph import EXIT_AUTOCAST as _EXIT, is_autocast_enter, is_autocast_exit, op_name, tensor_meta

_LOW_DTYPES = (torch.bfloat16, torch.float16)
#: ops counted as matmuls in the statistics (the ones whose dtype decides the speed)
_MATMUL_WORDS = ("linear", "matmul", "mm", "conv", "einsum", "scaled_dot_product", "bmm", "addmm")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_fp32(node: fx.Node) -> bool:
    v = tensor_meta(node)
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


def _is_float_op(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    v = tensor_meta(node)
    vals = v if isinstance(v, (tuple, list)) else (v,)
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals)


# ------------------------------------------------------------------------------------------------------
# which ops run in which dtype: run the graph on fake tensors (autocast applies to them as to real ones)
# ------------------------------------------------------------------------------------------------------
class _DtypeInterpreter(fx.Interpreter):
    def __init__(self, gm, autocast: bool = True):
        super().__init__(gm, garbage_collect_values=True)
        self.dtypes: dict[fx.Node, torch.dtype] = {}
        self._open: list[Any] = []
        self._autocast = autocast

    def run_node(self, n: fx.Node) -> Any:
        if not self._autocast and (is_autocast_enter(n) or is_autocast_exit(n)):
            return None
        out = super().run_node(n)
        if is_autocast_enter(n):
            self._open.append(out)
        elif is_autocast_exit(n) and self._open:
            self._open.pop()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_floating_point() and n.op != "placeholder":
            self.dtypes[n] = first.dtype
        return out

    # NOTE(before): with the regions off, dtypes the model read under autocast (``x.to(bf16)``, recorded
    # by the module capture) are read as fp32, as an fp32 trace would have recorded them.
    def _fp32_args(self, args, kwargs):
        if self._autocast:
            return args, kwargs
        f = lambda v: torch.float32 if isinstance(v, torch.dtype) and v in _LOW_DTYPES else v  # noqa: E731
        return tree_map(f, args), tree_map(f, kwargs)

    def call_function(self, target, args, kwargs):
        return super().call_function(target, *self._fp32_args(args, kwargs))

    def call_method(self, target, args, kwargs):
        return super().call_method(target, *self._fp32_args(args, kwargs))

    def close_open_regions(self) -> None:
        while self._open:  # an error mid-graph must not leave autocast switched on
            _EXIT(self._open.pop())


def node_dtypes(gm: fx.GraphModule, example_inputs, *, autocast: bool = True) -> dict[fx.Node, torch.dtype]:
    """The dtype each floating-point op of ``gm`` produces when run on ``example_inputs`` (fake tensors);
    ``autocast=False`` runs it with the graph's autocast regions switched off."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    interp = _DtypeInterpreter(gm, autocast)
    with mode:
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        try:
            with torch.no_grad():
                interp.run(*fake)
        finally:
            interp.close_open_regions()
    return interp.dtypes


def dtype_counts(dtypes: dict[fx.Node, torch.dtype]) -> tuple[dict[str, int], dict[str, int]]:
    """(ops per output dtype, matmul-like ops per output dtype); view-like ops and casts included."""
    ops: collections.Counter = collections.Counter()
    mms: collections.Counter = collections.Counter()
    for n, dt in dtypes.items():
        if is_autocast_enter(n) or is_autocast_exit(n) or n.target is operator.getitem:
            continue
        ops[_dtype_name(dt)] += 1
        name = op_name(n).lower()
        if any(w in name for w in _MATMUL_WORDS) or n.target is operator.matmul:
            mms[_dtype_name(dt)] += 1
    return dict(sorted(ops.items())), dict(sorted(mms.items()))


def _safe_dtype_stats(gm, example_inputs, *, autocast: bool = True):
    if not example_inputs:
        return None
    try:
        return dtype_counts(node_dtypes(gm, example_inputs, autocast=autocast))
    except Exception:  # statistics only: an op fake tensors cannot run must not fail the pass
        return None
