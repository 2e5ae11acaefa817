"""``apply_autocast``: run an fp32 model in bf16/fp16 mixed precision, exactly as ``torch.autocast`` would.

Phases: module, then torch IR.

* **Module phase** (``effpass.compile`` / ``effpass.prepare``): the model's ``forward`` is wrapped so it
  runs under ``torch.autocast(device, dtype)`` (an instance attribute, as ``scale_loss`` does; it survives
  ``deepcopy``). Dynamo then records the autocast region exactly as eager runs it, including the model's
  own dtype-dependent code (``x.to(y.dtype)``), so the compiled model is bit-identical to eager
  ``torch.autocast`` (logits, loss and gradients; tested on every family in ``tests/models/test_families.py``)
  and the prepared eager model computes the same function (reference semantics). fp32 islands are module
  wrappers too: each outermost module the pass may not act on (``exclude``/``targets`` globs,
  ``effpass.skip("apply_autocast")``) runs under ``torch.autocast(device, enabled=False)`` with its
  bf16/fp16 tensor inputs cast to fp32, the hand-written idiom
  (``with torch.autocast(..., enabled=False): lm_head(x.float())``). With ``targets``, only the target
  modules run under autocast (``with torch.autocast(...): block(x)`` for each), the rest in fp32.
* **Torch-IR phase**: after the module phase it changes nothing and reports the regions, islands and
  the ops per dtype. Without a module phase (the string backend,
  ``torch.compile(m, backend="effpass")``) it inserts the regions into the captured fp32 graph instead
  (``capture="graph"``): that graph was traced without autocast, so model code that reads dtypes was
  recorded for fp32, and results can differ from eager ``torch.autocast`` by a rounding step on such
  models (Qwen3, OLMo2, Qwen3-MoE); a ``UserWarning`` says so once. Use ``effpass.compile`` for
  bit-identical results.

Invariants:

* Regions the user already wrote are left exactly as written (module capture: Dynamo records them
  inside ours; graph capture: the pass closes its own region before each and reopens it after).
* Autocast already on around the call (``with torch.autocast(): compiled(x)``) wins: the wrapper steps
  aside (Dynamo guards on the autocast state) and the torch-IR record says the caller chose the precision.
* The enter/exit calls are fixed by their arguments; the pass declares both cacheable so graphs holding
  them hit the compile caches.
"""
from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

import effpass
from effpass.facts import LossScaling, MixedPrecision
from effpass.graph import (ENTER_AUTOCAST as _ENTER, EXIT_AUTOCAST as _EXIT, AutocastRegions, copy_provenance,
                           is_autocast_enter, is_autocast_exit, module_path_of_node)
from torch.utils._pytree import tree_map

from ._dtypes import _LOW_DTYPES, _dtype_name, _is_float_op, _is_fp32, _safe_dtype_stats, dtype_counts, node_dtypes

__all__ = ["ApplyAutocast", "node_dtypes", "dtype_counts"]



def _is_compute(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module", "get_attr")


def _bf16_supported_gpu() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except Exception:  # pragma: no cover - broken driver: stay off
        return False


# NOTE(caching): the enter/exit calls are fixed by their arguments, so graphs holding them are safe to cache;
# without this the AOTAutograd cache bypasses every mixed-precision graph (user-written regions included).
for _fn in (_ENTER, _EXIT):
    effpass.register_cacheable_function(f"{_fn.__module__}.{_fn.__qualname__}")



# ------------------------------------------------------------------------------------------------------
# module phase: forward wrappers (regions and fp32 islands)
# ------------------------------------------------------------------------------------------------------
_SITE_ATTR = "_effpass_autocast"          # on a wrapped module: dict(device, dtype, enabled, cache, inner, bound)
_MODEL_ATTR = "_effpass_autocast_sites"   # on the root: what the module phase did (for the torch-IR record)


def _to_fp32(x):
    if isinstance(x, torch.Tensor) and x.dtype in _LOW_DTYPES:
        return x.float()
    return x


def _autocast_forward(self, *args, **kwargs):
    site = self.__dict__[_SITE_ATTR]
    inner = site["inner"]
    call = (lambda *a, **k: inner(self, *a, **k)) if site["bound"] else inner
    if site["enabled"] is None:                      # unwrapped by a later prepare with other options
        return call(*args, **kwargs)
    if site["enabled"]:
        if torch.is_autocast_enabled(site["device"]):
            return call(*args, **kwargs)             # the caller's own autocast wins
        # NOTE(marker): cache_enabled is always a bool here (torch's default made explicit), which tells
        # effpass's regions from user-written ones (recorded with None unless the user passed it).
        with torch.autocast(site["device"], dtype=site["dtype"], enabled=True, cache_enabled=site["cache"]):
            return call(*args, **kwargs)
    with torch.autocast(site["device"], dtype=site["dtype"], enabled=False, cache_enabled=site["cache"]):
        return call(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))


def _wrap_module(mod: torch.nn.Module, device: str, dtype: torch.dtype, enabled: bool | None, cache: bool) -> None:
    site = mod.__dict__.get(_SITE_ATTR)
    if site is None:
        fwd = mod.forward
        bound = getattr(fwd, "__self__", None) is mod
        site = {"inner": fwd.__func__ if bound else fwd, "bound": bound}
        object.__setattr__(mod, _SITE_ATTR, site)
        mod.forward = types.MethodType(_autocast_forward, mod)
    site.update(device=device, dtype=dtype, enabled=enabled, cache=cache)


def _routers(model: torch.nn.Module) -> list[str]:
    """MoE routers: a ``gate`` / ``router`` child beside an ``experts`` child (transformers' MoE blocks)."""
    out = []
    for name, mod in model.named_modules():
        children = dict(mod.named_children())
        if "experts" in children:
            out += [f"{name}.{c}" if name else c for c in ("gate", "router") if c in children]
    return out


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


# NOTE(ordering): after the passes that replace modules (quantize_linear, inject_lora), so its wrappers and fp32
# islands sit on the modules that will run; after fuse_attention in the torch-IR phase (graph capture). Under the
# module capture fuse_attention sees the recorded autocast regions and gives each site the autocast dtype.
@effpass.register_pass("apply_autocast", run_after=("fuse_attention", "quantize_linear", "inject_lora"))
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
    fp32_routers: bool = field(default=False, metadata={
        "doc": "MoE routers (the gate/router beside an experts module) run as fp32 islands, departing from eager "
               "torch.autocast (named in the report); off by default: against fp64 it flips fewer routing "
               "decisions but gave no measurably better loss (docs/passes/apply_autocast.md)"})

    def validate(self) -> None:
        if self.dtype not in _LOW_DTYPES:
            raise ValueError(f"apply_autocast: dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")

    def facts(self) -> tuple:
        """The model's compute runs in ``dtype`` (read by wrap_fsdp and scale_loss)."""
        return (MixedPrecision(dtype=self.dtype),)

    #: the string backend has no module phase: the torch-IR hook then edits the graph (documented, warned)
    module_phase_optional = True

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
    def prepare_module(self, model: torch.nn.Module, ctx) -> effpass.PassResult:
        device_type = (ctx.device or torch.device("cpu")).type
        cache = self.cache_enabled if self.cache_enabled is not None else torch.is_autocast_cache_enabled()
        scope = ctx.scope
        names = [n for n, _ in model.named_modules() if n]
        allowed = {n for n, _ in scope.select_modules(model, what="module")}  # raises on unmatched globs
        routers: list[str] = []
        if self.fp32_routers:  # NOTE(moe): opt-in: routing decisions in bf16 flip experts; keep the router in fp32
            routers = [r for r in _routers(model) if r in allowed]
            allowed -= {n for r in routers for n in allowed if n == r or n.startswith(r + ".")}
        allowed_root = not self.targets and scope.allows_root(model)
        if allowed_root:
            allowed.add("")
        modules = dict(model.named_modules())
        for name, mod in modules.items():                # a previous prepare's wrappers step aside
            if _SITE_ATTR in mod.__dict__:
                mod.__dict__[_SITE_ATTR]["enabled"] = None
        regions, islands = [], []
        for name in ["", *names]:
            inside = name in allowed
            outer = (_parent(name) in allowed) if name else False
            if inside and not outer:
                regions.append(name)
            elif not inside and outer:
                islands.append(name)
        covered = [n for n in names if n in allowed]
        if not covered:
            scope.warn_nothing_to_act_on(f"every module of {type(model).__name__} is excluded (targets "
                                         f"{list(self.targets)}, exclude {list(self.exclude)}, skip decorators)")
        if not regions:
            return effpass.PassResult(stats={"wrapped_regions": 0, "wrapped_islands": 0},
                                      skipped=[{"site": "model", "reason": "no module in scope"}])
        # islands only inside a region: a disallowed module outside every region already runs in fp32
        for name in regions:
            _wrap_module(modules[name], device_type, self.dtype, True, cache)
        for name in islands:
            _wrap_module(modules[name], device_type, self.dtype, False, cache)
        object.__setattr__(model, _MODEL_ATTR, {"regions": regions, "islands": islands, "routers": routers,
                                                "dtype": self.dtype, "device": device_type})
        if self.dtype == torch.float16 and ctx.fact(LossScaling) is None:
            _warn_fp16()
        stats: dict[str, Any] = {"capture": "module", "wrapped_regions": len(regions),
                                 "wrapped_islands": len(islands), "dtype": _dtype_name(self.dtype)}
        if islands:
            stats["island_modules"] = sorted(n or "<root>" for n in islands)
        if routers:
            stats["fp32_routers"] = len(routers)
            stats["departs_from_eager_autocast"] = _router_departure(len(routers), self.dtype)
        if self.targets:
            stats["region_modules"] = sorted(n or "<root>" for n in regions)
        return effpass.PassResult(changed=True, stats=stats)

    # ------------------------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        device_type = (ctx.device or torch.device("cpu")).type
        prepared = getattr(ctx.model, _MODEL_ATTR, None) if ctx.model is not None else None
        ours = [n for n in graph.nodes if is_autocast_enter(n) and _is_ours(n)]
        if ours or prepared is not None:
            return self._report_module_capture(gm, ctx, ours)
        if AutocastRegions.outer_dtype(device_type) is not None:
            return effpass.PassResult(skipped=[{
                "site": "graph", "reason": f"autocast is already enabled for {device_type!r} around the compiled "
                                           "call; the caller chose the precision"}])
        return self._graph_capture(gm, ctx, device_type)

    def _report_module_capture(self, gm, ctx, ours) -> effpass.PassResult:
        device_type = (ctx.device or torch.device("cpu")).type
        prepared = getattr(ctx.model, _MODEL_ATTR, None) if ctx.model is not None else None
        enters = [n for n in gm.graph.nodes if is_autocast_enter(n)]
        inherited = AutocastRegions.outer_dtype(device_type) is not None
        skipped = []
        if inherited and not ours:
            skipped.append({"site": "graph", "reason": (
                f"autocast is already enabled for {device_type!r} when this graph is traced (the caller's own "
                "autocast, or an effpass region entered before a graph break): the graph runs in it")})
        elif not ours:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "no effpass autocast region in this graph"}])
        stats: dict[str, Any] = {
            "capture": "module",
            "regions": sum(1 for n in ours if n.args[2]),
            "fp32_islands": sum(1 for n in ours if not n.args[2]),
            "user_regions_kept": len(enters) - len(ours),
            "inherited_regions": int(inherited),
            "dtype": _dtype_name(self.dtype),
        }
        routers = tuple((prepared or {}).get("routers", ()))
        in_routers = [n for n in ours if not n.args[2] and any(
            p == r or p.startswith(r + ".") for r in routers for p in [_island_path(n)])]
        if in_routers:  # the departure from eager torch.autocast, named on every graph it touches
            stats["fp32_router_islands"] = len(in_routers)
            stats["departs_from_eager_autocast"] = _router_departure(len(in_routers), self.dtype)
        if ctx.example_inputs:
            with torch.autocast(device_type, enabled=False):
                before = _safe_dtype_stats(gm, ctx.example_inputs, autocast=False)
            after = _safe_dtype_stats(gm, ctx.example_inputs)
            if before is not None and after is not None:
                stats["ops_by_dtype_before"], stats["matmuls_by_dtype_before"] = before
                stats["ops_by_dtype_after"], stats["matmuls_by_dtype_after"] = after
        why = (f"the module phase's wrappers entered this graph's autocast regions ({stats['regions']} region(s), "
               f"{stats['fp32_islands']} fp32 island(s) traced here): nothing left to insert" if ours else "")
        return effpass.PassResult(changed=False, stats=stats, skipped=skipped, why_unchanged=why)

    def _graph_capture(self, gm: fx.GraphModule, ctx, device_type: str, warn: bool = True) -> effpass.PassResult:
        if self.fp32_routers:  # NOTE(moe): routers are found on the eager model; a traced graph alone cannot keep
            warnings.warn(_ROUTERS_NOT_KEPT, UserWarning, stacklevel=2)  # the option: said, not silently dropped
        graph = gm.graph
        if warn:
            warnings.warn(_GRAPH_CAPTURE_WARNING, UserWarning, stacklevel=2)
        nodes = [n for n in graph.nodes if _is_compute(n)]
        if not nodes:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "graph has no ops"}])
        ctx.scope.select_nodes(gm, [n for n in nodes if _is_float_op(n)], what="floating-point op")
        if self.dtype == torch.float16 and ctx.fact(LossScaling) is None and torch.is_grad_enabled():
            _warn_fp16()
        before = _safe_dtype_stats(gm, ctx.example_inputs)

        # Split the graph into segments outside the user's own autocast regions.
        regions_in_graph = AutocastRegions(graph)
        segments: list[list[fx.Node]] = [[]]
        user_regions = 0
        for n in nodes:
            if regions_in_graph.inside(n):
                continue
            if is_autocast_enter(n):
                user_regions += 1
                segments.append([])
            elif not is_autocast_exit(n):
                segments[-1].append(n)
        segments = [s for s in segments if s]
        if not regions_in_graph.balanced:
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
        stats: dict[str, Any] = {"capture": "graph", "regions": regions, "fp32_islands": islands,
                                 "user_regions_kept": user_regions, "dtype": _dtype_name(self.dtype)}
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
                    copy_provenance(c, arg, values=True)
                    casts[arg] = c
                n.replace_input_with(arg, casts[arg])


_ROUTERS_NOT_KEPT = (
    "effpass: apply_autocast(fp32_routers=True) is not applied through torch.compile(model, backend='effpass'): "
    "the routers are found on the eager model, which this path does not see, so they run in the low-precision "
    "dtype as eager torch.autocast runs them; use effpass.compile(model, ...) or effpass.prepare(model, ...)")

_GRAPH_CAPTURE_WARNING = (
    "effpass: apply_autocast without its module phase (torch.compile(model, backend='effpass')) inserts autocast "
    "regions into the graph Dynamo traced in fp32; model code that reads dtypes (x.to(y.dtype)) was recorded for "
    "fp32, so results may differ from eager torch.autocast by a rounding step. effpass.compile(model, passes=[...]) "
    "or effpass.prepare(model, passes=[...]) capture under autocast and are bit-identical to eager torch.autocast")


def _warn_fp16() -> None:
    warnings.warn("effpass: apply_autocast(dtype=float16) without scale_loss: small fp16 gradients may "
                  "underflow to zero; add effpass.passes.ScaleLoss() to the pipeline", UserWarning, stacklevel=3)


def _island_path(enter: fx.Node) -> str:
    """The module an island's enter node opens (the enter node itself carries no module stack: the wrapper
    enters the region before the module's own code): that of the first op inside it."""
    n = enter.next
    while n.op != "output" and not is_autocast_exit(n):
        path = module_path_of_node(n)
        if path:
            return path
        n = n.next
    return ""


def _router_departure(n: int, dtype: torch.dtype) -> str:
    return (f"{n} MoE router(s) run in fp32 (fp32_routers=True); eager torch.autocast runs them in "
            f"{_dtype_name(dtype)}: fp32_routers=False reproduces eager autocast bit for bit")


def _is_ours(node: fx.Node) -> bool:
    """An enter node of effpass's module wrappers (they always record cache_enabled as a bool)."""
    return len(node.args) >= 4 and isinstance(node.args[3], bool)
