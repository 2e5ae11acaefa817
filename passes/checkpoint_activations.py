"""``checkpoint_activations``: selective activation checkpointing by policy or by memory budget.

What it does
    Marks forward nodes of the joint forward+backward graph for AOTAutograd's min-cut partitioner:
    ``node.meta["recompute"]`` (a :class:`torch.utils.checkpoint.CheckpointPolicy`) says whether a
    value is saved for the backward (``MUST_SAVE``) or recomputed there (``PREFER_RECOMPUTE``), and
    ``node.meta["ac_graph_id"]`` numbers the block (transformer layer) the node belongs to, so the
    partitioner saves the values that cross from one block into the next. No module is wrapped and the
    eager model is untouched: the eager model computes the same function (reference semantics).

    Policies (``policy`` / ``budget`` options):

    * ``"ops"`` (default): save the outputs of matmuls, convolutions and attention; recompute
      pointwise ops, norms, softmax and views from them (a pointwise value is saved instead only when
      that costs no extra bytes and no extra recompute, e.g. a residual ``add`` after a projection).
    * ``"full"``: per block, save only the block's inputs; everything inside a block is recomputed.
    * ``budget=0.4`` / ``budget="6GiB"``: keep the saved activations under the budget (a fraction of the
      bytes saved without checkpointing, or absolute bytes) with the least recompute FLOPs effpass can
      find: starting from "full", values are saved greedily by recompute FLOPs avoided per byte.

Phases
    ``joint`` (marks; inference graphs have no backward and are left alone) and ``post_grad`` (the
    backward graph: measures the bytes actually saved for backward after partitioning).

Ordering
    Runs after ``fuse_attention`` (an attention op fused by it is one "save" site instead of a chain of
    matmuls and a softmax) and after ``apply_autocast`` (the casts it inserts decide the dtype, so the
    bytes, of what is saved).

Statistics (per joint graph; ``effpass.report(m).stats("checkpoint_activations")`` sums over graphs)
    ``saved_bytes_before``: activation bytes saved for backward by the partitioner with no marks (the
    joint graph partitioned on a copy); ``saved_bytes_after``: the same with this pass's marks;
    ``saved_bytes_measured``: read from the real backward graph's inputs after partitioning;
    ``recompute_flops_before/after`` and ``recompute_flops_added``: FLOPs of forward ops that the
    backward graph recomputes; ``marked_save``, ``marked_recompute``, ``blocks``; budget mode adds
    ``budget_bytes`` and ``budget_met``. Activation bytes exclude parameters and graph inputs (they
    are alive anyway) and count a storage once.

Invariants relied on
    Forward nodes of the joint graph carry ``nn_module_stack`` (checked on torch 2.11 and 2.13); a
    multi-output op and its ``getitem`` users get the same policy (the min-cut fails otherwise); random
    ops that are recomputed are replayed with the same random numbers (the partitioner functionalizes
    their RNG state when any is marked for recompute).
"""
from __future__ import annotations

import fnmatch
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import effpass
from effpass.graph import is_primal, is_tangent, module_path_of_node, module_stack_of_node, tensor_meta, \
    transformer_blocks

__all__ = ["CheckpointActivations", "parse_bytes", "partition_stats", "mark_graph", "find_blocks"]

MUST_SAVE = CheckpointPolicy.MUST_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE

_aten = torch.ops.aten
#: ops whose outputs the "ops" policy saves: matmuls, convolutions, attention (costly to recompute)
_SAVE_PACKETS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul, _aten.linear, _aten.convolution,
    _aten._convolution, _aten.scaled_dot_product_attention, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_cudnn_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._flash_attention_forward,
    _aten._efficient_attention_forward,
}
for _name in ("_scaled_mm", "_weight_int8pack_mm", "_int_mm", "_scaled_dot_product_fused_attention_overrideable"):
    if hasattr(_aten, _name):
        _SAVE_PACKETS.add(getattr(_aten, _name))

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"6GiB"`` -> 6442450944; ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` (bytes) also work."""
    m = _BYTES_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if unit and not unit.endswith("b"):
        unit += "b"  # "6G" reads as "6GB"
    if not m or unit not in ("",) + tuple(_UNITS):
        raise ValueError(f"checkpoint_activations.budget: cannot read {text!r} as a size; use a fraction "
                         f"in (0, 1] or a size such as '6GiB', '512MiB', '1.5GB' (units: {sorted(_UNITS)})")
    return int(float(m.group(1)) * _UNITS.get(unit or "b"))


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointMarked(effpass.Note):
    """Left by the joint hook for the post-grad hook of the same graph: the marking's statistics and the
    storages of the joint graph's inputs (not activations: alive anyway)."""

    stats: dict
    input_storages: frozenset


@effpass.register_pass("checkpoint_activations", run_after=("fuse_attention", "apply_autocast"))
@dataclass(frozen=True, kw_only=True)
class CheckpointActivations(effpass.Pass):
    """Selective activation checkpointing: marks forward nodes of the joint graph save or recompute.

    Before (joint graph, one Llama MLP; no marks, the partitioner saves what it likes)::

        mm = aten.mm(x, w_gate); silu = aten.silu(mm); mm_1 = aten.mm(x, w_up)
        mul = aten.mul(silu, mm_1); mm_2 = aten.mm(mul, w_down)        # ... backward uses mul, silu

    After ``CheckpointActivations()`` (policy "ops")::

        mm    meta["recompute"]=MUST_SAVE         meta["ac_graph_id"]=1
        silu  meta["recompute"]=PREFER_RECOMPUTE  meta["ac_graph_id"]=1   # recomputed in backward
        mm_1  meta["recompute"]=MUST_SAVE         ...
        mul   meta["recompute"]=PREFER_RECOMPUTE  ...

    With ``policy="full"`` every node of a block is ``PREFER_RECOMPUTE``; the partitioner then saves
    only the values entering each block.
    """

    policy: Literal["ops", "full"] = field(default="ops", metadata={
        "doc": "'ops': save matmul/conv/attention outputs, recompute the rest; 'full': per block save only "
               "the block inputs"})
    budget: float | str | None = field(default=None, metadata={
        "doc": "saved-activation budget: a fraction in (0, 1] of the bytes saved without checkpointing, or a "
               "size such as '6GiB'; effpass meets it with the least recompute FLOPs it finds (policy must be 'ops')"})
    save_ops: tuple[str, ...] = field(default=(), metadata={
        "doc": "extra aten op names whose outputs are always saved (e.g. 'aten.mul'); policy 'ops' and budget"})
    recompute_modules: tuple[str, ...] = field(default=(), metadata={
        "doc": "module-name globs whose matmul outputs policy 'ops' recomputes instead of saving, e.g. "
               "['*.q_proj', '*.k_proj', '*.v_proj']: a deeper cut for a few % more FLOPs"})

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: per-op then per-block recomputation (lossless)."""
        return [effpass.MemoryOption(technique="checkpoint", options={"policy": p}, lossless=True, group="checkpoint",
                                     changes="activations", label=f"checkpoint({p})", order=i, cost=cost)
                for i, (p, cost) in enumerate((("ops", "recomputes elementwise ops in backward"),
                                               ("full", "recomputes each block's forward in backward")))]

    def validate(self) -> None:
        if self.budget is not None:
            if self.policy != "ops":
                raise ValueError(f"checkpoint_activations: budget={self.budget!r} chooses what to save itself; "
                                 f"it cannot be combined with policy={self.policy!r} (leave policy at 'ops')")
            if isinstance(self.budget, str):
                parse_bytes(self.budget)
            elif not (0.0 < self.budget <= 1.0):
                raise ValueError(f"checkpoint_activations.budget: {self.budget!r} is not a fraction in (0, 1]; "
                                 "give an absolute budget as a string such as '6GiB' or '512MiB'")
        for name in self.save_ops:
            if _packet_of_name(name) is None:
                raise ValueError(f"checkpoint_activations.save_ops: {name!r} is not an aten op name "
                                 "(write it as 'aten.mul' or 'mul')")

    @classmethod
    def default_note(cls) -> str:
        return "off (training memory/compute trade-off: opt in)"

    # -- joint phase: mark ---------------------------------------------------------------------------
    def transform_joint(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        if ctx.graph_kind != "joint":
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "inference graph: nothing is saved "
                                                "for a backward"}])
        graph = gm.graph
        fwd = forward_nodes(graph)
        in_scope = ctx.scope.select_nodes(gm, [n for n in fwd if n.op == "call_function"], what="forward op")
        if not in_scope:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "no forward node in targets"}])
        block_of = find_blocks(in_scope, self.targets, ctx.model)
        num_fwd = num_forward_outputs(gm)
        # NOTE(cost): partitioning a copy of the graph costs about as much as the real partition; it is
        # done only where the plan needs it (budget mode) or a dump/report asked for detailed statistics.
        before = partition_stats(gm, num_fwd) if (self.budget is not None or ctx.detailed_stats) else None
        extra = {p for p in (_packet_of_name(s) for s in self.save_ops) if p is not None}
        stats: dict[str, Any] = {}
        after = None
        if self.budget is None:
            plan = plan_policy(in_scope, block_of, self.policy, extra, self.recompute_modules)
            if self.policy == "ops":
                plan = refine_free_saves(gm, in_scope, block_of, plan)
        else:
            budget_bytes = (parse_bytes(self.budget) if isinstance(self.budget, str)
                            else int(self.budget * before["saved_bytes"]))
            plan, met, after = plan_budget(gm, in_scope, block_of, budget_bytes, num_fwd, extra,
                                           before["saved_bytes"], allow_torch=not self.targets)
            stats.update(budget_bytes=budget_bytes, budget_met=met, torch_solver=isinstance(plan, TorchBudget))
            if isinstance(plan, TorchBudget):
                # torch's knapsack was best: let the partitioner run it on this graph (per-graph override)
                stats["torch_budget_fraction"] = plan.fraction
                next(iter(graph.nodes)).meta["memory_budget"] = float(plan.fraction)
                plan = {}
        mark_graph(plan)
        if before is not None and after is None:
            after = partition_stats(gm, num_fwd)
        blocks = sorted({b for b in block_of.values() if b})
        stats.update(
            marked_save=sum(1 for p in plan.values() if p[0] is MUST_SAVE),
            marked_recompute=sum(1 for p in plan.values() if p[0] is RECOMPUTE),
            blocks=len(blocks),
        )
        if before is not None:
            stats.update(
                saved_bytes_before=before["saved_bytes"], saved_bytes_after=after["saved_bytes"],
                recompute_flops_before=before["recompute_flops"], recompute_flops_after=after["recompute_flops"],
                recompute_flops_added=after["recompute_flops"] - before["recompute_flops"],
                recomputed_rng_ops=after["recomputed_rng_ops"],
            )
        # the backward graph sees only the inputs it keeps; views of other inputs are not activations either
        ctx.leave(CheckpointMarked(stats=dict(stats), input_storages=frozenset(
            _storage_key(tensor_meta(n)) for n in graph.find_nodes(op="placeholder")
            if isinstance(tensor_meta(n), torch.Tensor))))
        return effpass.PassResult(changed=True, stats=stats)

    # -- post-grad phase: measure ------------------------------------------------------------------------
    def transform_post_grad(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        marked = ctx.read(CheckpointMarked)
        if ctx.graph_kind != "backward" or marked is None:
            return None
        saved = [n for n in gm.graph.find_nodes(op="placeholder") if not is_tangent(n)]
        inputs = [n for n in saved if is_primal(n)]
        return effpass.PassResult(stats={"saved_bytes_measured": activation_bytes(saved, inputs, marked.input_storages)})


# ------------------------------------------------------------------------------------------------------
# graph helpers
# ------------------------------------------------------------------------------------------------------
def _packet_of_name(name: str):
    short = name.removeprefix("aten.").removeprefix("torch.ops.aten.").split(".")[0]
    return getattr(_aten, short, None) if short else None


def _packet(node: fx.Node):
    t = node.target
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else t


def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes of the joint graph that do not depend on a tangent, in graph order."""
    backward: set[fx.Node] = set()
    out = []
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            if is_tangent(n):
                backward.add(n)
            else:
                out.append(n)
            continue
        if n.meta.get("partitioner_tag") == "is_backward" or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        else:
            out.append(n)
    return out


def num_forward_outputs(gm: fx.GraphModule) -> int:
    """How many of the joint graph's outputs belong to the forward (the rest are gradients)."""
    import torch.utils._pytree as pytree

    out = next(iter(gm.graph.find_nodes(op="output")))
    leaves = pytree.arg_tree_leaves(*out.args)
    descs = out.meta.get("desc")
    if descs is not None:
        descs = pytree.arg_tree_leaves(descs)
        for i, d in enumerate(descs):
            if d is None or type(d).__name__ == "GradAOTOutput":
                return i
        return len(descs)
    fwd = set(forward_nodes(gm.graph))  # fallback: leading outputs computed without tangents
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, fx.Node) or leaf not in fwd or leaf.op == "placeholder":
            return i
    return len(leaves)  # pragma: no cover


_INDEX = re.compile(r"^\d+$")


def find_blocks(nodes: Iterable[fx.Node], targets: Iterable[str] = (), model: torch.nn.Module | None = None
                ) -> dict[fx.Node, str]:
    """node -> the block (module path) it belongs to, "" outside every block.

    With ``targets`` a block is the outermost module whose name matches a glob; otherwise it is one
    transformer layer: one of the model's repeated blocks (:func:`effpass.graph.transformer_blocks`), or,
    when the model is unknown, the outermost numbered child of a module (``model.layers.3``).
    """
    targets = tuple(targets)
    blocks = {name for name, _ in transformer_blocks(model)} if model is not None else None
    cache: dict[tuple, str] = {}
    out = {}
    for n in nodes:
        stack = tuple(p for p, _ in module_stack_of_node(n))
        if stack not in cache:
            cache[stack] = _block_of_stack(stack, targets, blocks)
        out[n] = cache[stack]
    if blocks and not targets and not any(out.values()):
        # the graph's module paths are relative to another root than ctx.model (e.g. a wrapper such as a
        # PeftModel or a Trainer's model): fall back to numbered children
        return find_blocks(nodes, targets, None)
    return out


def _block_of_stack(stack: tuple[str, ...], targets: tuple[str, ...], blocks: set[str] | None) -> str:
    path = stack[-1] if stack else ""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if targets:
            if any(fnmatch.fnmatchcase(prefix, g) for g in targets):
                return prefix
        elif blocks is not None:
            # exact names: effpass.graph.normalize_module_path strips the traced frame's root (L['self'],
            # L['args'][0]); a wrapper's own prefix names no block and falls back to numbered children
            # (find_blocks). A suffix match would take a top-level block "0" for a path "x.0".
            if prefix in blocks:
                return prefix
        elif _INDEX.match(parts[i - 1]) and i > 1:
            return prefix
    return ""


def _block_ids(nodes: list[fx.Node], block_of: dict[fx.Node, str]) -> dict[fx.Node, int]:
    """Block number per node, in graph order (1..N); nodes outside blocks get 0 before the first block
    and N+1 after it."""
    order: dict[str, int] = {}
    for n in nodes:
        b = block_of.get(n, "")
        if b and b not in order:
            order[b] = len(order) + 1
    ids, seen_block = {}, False
    for n in nodes:
        b = block_of.get(n, "")
        if b:
            seen_block = True
            ids[n] = order[b]
        else:
            ids[n] = len(order) + 1 if seen_block else 0
    return ids


def _is_random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _is_view_or_free(node: fx.Node) -> bool:
    t = node.target
    if t is operator.getitem:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return t.is_view or t.overloadpacket in (_aten.detach, _aten.alias, _aten.lift_fresh_copy, _aten.sym_size)
    return not isinstance(tensor_meta(node), torch.Tensor)


def _multi_output_parent(node: fx.Node) -> fx.Node | None:
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent = node.args[0]
        if not isinstance(tensor_meta(parent), torch.Tensor):
            return parent
    return None


Plan = dict  # fx.Node -> (CheckpointPolicy, ac_graph_id)


def plan_policy(nodes: list[fx.Node], block_of: dict[fx.Node, str], policy: str, extra_save=frozenset(),
                recompute_modules: tuple[str, ...] = ()) -> Plan:
    """Marks for the "ops" or "full" policy (no graph change yet)."""
    ids = _block_ids(nodes, block_of)
    plan: Plan = {}
    for n in nodes:
        if _multi_output_parent(n) is not None:
            continue  # follows its parent below
        if policy == "full":
            if not block_of.get(n):
                continue  # outside blocks: the partitioner decides
            plan[n] = (RECOMPUTE, ids[n])
        else:
            save = _packet(n) in _SAVE_PACKETS or _packet(n) in extra_save
            if save and recompute_modules and _packet(n) not in extra_save:
                path = module_path_of_node(n)
                save = not any(fnmatch.fnmatchcase(path, g) for g in recompute_modules)
            plan[n] = (MUST_SAVE if save else RECOMPUTE, ids[n])
    _copy_to_getitems(nodes, plan)
    return plan


def refine_free_saves(gm: fx.GraphModule, nodes: list[fx.Node], block_of: dict[fx.Node, str], plan: Plan) -> Plan:
    """Also save values whose saving lowers the saved bytes without adding recompute, or the recompute
    without adding bytes: e.g. the residual ``add`` after ``o_proj``: saved, it makes the matmul output
    dead in the backward and its own recompute disappears. One pass over the candidates (cost model)."""
    ids = _block_ids(nodes, block_of)
    model = _CostModel(gm, nodes, ids)
    saved = {n for n, (p, _) in plan.items() if p is MUST_SAVE and _multi_output_parent(n) is None}
    b0, f0 = model.evaluate(saved)
    for n in nodes:
        if n in saved or n not in plan or _multi_output_parent(n) is not None or _is_view_or_free(n):
            continue
        b, f = model.evaluate(saved | {n})
        if (b < b0 and f <= f0) or (b <= b0 and f < f0):
            saved.add(n)
            b0, f0 = b, f
    return _plan_from_saved(nodes, ids, saved)


def _copy_to_getitems(nodes: list[fx.Node], plan: Plan) -> None:
    for n in nodes:
        parent = _multi_output_parent(n)
        if parent is not None:
            if parent in plan:
                plan[n] = plan[parent]
            else:
                plan.pop(n, None)


def mark_graph(plan: Plan) -> None:
    for n, (policy, gid) in plan.items():
        if n.meta.get("recompute") is MUST_RECOMPUTE:
            # another pass's hard constraint (quantize_linear: a dequantized weight is recomputed from the
            # quantized parameter, never saved) wins over this plan, whichever joint hook ran first
            continue
        n.meta["recompute"] = policy
        n.meta["ac_graph_id"] = gid


# ------------------------------------------------------------------------------------------------------
# measuring: partition a copy of the joint graph and read the saved tensors' metadata
# ------------------------------------------------------------------------------------------------------
def _nbytes(val: torch.Tensor) -> int:
    n = val.numel()
    try:
        n = int(n)
    except Exception:  # symbolic: use the hint
        n = int(getattr(getattr(n, "node", None), "hint", None) or 4096)
    return n * val.element_size()


def _storage_key(val: torch.Tensor):
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:
        return id(val)


def activation_bytes(saved: Iterable[fx.Node], inputs: Iterable[fx.Node] = (), exclude: Iterable = ()) -> int:
    """Bytes of the saved tensors, each storage once, leaving out storages of graph inputs (parameters and
    batch tensors are alive anyway) and the storages in ``exclude``."""
    exclude = set(exclude) | {_storage_key(v) for v in (tensor_meta(n) for n in inputs) if isinstance(v, torch.Tensor)}
    sizes: dict[Any, int] = {}
    for n in saved:
        v = tensor_meta(n)
        if not isinstance(v, torch.Tensor):
            continue
        key = _storage_key(v)
        if key in exclude:
            continue
        try:
            size = int(v.untyped_storage().nbytes())
        except Exception:
            size = _nbytes(v)
        sizes[key] = max(sizes.get(key, 0), size)
    return sum(sizes.values())


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node: torch's flop formulas for matmuls/convs/attention; one per output element for
    other compute ops; zero for views. A ``run_with_rng_state(state, op, *args)`` node (a random op the
    partitioner replays in the backward) counts as its op."""
    if node.op != "call_function":
        return 0
    target, args = node.target, node.args
    if "run_with_rng_state" in str(getattr(target, "__name__", target)) and len(args) >= 2:
        target, args = args[1], args[2:]
    return _op_flops(target, args, node.kwargs, tensor_meta(node))


def _op_flops(target, args, kwargs, out) -> int:
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    if target is operator.getitem or (isinstance(target, torch._ops.OpOverload) and (
            target.is_view or packet in (_aten.detach, _aten.alias, _aten.lift_fresh_copy, _aten.sym_size))):
        return 0
    from torch.utils.flop_counter import flop_registry
    import torch.utils._pytree as pytree

    metas = pytree.tree_map(lambda a: tensor_meta(a) if isinstance(a, fx.Node) else a, (args, kwargs))
    fn = flop_registry.get(packet)
    if fn is not None:
        try:
            return int(fn(*metas[0], **metas[1], out_val=out))
        except Exception:
            pass
    if packet in _SAVE_PACKETS and "attention" in str(packet):
        flops = _attention_flops(metas[0])  # e.g. the CPU flash op, which torch's flop counter lacks
        if flops is not None:
            return flops
    vals = out if isinstance(out, (list, tuple)) else [out]
    return sum(_nbytes(v) // max(v.element_size(), 1) for v in vals if isinstance(v, torch.Tensor))


def _attention_flops(args) -> int | None:
    """``q @ k^T`` and ``p @ v`` of an attention op from its (B, H, S, D) q/k/v arguments (GQA: k/v may
    have fewer heads; the kernel broadcasts them)."""
    qkv = list(args[:3])
    if len(qkv) < 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv):
        return None
    (b, hq, sq, d), (_, _, sk, _), (_, _, _, dv) = (tuple(int(x) for x in t.shape) for t in qkv)
    return 2 * b * hq * sq * sk * (d + dv)


def _copy_gm(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, env, return_output_node=True)
    out_val, out_node = out if isinstance(out, tuple) else (out, None)
    new_out = g.output(out_val)
    if out_node is not None:
        new_out.meta = dict(out_node.meta)
    for old, new in env.items():
        new.meta = dict(old.meta)
    g._codegen = gm.graph._codegen
    return fx.GraphModule(gm, g), env


def partition_stats(gm: fx.GraphModule, num_fwd_outputs: int | None = None, *, plan: Plan | None = None,
                    memory_budget: float | None = None, clear_marks: bool = False) -> dict[str, Any]:
    """Partition a copy of the joint graph ``gm`` as AOTAutograd would and measure it.

    ``plan`` marks the copy first; ``clear_marks`` removes existing marks; ``memory_budget`` runs torch's
    own ``activation_memory_budget``. Returns ``saved_bytes`` (activations only), ``saved_tensors``,
    ``recompute_flops`` (forward ops the backward recomputes) and ``recomputed`` (their names).
    """
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if num_fwd_outputs is None:
        num_fwd_outputs = num_forward_outputs(gm)
    copy, env = _copy_gm(gm)
    if clear_marks:
        for n in copy.graph.nodes:
            n.meta.pop("recompute", None)
            n.meta.pop("ac_graph_id", None)
            n.meta.pop("memory_budget", None)
    if plan:
        mark_graph({env[n]: p for n, p in plan.items()})
    fwd_names = {n.name: n for n in forward_nodes(copy.graph) if n.op == "call_function"}
    patches = {} if memory_budget is None else {"activation_memory_budget": memory_budget}
    with fconfig.patch(patches):
        _fw, bw = min_cut_rematerialization_partition(copy, None, num_fwd_outputs=num_fwd_outputs)
    saved = [n for n in bw.graph.find_nodes(op="placeholder") if not is_tangent(n)]
    inputs = [n for n in copy.graph.find_nodes(op="placeholder")]
    recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in fwd_names]
    replayed = [n for n in bw.graph.nodes if n.op == "call_function" and "run_with_rng_state" in str(n.target)]
    return {
        "saved": [n.name for n in saved if isinstance(tensor_meta(n), torch.Tensor) and not is_primal(n)],
        # recomputed random ops are replayed from their saved RNG state (functionalized by the partitioner)
        "recomputed_rng_ops": sum(1 for n in recomputed if _is_random(fwd_names[n.name])) + sum(
            1 for n in bw.graph.nodes if n.op == "call_function" and "run_with_rng_state" in str(n.target)),
        "saved_bytes": activation_bytes(saved, inputs),
        "saved_tensors": sum(1 for n in saved if isinstance(tensor_meta(n), torch.Tensor) and not is_primal(n)),
        "recompute_flops": sum(node_flops(n) for n in recomputed + replayed),
        "recomputed": [n.name for n in recomputed],
    }


# ------------------------------------------------------------------------------------------------------
# the budget: from "full", save values greedily by recompute FLOPs avoided per byte
# ------------------------------------------------------------------------------------------------------
class _CostModel:
    """A fast model of the partition for given marks: which forward values the backward needs, which of
    them are recomputed (and their FLOPs) and which are saved (and their bytes)."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node], ids: dict[fx.Node, int]):
        fwd = forward_nodes(gm.graph)
        self.fwd = set(fwd)
        self.scope = set(nodes)
        self.ids = ids
        self.inputs = {n for n in fwd if n.op == "placeholder"}
        self.input_storages = {_storage_key(tensor_meta(n)) for n in self.inputs
                               if isinstance(tensor_meta(n), torch.Tensor)}
        self.flops = {n: node_flops(n) for n in nodes}
        self.needed = set()  # forward values used directly by backward nodes
        for n in gm.graph.nodes:
            if n.op != "output" and n not in self.fwd:
                self.needed.update(a for a in n.all_input_nodes if a in self.fwd)
        # values crossing a block boundary are saved by the partitioner (cleanup_recompute_tags)
        self.boundary = {n for n in nodes if any(u in self.scope and ids.get(u, 0) > ids[n] for u in n.users)}

    def size(self, n: fx.Node) -> int:
        v = tensor_meta(n)
        if not isinstance(v, torch.Tensor) or _storage_key(v) in self.input_storages:
            return 0
        return _nbytes(v)

    def evaluate(self, saved: set[fx.Node]) -> tuple[int, int]:
        """(saved bytes, recompute FLOPs) when ``saved`` (plus boundaries) are saved, the rest of the
        scope recomputed."""
        stored: set[fx.Node] = set()
        recomputed: set[fx.Node] = set()
        stack = list(self.needed)
        visited: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            if n in visited:
                continue
            visited.add(n)
            parent = _multi_output_parent(n)
            owner = parent if parent is not None else n
            if owner not in self.scope or owner in saved or owner in self.boundary:
                if n.op != "placeholder":
                    stored.add(n)
                continue
            if owner is not n and owner not in recomputed:
                recomputed.add(owner)
                stack.extend(owner.all_input_nodes)
            recomputed.add(n)
            stack.extend(n.all_input_nodes)
        return sum(self.size(n) for n in stored), sum(self.flops.get(n, 0) for n in recomputed)


@dataclass(frozen=True)
class TorchBudget:
    """A budget plan that is torch's own ``activation_memory_budget`` knapsack at ``fraction``: applied by
    ``node.meta["memory_budget"]`` on the joint graph (the partitioner's per-graph override), no marks."""

    fraction: float


def plan_budget(gm: fx.GraphModule, nodes: list[fx.Node], block_of: dict[fx.Node, str], budget_bytes: int,
                num_fwd: int, extra_save=frozenset(), before_bytes: int | None = None, *,
                allow_torch: bool = True) -> tuple[Plan | TorchBudget, bool, dict]:
    """Marks that keep saved activations under ``budget_bytes`` with the fewest recompute FLOPs found, and
    whether the budget is met. Every candidate plan is checked by partitioning a copy of the graph:

    1. per block (block outputs always saved, so recompute never reaches into an earlier block): from
       "full", save values greedily by recompute FLOPs avoided per byte;
    2. torch's own ``activation_memory_budget`` knapsack at the largest fraction whose saved bytes fit
       (bisection), taken as it is (a :class:`TorchBudget` plan: the partitioner reruns torch's solver,
       so its choice is reproduced exactly) and, as marks, improved: values it saves that avoid little
       recompute per byte are dropped, then the freed bytes are filled greedily.

    The plan with the fewest recompute FLOPs under the budget wins, so effpass never recomputes more than
    torch's knapsack at the bytes that knapsack reaches; when none fits, the one with the fewest bytes.
    ``allow_torch=False`` (a ``targets`` scope: torch's solver is global) leaves out torch's plan itself.
    Returns (plan, budget met, the plan's partition statistics).
    """
    ids = _block_ids(nodes, block_of)
    extra = {n for n in nodes if _packet(n) in extra_save}
    plans: list[tuple[Plan | TorchBudget, dict]] = []

    def check(plan: Plan) -> dict:
        plans.append((plan, partition_stats(gm, num_fwd, plan=plan)))
        return plans[-1][1]

    # 1. per-block greedy
    model = _CostModel(gm, nodes, ids)
    cands = [n for n in nodes if _multi_output_parent(n) is None and not _is_view_or_free(n)
             and n not in model.boundary]
    target = budget_bytes
    for _ in range(3):
        real = check(_plan_from_saved(nodes, ids, _greedy(model, cands, extra & set(cands), target)))["saved_bytes"]
        if real <= budget_bytes:
            break
        target -= real - budget_bytes  # the model was optimistic: aim lower by the overshoot

    # 2. torch's knapsack (one region: no forced block boundaries, as torch has none)
    flat = {n: 1 for n in nodes}
    model = _CostModel(gm, nodes, flat)
    cands = [n for n in nodes if _multi_output_parent(n) is None and not _is_view_or_free(n)]
    if plans[-1][1]["saved_bytes"] > budget_bytes:  # below the per-block floor: recompute across blocks
        check(_plan_from_saved(nodes, flat, _greedy(model, cands, extra & set(cands), budget_bytes)))
    found = _torch_seed(gm, num_fwd, budget_bytes, set(nodes), before_bytes)
    if found is not None:
        seed, frac, st = found
        if allow_torch and not extra:
            plans.append((TorchBudget(frac), st))
        seed = (seed & set(cands)) | (extra & set(cands))
        target = budget_bytes
        for _ in range(2):
            kept = _trim(model, seed, target)
            real = check(_plan_from_saved(nodes, flat, _greedy(model, cands, kept, target)))["saved_bytes"]
            if real <= budget_bytes:
                break
            target -= real - budget_bytes

    fits = [(st["recompute_flops"], st["saved_bytes"], i) for i, (_, st) in enumerate(plans)
            if st["saved_bytes"] <= budget_bytes]
    if fits:
        plan, st = plans[min(fits)[2]]
        return plan, True, st
    i = min((st["saved_bytes"], i) for i, (_, st) in enumerate(plans))[1]
    return plans[i][0], False, plans[i][1]


def _trim(model: "_CostModel", saved: set[fx.Node], budget: int) -> set[fx.Node]:
    """Drop saved values, least recompute avoided per byte first, until the cost model is under ``budget``
    with room to spare for refilling: every value whose saving avoids less than the median FLOPs per
    byte goes, the others stay."""
    saved = set(saved)
    b0, f0 = model.evaluate(saved)
    ratios = []
    for n in saved:
        b, f = model.evaluate(saved - {n})
        ratios.append(((f - f0) / max(b0 - b, 1), n))
    if not ratios:
        return saved
    ratios.sort(key=lambda r: r[0])
    median = ratios[len(ratios) // 2][0]
    out = {n for r, n in ratios if r >= median}
    while ratios and model.evaluate(out)[0] > budget:  # still too big: drop from the cheapest kept
        r, n = ratios.pop(0)
        out.discard(n)
    return out


def _plan_from_saved(nodes: list[fx.Node], ids: dict[fx.Node, int], saved: set[fx.Node]) -> Plan:
    plan = {n: (MUST_SAVE if n in saved else RECOMPUTE, ids[n]) for n in nodes if _multi_output_parent(n) is None}
    # NOTE(partitioner): MUST_SAVE on a view is not honoured (views are never banned from recompute), so
    # a saved view would drag its recomputable base into the backward: save the base it views instead.
    for n in list(plan):
        if plan[n][0] is MUST_SAVE and _is_view(n):
            base = n.args[0]
            while isinstance(base, fx.Node) and base in plan and _is_view(base):
                base = base.args[0]
            if isinstance(base, fx.Node) and base in plan:
                plan[base] = (MUST_SAVE, plan[base][1])
    _copy_to_getitems(nodes, plan)
    return plan


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _torch_seed(gm: fx.GraphModule, num_fwd: int, budget_bytes: int, scope: set[fx.Node],
                before_bytes: int | None) -> tuple[set[fx.Node], float, dict] | None:
    """The values torch's ``activation_memory_budget`` knapsack saves at the largest fraction whose saved
    bytes fit, that fraction and its partition statistics.

    torch's budget is a fraction between "save only inputs" and "no checkpointing": start from the
    fraction a linear model predicts, then bisect (at most eight partitions with a min-cut)."""
    by_name = {n.name: n for n in scope}
    # torch's fraction f saves about floor + f * (before - floor) bytes; f = 0 costs no min-cut
    floor = partition_stats(gm, num_fwd, memory_budget=0.0, clear_marks=True)
    if floor["saved_bytes"] > budget_bytes:
        return None
    lo, hi, best = 0.0, 1.0, floor
    span = max((before_bytes or 0) - floor["saved_bytes"], 1)
    frac = min(max((budget_bytes - floor["saved_bytes"]) / span, 0.0), 1.0)
    for _ in range(8):
        st = partition_stats(gm, num_fwd, memory_budget=frac, clear_marks=True)
        if st["saved_bytes"] <= budget_bytes:
            best, lo = st, frac
            if st["saved_bytes"] == budget_bytes:
                break
        else:
            hi = frac
        frac = (lo + hi) / 2
    seed = set()
    for name in best["saved"]:
        n = by_name.get(name)
        while n is not None and _is_view(n) and isinstance(n.args[0], fx.Node):
            n = n.args[0]  # a saved view: save what it views
        if n is not None and n in scope:
            seed.add(_multi_output_parent(n) or n)  # a saved getitem: save its op
    return seed, lo, best


def _greedy(model: _CostModel, candidates: list[fx.Node], forced: set[fx.Node], budget: int) -> set[fx.Node]:
    """Lazy greedy: take the candidate avoiding most recompute FLOPs per saved byte while under budget
    (a gain computed in an earlier round is an upper bound and is refreshed before it is taken)."""
    import heapq

    saved = set(forced)
    bytes_now, flops_now = model.evaluate(saved)
    heap = [(-math.inf, i, -1) for i, n in enumerate(candidates) if n not in saved]
    heapq.heapify(heap)
    rnd = 0
    cache: dict[int, tuple[int, int]] = {}
    cache_put = cache.__setitem__
    while heap:
        _neg, i, when = heapq.heappop(heap)
        n = candidates[i]
        b, f = model.evaluate(saved | {n}) if when != rnd else cache[i]
        if b > budget:
            continue  # does not fit now, and saved bytes only grow
        df, db = flops_now - f, b - bytes_now
        if df <= 0:
            continue  # saving it avoids no recompute
        if when != rnd:
            cache_put(i, (b, f))
            heapq.heappush(heap, (-df / max(db, 1), i, rnd))
            continue
        saved.add(n)
        bytes_now, flops_now = b, f
        rnd += 1
    return saved
