"""``apply_autocast``: run an fp32 model in bf16/fp16 mixed precision, as ``torch.autocast`` would.

Phase: torch IR (the graph Dynamo hands over). The pass wraps the graph's computation in a balanced pair of
``torch.amp.autocast_mode._enter_autocast(device, dtype, True, None)`` / ``_exit_autocast(ctx)`` call nodes:
the same nodes Dynamo records for a ``with torch.autocast(...)`` block the user wrote. AOTAutograd traces
through them, so every op runs in the dtype eager ``torch.autocast`` chooses (low precision for matmuls and
convolutions, fp32 for softmax, norms, losses and reductions), and the backward follows
(``functorch.config.backward_pass_autocast``). Weights stay fp32 (master weights): autocast casts copies.

fp32 islands: runs of consecutive nodes the pass may not act on (``exclude``/``targets`` globs,
``effpass.skip("apply_autocast")``) are wrapped in a nested pair with ``enabled=False``; their floating
inputs from outside the island are cast back to fp32 first (``x.to(torch.float32)``, a no-op on fp32),
as one writes it by hand (``with torch.autocast(..., enabled=False): lm_head(x.float())``).

Runs after ``fuse_attention`` (NOTE(ordering): the fused SDPA node then sits inside the region and
runs in the low dtype; the attention patterns are written for the unchanged fp32 graph).

Invariants:

* Regions the user already wrote (``_enter_autocast`` ... ``_exit_autocast`` in the graph) are left exactly
  as written: the pass closes its own region before each of them and reopens it after.
* A graph compiled while autocast is already on around the call (``with torch.autocast(): compiled(x)``)
  is left alone: the caller chose the precision.
* The enter/exit calls are fixed by their arguments; the core lists both in Inductor's
  ``unsafe_marked_cacheable_functions`` so graphs holding them hit the compile caches.
"""
from __future__ import annotations

import collections
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

import effpass
from effpass.graph import op_name, tensor_meta
from effpass.scope import module_path_of_node

__all__ = ["ApplyAutocast", "node_dtypes", "dtype_counts", "is_autocast_enter", "is_autocast_exit"]

_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast
_LOW_DTYPES = (torch.bfloat16, torch.float16)
#: ops counted as matmuls in the statistics (the ones whose dtype decides the speed)
_MATMUL_WORDS = ("linear", "matmul", "mm", "conv", "einsum", "scaled_dot_product", "bmm", "addmm")


def is_autocast_enter(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _ENTER


def is_autocast_exit(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _EXIT


def _is_compute(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module", "get_attr")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bf16_supported_gpu() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except Exception:  # pragma: no cover - broken driver: stay off
        return False


# NOTE(caching): the enter/exit calls are fixed by their arguments, so graphs holding them are safe to cache;
# without this the AOTAutograd cache bypasses every mixed-precision graph (user-written regions included).
for _fn in (torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast):
    effpass.register_cacheable_function(f"{_fn.__module__}.{_fn.__qualname__}")


@effpass.register_pass("apply_autocast", run_after=("fuse_attention",))
@dataclass(frozen=True, kw_only=True)
class ApplyAutocast(effpass.Pass):
    """Insert autocast regions so an fp32 model trains in bf16/fp16 mixed precision, with fp32 islands.

    Before (torch IR of ``lm_head(norm(x))``, model written in fp32)::

        norm = ...rsqrt(...)...;  logits = torch._C._nn.linear(norm, w_lm_head, None)

    After ``ApplyAutocast(dtype=torch.bfloat16, exclude=["lm_head"])``::

        ac = _enter_autocast('cuda', torch.bfloat16, True, None)
        norm = ...                                         # bf16 matmuls, fp32 reductions
        ac_1 = _enter_autocast('cuda', torch.bfloat16, False, None)     # fp32 island
        norm_f32 = norm.to(torch.float32)
        logits = torch._C._nn.linear(norm_f32, w_lm_head, None)         # fp32
        _exit_autocast(ac_1)
        _exit_autocast(ac)
    """

    dtype: torch.dtype = field(default=torch.bfloat16, metadata={
        "doc": "low-precision dtype of the autocast region: bfloat16 or float16 (float16 wants scale_loss)"})
    cache_enabled: bool | None = field(default=None, metadata={
        "doc": "autocast's weight-cast cache (None: torch's default)"})

    def validate(self) -> None:
        if self.dtype not in _LOW_DTYPES:
            raise ValueError(f"apply_autocast: dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")

    @classmethod
    def enabled_by_default(cls, device=None, dtype=None) -> bool:
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            return False
        if dtype is not None and dtype != torch.float32:  # a bf16/fp16 model: nothing to autocast
            return False
        return _bf16_supported_gpu()

    @classmethod
    def default_note(cls) -> str:
        return "off on CPU and GPUs without bf16 (on by default, bf16, on CUDA GPUs that support bf16)"

    # ------------------------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        device_type = (ctx.device or torch.device("cpu")).type
        if torch.is_autocast_enabled(device_type):
            return effpass.PassResult(skipped=[{
                "site": "graph", "reason": f"autocast is already enabled for {device_type!r} around the compiled "
                                           "call; the caller chose the precision"}])
        nodes = [n for n in graph.nodes if _is_compute(n)]
        if not nodes:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "graph has no ops"}])
        if self.dtype == torch.float16 and ctx.find_pass("scale_loss") is None and torch.is_grad_enabled():
            warnings.warn("effpass: apply_autocast(dtype=float16) without scale_loss: small fp16 gradients may "
                          "underflow to zero; add effpass.passes.ScaleLoss() to the pipeline", UserWarning,
                          stacklevel=2)
        before = _safe_dtype_stats(gm, ctx.example_inputs)

        # Split the graph into segments outside the user's own autocast regions.
        segments: list[list[fx.Node]] = [[]]
        user_regions = depth = 0
        for n in nodes:
            if is_autocast_enter(n):
                if depth == 0:
                    user_regions += 1
                    segments.append([])
                depth += 1
            elif is_autocast_exit(n):
                depth -= 1
            elif depth == 0:
                segments[-1].append(n)
        segments = [s for s in segments if s]
        if depth != 0:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "unbalanced autocast regions in the graph"}])

        regions = islands = 0
        island_modules: set[str] = set()
        for seg in segments:
            regions += 1
            self._wrap(graph, seg[0], seg[-1], device_type, enabled=True)
            # fp32 islands: maximal runs of consecutive nodes the scope does not allow.
            run: list[fx.Node] = []
            for n in [*seg, None]:
                if n is not None and not ctx.allows(n):
                    run.append(n)
                    continue
                if run and any(_is_float_op(r) for r in run):
                    self._island(graph, run, device_type)
                    islands += 1
                    island_modules.update(module_path_of_node(r) or "<root>" for r in run)
                run = []
        after = _safe_dtype_stats(gm, ctx.example_inputs)
        stats: dict[str, Any] = {"regions": regions, "fp32_islands": islands, "user_regions_kept": user_regions,
                                 "dtype": _dtype_name(self.dtype)}
        if island_modules:
            stats["island_modules"] = sorted(island_modules)
        if before is not None and after is not None:
            stats["ops_by_dtype_before"], stats["matmuls_by_dtype_before"] = before
            stats["ops_by_dtype_after"], stats["matmuls_by_dtype_after"] = after
        return effpass.PassResult(changed=regions > 0, stats=stats)

    def _wrap(self, graph: fx.Graph, first: fx.Node, last: fx.Node, device_type: str, *, enabled: bool) -> fx.Node:
        with graph.inserting_before(first):
            enter = graph.call_function(_ENTER, (device_type, self.dtype, enabled, self.cache_enabled))
        with graph.inserting_after(last):
            graph.call_function(_EXIT, (enter,))
        return enter

    def _island(self, graph: fx.Graph, run: list[fx.Node], device_type: str) -> None:
        inside = set(run)
        enter = self._wrap(graph, run[0], run[-1], device_type, enabled=False)
        # NOTE(dtype): values made inside the enabled region may be low precision; an fp32 op run with
        # autocast off would then see mixed dtypes. Cast floating inputs from outside back to fp32, as the
        # hand-written idiom does (a no-op on values that are fp32 already).
        casts: dict[fx.Node, fx.Node] = {}
        for n in run:
            for arg in list(n.all_input_nodes):
                if arg in inside or not _is_fp32(arg):
                    continue
                if arg not in casts:
                    with graph.inserting_after(enter):
                        c = graph.call_method("to", (arg, torch.float32))
                    c.meta = {k: v for k, v in arg.meta.items() if k in ("example_value", "val", "nn_module_stack",
                                                                         "stack_trace", "source_fn_stack")}
                    casts[arg] = c
                n.replace_input_with(arg, casts[arg])


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
    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=True)
        self.dtypes: dict[fx.Node, torch.dtype] = {}
        self._open: list[Any] = []

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if is_autocast_enter(n):
            self._open.append(out)
        elif is_autocast_exit(n) and self._open:
            self._open.pop()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_floating_point() and n.op != "placeholder":
            self.dtypes[n] = first.dtype
        return out

    def close_open_regions(self) -> None:
        while self._open:  # an error mid-graph must not leave autocast switched on
            _EXIT(self._open.pop())


def node_dtypes(gm: fx.GraphModule, example_inputs) -> dict[fx.Node, torch.dtype]:
    """The dtype each floating-point op of ``gm`` produces when run on ``example_inputs`` (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    interp = _DtypeInterpreter(gm)
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


def _safe_dtype_stats(gm, example_inputs):
    if not example_inputs:
        return None
    try:
        return dtype_counts(node_dtypes(gm, example_inputs))
    except Exception:  # statistics only: an op fake tensors cannot run must not fail the pass
        return None
