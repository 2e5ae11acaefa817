"""``wrap_fsdp``: shard the model with PyTorch's FSDP2 per repeated block and compile inside each unit.

Phase: module only (``prepare_module``), on the eager model before the optimizer is built.

What it does
    1. Finds the FSDP units: the entries of every ``nn.ModuleList`` whose entries are all of one class
       (a transformer's decoder layers), or the modules named by ``targets``.
    2. For each unit, in order: ``fully_shard(unit, mesh=..., reshard_after_forward=..., mp_policy=...)``,
       then replaces ``unit.forward`` with ``torch.compile(unit.forward, backend=<this pipeline's effpass
       backend>)``. FSDP2's all-gather/reduce-scatter hooks run eagerly around the compiled forward, so the
       backend sees plain, unsharded parameters and no collectives: every graph pass of the pipeline
       (attention fusion, autocast, checkpointing, LoRA, ...) applies inside each unit unchanged.
    3. Wraps the root last (it owns the parameters outside the blocks: embeddings, final norm, head),
       and sets ``ctx.compile_root = False`` so ``effpass.compile`` returns the (sharded) model itself.
    4. ``compile_root``: compiles the root's ``forward`` too, with the same backend, after wrapping the
       forward of the root's child that holds the blocks (the *boundary*, ``model`` in a
       ``LlamaForCausalLM``) in ``torch._dynamo.disable``. Dynamo breaks the root's graph there (one
       deliberate graph break), that call runs eagerly with its compiled units and FSDP's hooks, and the
       graph resumed after it holds the code after the blocks (``lm_head`` and the loss), so graph passes
       such as ``fuse_cross_entropy`` see head and loss together. FSDP2's root hooks run in ``_call_impl``,
       outside the compiled ``forward``, and have unsharded the root's parameters before it runs. Without
       a boundary (the blocks sit directly in a ``ModuleList`` of the root, or a unit is a direct child of
       the root) the root runs eagerly, with a warning when ``fuse_cross_entropy`` is in the pipeline.
       A root that wraps several models (a DPO / GRPO loss module holding a policy and a frozen reference)
       has one boundary per model (``policy.model``, ``ref.model``: the module holding each model's blocks);
       those breaks are in nested frames, so the root is run with Dynamo's ``nested_graph_breaks`` (tracing
       resumes in the callers' frames: each head and the log-probabilities computed from it share a graph).

Ordering: runs after every other module pass (``quantize_linear``, ``inject_lora``) because sharding
turns parameters into DTensors; modules added or swapped later would not be sharded. It is also
declared after ``apply_autocast`` and ``scale_loss`` (graph passes). The mixed-precision policy follows
the pipeline's ``MixedPrecision`` fact (``effpass.facts``, declared by ``apply_autocast``), not its options.

Invariants
    * ``torch.distributed`` is initialised (``dist.init_process_group``) before the pass runs.
    * Each unit's compiled graph names modules with their full path from the root (``model.layers.3.
      self_attn``): the per-unit backend prefixes ``nn_module_stack`` so ``targets`` globs of the graph
      passes keep their meaning.
    * After the pass the eager model (each unit's and the root's ``_orig_forward``) computes what the
      compiled one does (the boundary's disabled ``forward`` is its own ``forward`` when run eagerly).

Also here: :func:`estimate` / :func:`estimate_table` (memory per rank on paper, ZeRO accounting) and
:func:`save_checkpoint` / :func:`load_checkpoint` (``torch.distributed.checkpoint`` of model, optimizer
and loss-scaler state).
"""
from __future__ import annotations

import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import effpass
from effpass.facts import FusesLossHead, MixedPrecision, ShardsParameters
from effpass.graph import transformer_blocks

from .sizing import estimate, estimate_table, max_model_params  # noqa: F401  (re-exported)

__all__ = ["WrapFSDP", "find_units", "estimate", "estimate_table", "max_model_params", "save_checkpoint",
           "load_checkpoint", "build_mesh"]


def find_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP units: the model's repeated blocks (:func:`effpass.graph.transformer_blocks`)."""
    return transformer_blocks(model)


def build_mesh(replicate: int = 1, device_type: str | None = None):
    """A 1-D mesh over all ranks (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP: shard inside a group
    of ``world_size // replicate`` ranks, usually one node, and replicate across groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if world % replicate:
        raise ValueError(f"wrap_fsdp: replicate={replicate} must divide the world size {world}")
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def _fresh_caller(func, name: str):
    """``lambda self, *a, **k: func(self, *a, **k)`` with a code object of its own.

    NOTE(recompiles): Dynamo keeps its cache and its recompile limit (8) per code object; all blocks
    share ``Block.forward``'s code, so compiling them directly would recompile per block and fall back
    to eager after the eighth. A fresh code object per unit gives each unit its own cache.
    """
    def call(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    code = call.__code__.replace(co_name=name, co_qualname=name)
    fn = types.FunctionType(code, call.__globals__, name, None, call.__closure__)
    fn.__wrapped__ = func
    return fn


class _UnitBackend:
    """The pipeline's effpass backend, seen from inside one FSDP unit.

    Dynamo compiles ``unit.forward``, so its graphs name modules relative to the unit (``self_attn``);
    this prefixes every ``nn_module_stack`` with the unit's path from the root (``model.layers.3``), so
    scoping globs and module lookups of the graph passes mean what they mean without FSDP.
    """

    def __init__(self, backend, unit_name: str, unit_type: type):
        self.backend, self.unit_name, self.unit_type = backend, unit_name, unit_type

    def _path(self, path: str) -> str:
        rest = effpass.scope.normalize_module_path(str(path))
        return f"L['self'].{self.unit_name}" + (f".{rest}" if rest else "")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        root_key = f"__effpass_unit__{self.unit_name}"
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            stack = node.meta.get("nn_module_stack") or {}
            new = {root_key: (f"L['self'].{self.unit_name}", self.unit_type)}
            for key, value in stack.items():
                path, klass = value if isinstance(value, tuple) else (value, None)
                new[key] = (self._path(path), klass)
            node.meta["nn_module_stack"] = new
        meta = getattr(gm, "meta", None)
        if isinstance(meta, dict) and "dynamo_flat_name_to_original_fqn" in meta:
            gm.meta = dict(meta)
            gm.meta["dynamo_flat_name_to_original_fqn"] = {
                k: f"{self.unit_name}.{v}" for k, v in meta["dynamo_flat_name_to_original_fqn"].items()}
        return self.backend(gm, example_inputs, **kwargs)


@effpass.register_pass("wrap_fsdp", run_after=("inject_lora", "quantize_linear", "apply_autocast", "scale_loss",
                                               "shard_sequence"))
@dataclass(frozen=True, kw_only=True)
class WrapFSDP(effpass.Pass):
    """Shard the model with FSDP2 per repeated block (root last) and compile inside each unit.

    Before (module tree)::

        LlamaForCausalLM
          model.layers: ModuleList[LlamaDecoderLayer x 2]      (plain parameters)

    After::

        FSDPLlamaForCausalLM                                  (embeddings, norm, head: DTensor shards)
          model.layers.0: FSDPLlamaDecoderLayer               (its own DTensor shards, all-gathered
            .forward = torch.compile(..., backend=effpass)     just before its compiled forward)
          model.layers.1: FSDPLlamaDecoderLayer
        .forward = torch.compile(..., backend=effpass)         root: head + loss in one graph, after
        model.forward = torch._dynamo.disable(...)              the boundary (run eagerly, units inside)
    """

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: ZeRO-3 sharding over ``world_size`` ranks (lossless; per-rank accounting
        folded onto the one-rank replay)."""
        if model is not None and world_size <= 1:
            return []
        return [effpass.MemoryOption(technique="fsdp", lossless=True, group="sharding", changes="sharding",
                                     phase="module", sharding="zero3", label="fsdp",
                                     cost="all-gathers each block's parameters in forward and backward")]

    reshard_after_forward: bool = field(default=True, metadata={
        "doc": "free each unit's gathered parameters after forward (ZeRO-3-like); False keeps them to backward (ZeRO-2-like)"})
    replicate: int = field(default=1, metadata={
        "doc": "number of replica groups: >1 builds a (replicate, shard) mesh (HSDP, e.g. one shard group per node)"})
    param_dtype: torch.dtype | None = field(default=None, metadata={
        "doc": "dtype of the gathered parameters for compute (default: apply_autocast's dtype, else unchanged)"})
    reduce_dtype: torch.dtype | None = field(default=None, metadata={
        "doc": "dtype of the gradient reduction (default: float32 when param_dtype is lower precision)"})
    compile_units: bool = field(default=True, metadata={
        "doc": "compile each unit's forward with the pipeline's effpass backend (False: shard only, run eagerly)"})
    compile_root: bool = field(default=True, metadata={
        "doc": "also compile the root's forward around the child holding the blocks (excluded from Dynamo), so "
               "head and loss are one graph of the pipeline (fuse_cross_entropy); needs compile_units"})

    def validate(self) -> None:
        if self.replicate < 1:
            raise ValueError(f"wrap_fsdp: replicate must be >= 1, got {self.replicate}")

    def facts(self) -> tuple:
        """The parameters are sharded and their gradients reduced over all ranks (read by shard_sequence)."""
        return (ShardsParameters(),)

    @classmethod
    def default_note(cls) -> str:
        return "off (needs torch.distributed; add WrapFSDP() under torchrun)"

    # -- helpers --------------------------------------------------------------------------------------
    def mixed_precision(self, ctx=None):
        """The ``MixedPrecisionPolicy`` used: explicit options win, then the pipeline's
        :class:`~effpass.facts.MixedPrecision` fact (``apply_autocast``'s dtype)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param_dtype = self.param_dtype
        if param_dtype is None and ctx is not None:
            mp = ctx.fact(MixedPrecision)
            param_dtype = mp.dtype if mp is not None else None
        reduce_dtype = self.reduce_dtype
        if reduce_dtype is None and param_dtype in (torch.bfloat16, torch.float16):
            reduce_dtype = torch.float32
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    # -- the module hook ------------------------------------------------------------------------------
    def prepare_module(self, model: nn.Module, ctx) -> effpass.PassResult:
        ctx.scope.check_graph()   # every targets/exclude glob must name a module of the model
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "wrap_fsdp needs torch.distributed: call torch.distributed.init_process_group() first "
                "(under torchrun; backend 'nccl' on GPUs, 'gloo' on CPU), even for a single process")
        from torch.distributed.fsdp import fully_shard

        if self.targets:
            units = ctx.scope.select_modules(model, what="FSDP unit")
            names = [n for n, _ in units]
            # NOTE: a target inside another target would be sharded twice; keep the outermost.
            units = [(n, m) for n, m in units if not any(n.startswith(o + ".") for o in names)]
        else:
            units = [(n, m) for n, m in find_units(model)
                     if ctx.scope.matches_globs(n) and ctx.scope.allows_module(n, m)]
        if not units:
            raise ValueError("wrap_fsdp: found no repeated blocks (no ModuleList of identical layers) to use as "
                             "FSDP units; name them with targets=['model.layers.*']")
        mesh = build_mesh(self.replicate)
        mp = self.mixed_precision(ctx)
        backend = ctx.backend_factory() if (self.compile_units and ctx.backend_factory is not None) else None
        for name, unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        # NOTE(ordering): the root last, so it owns only the parameters outside the units; its
        # reshard_after_forward=False avoids re-gathering them at the start of backward.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        ctx.compile_root = False
        compiled, boundary = 0, None
        if backend is not None:
            compiled, boundary = compile_sharded(model, units, backend, ctx.compile_kwargs,
                                                 compile_root=self.compile_root,
                                                 fused_head=ctx.fact(FusesLossHead) is not None)
        elif ctx.fact(FusesLossHead) is not None:
            _warn_unfused_head("compile_units=False")
        n_params = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        return effpass.PassResult(changed=True, stats={
            "units": len(units), "compiled_units": compiled, "compiled_root": int(boundary is not None),
            "root_boundary": boundary or "", "world_size": dist.get_world_size(),
            "replicate": self.replicate, "reshard_after_forward": self.reshard_after_forward,
            "param_dtype": str(mp.param_dtype).removeprefix("torch.") if mp.param_dtype else "unchanged",
            "params": n_params, "local_params": local})


def _warn_unfused_head(why_not: str, compiled_root: bool = False) -> None:
    if compiled_root:
        warnings.warn(
            f"effpass: wrap_fsdp compiles the root module, but {why_not}: the head and the code of the callers "
            "after it (log-probabilities, the loss) land in different graphs, so fuse_cross_entropy may not see "
            "them together; such heads run unfused and their logits are materialised", UserWarning, stacklevel=3)
        return
    warnings.warn(
        f"effpass: wrap_fsdp does not compile the root module ({why_not}): its code outside the "
        "blocks runs eagerly, so fuse_cross_entropy never sees the head and the loss; the head "
        "runs unfused and the logits are materialised", UserWarning, stacklevel=3)


def compile_sharded(model: nn.Module, units: list[tuple[str, nn.Module]], backend, compile_kwargs: dict, *,
                    compile_root: bool = True, fused_head: bool = False) -> tuple[int, str | None]:
    """Compile an FSDP2-sharded model the way its hooks allow: inside each unit (the unit's ``forward``,
    which Dynamo traces with gathered parameters and no collectives) and the root's ``forward`` around the
    container of the units (head and loss in one graph). Returns (units compiled, root boundary or None)."""
    compiled = 0
    for name, unit in units:
        unit._orig_forward = unit.forward
        caller = _fresh_caller(unit.forward.__func__, f"effpass_fsdp_unit_{compiled}")
        compiled_fn = torch.compile(caller, backend=_UnitBackend(backend, name, type(unit)), **compile_kwargs)
        unit.forward = types.MethodType(compiled_fn, unit)
        compiled += 1
    boundaries, why_not = _root_boundaries(model, units)
    if compile_root and boundaries:
        nested = _compile_root(model, boundaries, backend, compile_kwargs)
        if fused_head and not nested and any("." in b for b in boundaries):
            _warn_unfused_head(f"the blocks sit below a submodule ({', '.join(boundaries)}) and this torch has no "
                               "torch._dynamo.config.nested_graph_breaks", compiled_root=True)
        return compiled, ",".join(boundaries)
    if fused_head:
        _warn_unfused_head(why_not if compile_root else "compile_root=False")
    return compiled, None


@effpass.register_extension("adopt_fsdp")
def adopt_fsdp(model: nn.Module, backend, compile_kwargs: dict) -> dict:
    """An effpass-compiled model that someone else sharded with FSDP2 afterwards (accelerate's FSDP2
    plugin, under ``Trainer``): compiled as a whole, FSDP2's hooks (excluded from Dynamo) would break its
    graph at every unit and no pass would see an attention or the head. Called by effpass's compiled call
    the first time it finds the model sharded: recompiles it as ``wrap_fsdp`` does, inside each FSDP unit
    and the root around them, with the same backend (pipeline, report). Returns statistics."""
    from torch.distributed.fsdp import FSDPModule

    names = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    # the outermost sharded submodules are the units (accelerate wraps the transformer blocks)
    units = [(n, model.get_submodule(n)) for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    if not units:
        raise ValueError("effpass: the model was sharded with FSDP2 as one unit (no sharded submodules); "
                         "shard the transformer blocks (accelerate: fsdp_auto_wrap_policy "
                         "TRANSFORMER_BASED_WRAP) or use effpass's wrap_fsdp pass")
    mgr = backend.manager_for([p for p in model.parameters()][:1]) if hasattr(backend, "manager_for") else None
    fused = mgr is not None and mgr.fact(FusesLossHead) is not None
    compiled, boundary = compile_sharded(model, units, backend, {k: v for k, v in compile_kwargs.items() if v is not None},
                                         fused_head=fused)
    return {"units": len(units), "compiled_units": compiled, "compiled_root": int(boundary is not None),
            "root_boundary": boundary or ""}


def _root_boundaries(model: nn.Module, units: list[tuple[str, nn.Module]]) -> tuple[list[str], str]:
    """The modules around the blocks, each called as a whole: for every unit the module holding the
    ``ModuleList`` of its blocks (``model`` of a ``LlamaForCausalLM``, ``transformer`` of a GPT-2; in a module
    that wraps a policy and a frozen reference, as a DPO loss does, ``policy.model`` and ``ref.model``), the
    outermost ones; or ``([], reason)``. The deepest such module is taken, not the root's child: a child that
    also holds the head (``policy``) would run the head eagerly, outside every graph."""
    containers: set[str] = set()
    for name, _ in units:
        parts = name.split(".")
        parent = ".".join(parts[:-1])
        holder = model.get_submodule(parent) if parent else model
        if isinstance(holder, (nn.ModuleList, nn.ModuleDict)):
            parent = ".".join(parts[:-2])
            if not parent:
                return [], (f"the blocks are in the root's {type(holder).__name__} {parts[0]!r}, iterated by the "
                            "root's forward")
        if not parent:
            return [], f"the unit {name!r} is a direct child of the root: no submodule around the blocks"
        containers.add(parent)
    outer = sorted(c for c in containers if not any(c.startswith(o + ".") for o in containers))
    return outer, ""


def _compile_root(model: nn.Module, boundaries: list[str], backend, compile_kwargs: dict) -> bool:
    """Compile ``model.forward`` with ``backend``, each boundary module's ``forward`` excluded from Dynamo.
    Returns whether nested graph breaks are on (boundaries below a child of the root).

    NOTE(graph break): the exclusion is the point: Dynamo must not trace into the units (already compiled,
    each with its own backend) nor into FSDP2's hooks (run in each unit's ``_call_impl``). The boundary's
    call runs eagerly; the units inside compile as before; the graph after it (head, loss) is compiled
    with the pipeline's backend. ``fullgraph`` is not passed on: the break is deliberate.

    NOTE(nested graph breaks): a boundary below a child of the root (``policy.model``, called from
    ``policy.forward``, called from the root's ``forward``) breaks the graph in a nested frame. By default
    Dynamo then compiles every frame on the stack on its own, so the head (``policy.forward``'s code after the
    break) and its caller's log-softmax land in different graphs and cannot be fused. With
    ``torch._dynamo.config.nested_graph_breaks`` (torch >= 2.13; patched only around this root's calls)
    tracing resumes in the nested frames: one graph holds the head and what the callers compute from it.
    """
    why = "wrap_fsdp: the blocks' FSDP units are compiled on their own; the root's graph resumes after them"
    for boundary in boundaries:
        child = model.get_submodule(boundary)
        child._orig_forward = child.forward
        # bound with MethodType, like the units' compiled forwards (not a closure over the bound method)
        try:
            disabled = torch._dynamo.disable(child.forward.__func__, reason=why)
        except TypeError:  # a torch whose disable() takes no reason
            disabled = torch._dynamo.disable(child.forward.__func__)
        child.forward = types.MethodType(disabled, child)
    model._orig_forward = model.forward
    caller = _fresh_caller(model.forward.__func__, "effpass_fsdp_root")
    kwargs = {k: v for k, v in compile_kwargs.items() if k != "fullgraph"}
    compiled = torch.compile(caller, backend=backend, **kwargs)
    nested = any("." in b for b in boundaries) and hasattr(torch._dynamo.config, "nested_graph_breaks")
    if nested:
        compiled = _with_nested_graph_breaks(compiled)
    model.forward = types.MethodType(compiled, model)
    import sys

    if "transformers" in sys.modules:  # GPT-2 & co: no logger call between head and loss (a graph break)
        from effpass.integrations.huggingface import set_hf_loss_type

        set_hf_loss_type(model)
    return nested


def _with_nested_graph_breaks(compiled):
    """``compiled`` run with ``torch._dynamo.config.nested_graph_breaks`` on (its frames, and the resumed frames
    after each boundary, are compiled during the call)."""
    def call(self, *args, **kwargs):
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            return compiled(self, *args, **kwargs)

    call.__wrapped__ = compiled
    return call


# ------------------------------------------------------------------------------------------------------
# checkpoints: torch.distributed.checkpoint (sharded, resharding-safe)
# ------------------------------------------------------------------------------------------------------
class _AppState:
    """A DCP ``Stateful``: model + optimizer through ``get_state_dict``/``set_state_dict``, plus extras
    (a loss scaler, the step) that have ``state_dict``/``load_state_dict`` or are plain values."""

    def __init__(self, model, optimizer, extra: dict[str, Any] | None):
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra or {})

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        out = {"model": model_sd, "optim": optim_sd}
        for k, v in self.extra.items():
            out[f"extra.{k}"] = v.state_dict() if hasattr(v, "state_dict") else v
        return out

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for k, v in self.extra.items():
            if hasattr(v, "load_state_dict"):
                v.load_state_dict(sd[f"extra.{k}"])
            else:
                self.extra[k] = sd[f"extra.{k}"]


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Save sharded model and optimizer state (and ``extra``: a loss scaler, the step) with DCP.

    Every rank calls it. Each rank writes its own shards; the directory can be loaded at another world size.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": _AppState(model, optimizer, extra)}, checkpoint_id=str(path))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into ``model``/``optimizer`` (in place) and the objects in
    ``extra`` that have ``load_state_dict``; returns ``extra`` with plain values (the step) replaced."""
    import torch.distributed.checkpoint as dcp

    state = _AppState(model, optimizer, extra)
    dcp.load({"app": state}, checkpoint_id=str(path))
    return state.extra
