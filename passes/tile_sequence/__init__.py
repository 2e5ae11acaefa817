"""``tile_sequence``: position-wise regions (MLP blocks, norms, linear + activation chains) computed in
sequence tiles, and recomputed tile by tile in the backward.

What it does
    In the torch-IR graph it finds **row-wise regions**: connected sets of ops each of whose output rows
    depend only on the same rows of its inputs (a "row" is one position: every leading index of a
    ``(*lead, features)`` tensor). Each region that widens its features (an MLP's ``intermediate``) is
    rewritten to run once per tile of rows: its row inputs are sliced along the sequence dimension, the
    region's ops copied per tile, and the tile outputs concatenated. The copied nodes carry
    ``meta["custom"]["effpass_tile"]``; in the joint graph they are marked ``PREFER_RECOMPUTE`` (tile
    outputs that nothing else marks are saved), so the partitioner saves only the region's inputs and
    outputs and the backward, ordered as autograd would run it, recomputes one tile just before its
    gradient is taken: the region's intermediates never exist for the whole sequence, in the forward or
    the backward (Arctic Long Sequence Training's "TiledMLP", found in an unmodified model's graph).

What counts as row-wise (the proof, per node; anything else ends a region)
    A value is a *row tensor* of lead shape ``L`` when its shape is ``L + (f,)``. A node is row-wise when
    its output is a row tensor and

    * it is pointwise (arithmetic, activations, casts, ``pow``/``rsqrt``/...) and every tensor operand is
      a row tensor of the same ``L`` or broadcasts along every lead dimension (size 1 or absent there:
      a norm's weight, a scalar tensor);
    * it reduces over the last dimension only with ``keepdim=True`` (``mean``/``sum``/``amax``/``var``),
      or normalises over it (``layer_norm``/``rms_norm`` over the last dimension, ``softmax``/
      ``log_softmax`` with ``dim=-1``);
    * it is a ``linear`` / ``matmul`` whose input is a row tensor and whose weight (and bias) do not
      depend on any row tensor.

    Random ops (dropout with ``p > 0`` in training) are not row-wise: tiling would change which random
    numbers each element gets. Views and reshapes end a region (a reshape can mix rows). A region is
    split at transformer-block boundaries (so recompute stays inside a block), "exit" linears (whose only
    users lie outside the region, e.g. q/k/v projections feeding attention) are left untiled, and only
    regions with a linear that widens its features beyond the region's inputs are tiled (elsewhere the
    intermediates are no wider than the inputs and outputs that must exist anyway).

Exactness
    Lossless: every row is computed by the same ops on the same values; only a matmul's blocking over
    rows and the order in which the weight gradients of the tiles are summed change (gradients equal the
    untiled ones within 1e-6 relative in fp32, tested).

Phases
    ``torch_ir`` (rewrite) and ``joint`` (marks for the partitioner, after ``checkpoint_activations``:
    inside a checkpointed block the tiles are recomputed one at a time instead of the whole region).

Statistics
    ``regions`` (tiled), ``tiles`` (total), ``rows``, ``tiled_nodes`` (torch-IR nodes inside tiled
    regions), ``marked_recompute`` / ``marked_save`` (joint nodes), ``weight_nodes_left`` (joint nodes copied
    into a tile that read no row: a weight's dequantization or cast, left to their owner's marks; see
    ``passes/tile_sequence/marks.py``), ``skipped`` with reasons.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

import effpass
from effpass.pass_base import TILE_META
from effpass.graph import copy_provenance, infer_fake_values, module_path_of_node, tensor_meta
from effpass.scope import glob_match

from .cuts import _tile_bounds, _without_early_outputs  # noqa: F401  (_tile_bounds: tests read it here)

__all__ = ["TileSequence", "find_row_regions"]

TAG = TILE_META  # the core contract: the planner reads the tiles by it (effpass/pass_base.py)


@dataclass(frozen=True)
class TiledRegions(effpass.Note):
    """Left by the torch-IR hook for the joint hook of the same graph: how many regions were tiled."""

    count: int

# ------------------------------------------------------------------------------------------------------
# what is row-wise
# ------------------------------------------------------------------------------------------------------
_POINTWISE_FNS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.square, torch.clamp, torch.erf, torch.log,
    torch.reciprocal, torch.where,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus, F.leaky_relu, F.mish, F.elu, F.hardswish, F.relu6,
    torch._C._nn.gelu, torch._C._nn.silu,
}
_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "relu", "abs",
    "square", "clamp", "reciprocal", "float", "half", "bfloat16", "to", "type_as", "contiguous", "log",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__",
}
_REDUCE = {"mean", "sum", "amax", "var", "max_keepdim"}
_LINEAR_FNS = {F.linear, torch._C._nn.linear, torch.matmul, operator.matmul}
_NORM_FNS = {F.layer_norm, F.rms_norm, torch.layer_norm}
_SOFTMAX_FNS = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}


def _is_linear(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _LINEAR_FNS


def _shape(v) -> tuple | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _row_lead(n: fx.Node, lead: tuple) -> bool:
    """Whether ``n``'s value is a row tensor of lead shape ``lead``."""
    s = _shape(tensor_meta(n))
    return s is not None and len(s) == len(lead) + 1 and s[:-1] == lead


def _broadcasts_over_rows(v, lead: tuple) -> bool:
    """A tensor operand of a pointwise op that is the same for every row: size 1 (or absent) at every
    lead dimension once right-aligned with an ``L + (f,)`` output."""
    if not isinstance(v, torch.Tensor):
        return True
    s = tuple(v.shape)
    r = len(lead) + 1
    if len(s) > r:
        return False
    s = (1,) * (r - len(s)) + s
    return all(d == 1 for d in s[:-1])


def _dim_is_last(dim, rank: int) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _dim_is_last(dim[0], rank)
    return isinstance(dim, int) and (dim == -1 or dim == rank - 1)


def _tensor_args(n: fx.Node):
    return [a for a in n.all_input_nodes if isinstance(tensor_meta(a), torch.Tensor)]


def row_wise_reason(n: fx.Node, lead: tuple) -> str | None:
    """None when ``n`` is row-wise for lead shape ``lead`` (see the module docstring), else why not.
    Operands are checked by the caller: here, what the op itself does."""
    if n.op not in ("call_function", "call_method"):
        return "not an op"
    if _is_feature_split(n, lead):  # chunk/split of the features: a tuple of row tensors
        return None
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
            and _is_feature_split(n.args[0], lead) and isinstance(n.args[1], int):
        return None
    if not _row_lead(n, lead):
        return "output is not a row tensor"
    rank = len(lead) + 1
    t = n.target
    if n.op == "call_function" and t in _LINEAR_FNS:
        x, w = (list(n.args) + [None, None])[:2]
        if not (isinstance(x, fx.Node) and _row_lead(x, lead)):
            return "linear input is not a row tensor"
        ws = _shape(tensor_meta(w)) if isinstance(w, fx.Node) else None
        if ws is None or len(ws) != 2:
            return "linear weight is not a 2-D tensor"
        return None
    if n.op == "call_function" and t in _NORM_FNS:
        shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        if isinstance(shape, int):
            shape = (shape,)
        if not (isinstance(shape, (list, tuple)) and len(shape) == 1):
            return "normalises over more than the last dimension"
        return None
    if n.op == "call_function" and t in _SOFTMAX_FNS:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        return None if _dim_is_last(dim, rank) else "softmax over a lead dimension"
    if n.op == "call_function" and t in (F.dropout, torch.dropout):
        training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        if training is False or p == 0:
            return None
        return "random op (dropout in training): tiling would change its random numbers"
    if n.op == "call_method" and t in _REDUCE:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 and isinstance(n.args[2], bool) else False)
        if _dim_is_last(dim, rank) and keep is True:
            return None
        return f"reduction {t} over a lead dimension or without keepdim"
    if n.op == "call_function" and t in (torch.mean, torch.sum, torch.amax, torch.var):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.kwargs.get("keepdim", False)
        if _dim_is_last(dim, rank) and keep is True:
            return None
        return "reduction over a lead dimension or without keepdim"
    if n.op == "call_function" and t in _POINTWISE_FNS:
        return None
    if n.op == "call_method" and t in _POINTWISE_METHODS:
        if t == "to" and any(isinstance(a, (torch.device, str)) for a in list(n.args[1:]) + [n.kwargs.get("device")]):
            return "moves across devices"
        return None
    name = getattr(t, "__name__", str(t))
    return f"{name} is not known to be row-wise"


def _is_feature_split(n: fx.Node, lead: tuple) -> bool:
    """``x.chunk(k, -1)`` / ``torch.split(x, s, dim=-1)`` of a row tensor (Phi-3's fused gate/up)."""
    is_split = (n.op == "call_method" and n.target in ("chunk", "split")) or (
        n.op == "call_function" and n.target in (torch.chunk, torch.split))
    if not is_split or not (n.args and isinstance(n.args[0], fx.Node) and _row_lead(n.args[0], lead)):
        return False
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return _dim_is_last(dim, len(lead) + 1)


def _operands_ok(n: fx.Node, lead: tuple, member) -> bool:
    """Every tensor operand is a row tensor (member of the region or an outside row input of the same lead
    shape) or is the same for every row. A linear's weight and bias must not be row tensors."""
    args = _tensor_args(n)
    if _is_linear(n):
        x = n.args[0]
        return all(not _row_lead(a, lead) or a is x for a in args) and not any(member(a) for a in args if a is not x)
    if n.op == "call_function" and n.target in _NORM_FNS:
        x = n.args[0]
        return all(a is x or _broadcasts_over_rows(tensor_meta(a), lead) for a in args)
    return all(_row_lead(a, lead) or _broadcasts_over_rows(tensor_meta(a), lead) for a in args)


# ------------------------------------------------------------------------------------------------------
# regions
# ------------------------------------------------------------------------------------------------------
@dataclass
class Region:
    nodes: list[fx.Node]            # in graph order
    lead: tuple
    block: str
    outputs: list[fx.Node] = field(default_factory=list)
    row_inputs: list[fx.Node] = field(default_factory=list)   # outside row tensors: sliced per tile

    @property
    def rows(self) -> int:
        return math.prod(self.lead)


def _block_of(n: fx.Node, blocks: list[str]) -> str:
    path = module_path_of_node(n)
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return b
    return ""


def find_row_regions(gm: fx.GraphModule, model: torch.nn.Module | None = None,
                     min_rows: int = 2) -> tuple[list[Region], list[dict]]:
    """Row-wise regions of a torch-IR graph worth tiling, and the ones left alone with a reason."""
    from effpass.graph import transformer_blocks

    blocks = [p for p, _ in transformer_blocks(model)] if model is not None else []
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # lead shapes of the linears' inputs: the candidate "rows" (batch x sequence of the hidden states)
    leads, skipped = [], []
    for n in nodes:
        if _is_linear(n) and isinstance(n.args[0], fx.Node):
            s = _shape(tensor_meta(n.args[0]))
            if not s or len(s) < 2 or s[:-1] in leads:
                continue
            if all(isinstance(d, int) for d in s):
                leads.append(s[:-1])
            elif not any(d.get("reason", "").startswith("symbolic") for d in skipped):
                # NOTE(dynamic): tiles are cut at fixed offsets; a symbolic length (packed rows marked
                # dynamic) would need a loop over a symbolic count. Left alone, which stays correct.
                skipped.append({"site": n.name, "reason": f"symbolic rows {s[:-1]}: tiles need a fixed length"})
    regions = []
    taken: set[fx.Node] = set()
    for lead in leads:
        if math.prod(lead) < min_rows:
            skipped.append({"site": f"rows {list(lead)}", "reason": f"{math.prod(lead)} rows: fewer than "
                            f"{min_rows} (two tiles)"})
            continue
        rw: set[fx.Node] = set()
        for n in nodes:  # graph order: operands are classified before their users
            if n in taken or row_wise_reason(n, lead) is not None:
                continue
            if n.target is operator.getitem and n.args[0] not in rw:
                continue  # a piece of a split outside the region
            if _operands_ok(n, lead, lambda a: a in rw):
                rw.add(n)
        # exit linears: all users outside the row-wise set (q/k/v projections feeding attention)
        changed = True
        while changed:
            changed = False
            for n in list(rw):
                if _is_linear(n) and all(u not in rw for u in n.users):
                    rw.discard(n)
                    changed = True
        # components, split at block boundaries
        seen: set[fx.Node] = set()
        for n in sorted(rw, key=order.get):
            if n in seen:
                continue
            block = _block_of(n, blocks)
            comp, stack = [], [n]
            seen.add(n)
            while stack:
                m = stack.pop()
                comp.append(m)
                for o in list(m.all_input_nodes) + list(m.users):
                    if o in rw and o not in seen and _block_of(o, blocks) == block:
                        seen.add(o)
                        stack.append(o)
            comp.sort(key=order.get)
            comp = _without_early_outputs(comp, order)
            if not comp:
                continue
            region = Region(nodes=comp, lead=lead, block=block)
            cs = set(comp)
            region.outputs = [m for m in comp if any(u not in cs for u in m.users)]
            if any(not _row_lead(m, lead) for m in region.outputs):  # a split whose pieces leave the region
                skipped.append({"site": f"{block or 'graph'}: {comp[0].name}..{comp[-1].name}",
                                "reason": "an output of the region is not one row tensor"})
                continue
            region.row_inputs = sorted({a for m in comp for a in _tensor_args(m)
                                        if a not in cs and _row_lead(a, lead) and not
                                        (_is_linear(m) and a is not m.args[0])}, key=order.get)
            in_width = max([_shape(tensor_meta(a))[-1] for a in region.row_inputs] or [0])
            widest = max(_shape(tensor_meta(m))[-1] for m in comp if _shape(tensor_meta(m)))
            if not any(_is_linear(m) for m in comp):
                skipped.append({"site": f"{block or 'graph'}: {comp[0].name}..{comp[-1].name}",
                                "reason": "no linear in the region (its intermediates are no wider than its "
                                          "inputs)"})
                continue
            if widest <= in_width:
                skipped.append({"site": f"{block or 'graph'}: {comp[0].name}..{comp[-1].name}",
                                "reason": f"widest intermediate ({widest}) is no wider than the inputs ({in_width})"})
                continue
            regions.append(region)
            taken |= cs
    return regions, skipped


# ------------------------------------------------------------------------------------------------------
# the rewrite
# ------------------------------------------------------------------------------------------------------
def tile_region(gm: fx.GraphModule, region: Region, tile_rows: int, region_id: int,
                replaced: dict[fx.Node, fx.Node] | None = None, cut: str = "even") -> int:
    """Rewrite ``region`` into tiles along its last lead dimension; returns the number of tiles.
    ``replaced`` maps outputs of regions tiled before to their concatenations (updated here)."""
    replaced = {} if replaced is None else replaced
    region.row_inputs = [replaced.get(a, a) for a in region.row_inputs]
    graph = gm.graph
    dim = len(region.lead) - 1
    size = region.lead[dim]
    per_row = math.prod(region.lead[:dim]) or 1
    bounds = _tile_bounds(size, max(1, tile_rows // per_row), cut)
    if len(bounds) < 2:
        return 1
    cs = set(region.nodes)
    last = region.nodes[-1]
    outs: dict[fx.Node, list[fx.Node]] = {o: [] for o in region.outputs}
    new_nodes: list[fx.Node] = []
    if True:
        cursor = [last]
        # NOTE(input gradients): one split per input, not a narrow per tile: the backward of a split is one
        # cat of the tiles' gradients, where narrows would each give a zero-padded gradient of the whole
        # input, summed (several whole-input tensors live at once)
        sizes = [e - s for s, e in bounds]
        splits = {}
        for a in region.row_inputs:
            with graph.inserting_after(cursor[0]):
                sp = graph.call_function(torch.split, (a, sizes), {"dim": dim})
            sp.meta["custom"] = {TAG: region_id, "role": "split"}
            copy_provenance(sp, region.nodes[0])
            cursor[0] = sp
            new_nodes.append(sp)
            splits[a] = sp
        for k, (s, e) in enumerate(bounds):
            env: dict[fx.Node, fx.Node] = {}
            for a in region.row_inputs:
                with graph.inserting_after(cursor[0]):
                    sl = graph.call_function(operator.getitem, (splits[a], k))
                sl.meta["custom"] = {TAG: region_id, "tile": k, "role": "slice"}
                copy_provenance(sl, region.nodes[0])
                cursor[0] = sl
                new_nodes.append(sl)
                env[a] = sl
            for m in region.nodes:
                with graph.inserting_after(cursor[0]):
                    c = graph.node_copy(m, lambda a: env.get(a, a))
                c.meta = {key: v for key, v in m.meta.items() if key not in ("example_value", "val")}
                c.meta["custom"] = {**(m.meta.get("custom") or {}), TAG: region_id, "tile": k}
                cursor[0] = c
                new_nodes.append(c)
                env[m] = c
            for o in region.outputs:
                outs[o].append(env[o])
        for o in region.outputs:
            with graph.inserting_after(cursor[0]):
                cat = graph.call_function(torch.cat, (outs[o],), {"dim": dim})
            copy_provenance(cat, o)
            cat.meta["custom"] = {TAG: region_id, "role": "output"}
            cursor[0] = cat
            new_nodes.append(cat)
            o.replace_all_uses_with(cat, delete_user_cb=lambda u: u not in new_nodes)
            replaced[o] = cat
    for m in reversed(region.nodes):
        if not m.users:
            graph.erase_node(m)
    infer_fake_values(new_nodes)
    return len(bounds)


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("tile_sequence", run_after=("fuse_attention", "apply_autocast", "inject_lora",
                                                   "fuse_cross_entropy", "pack_sequences", "checkpoint_activations"))
@dataclass(frozen=True, kw_only=True)
class TileSequence(effpass.Pass):
    """Row-wise regions (MLP, norms, linear + activation chains) computed in sequence tiles, recomputed
    tile by tile in backward: their intermediates never exist for the whole sequence. Lossless."""

    tile_rows: int = field(default=1024, metadata={
        "doc": "rows (batch x positions) per tile; regions with fewer than two tiles' rows are left alone"})
    cut: Literal["even", "exact"] = field(default="even", metadata={
        "doc": "'even': ceil(rows / tile_rows) tiles of one size; 'exact': tiles of tile_rows, the last the rest, "
               "any region over tile_rows rows tiled (the planner's replays, effpass/planning/tiles.py)"})

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: lossless; position-wise regions (the MLP) in tiles of 4,096 rows (for
        a long sequence one tile's intermediates are small beside the hidden states, and fewer tiles keep
        the graph, and the planner's replay, small); on batches of at most 16,384 tokens also tiles of 1,024
        rows (at 8,192 tokens two tiles of 4,096 leave one tile's MLP intermediates, 4,096 x intermediate,
        at the backward's peak: measured 0.818x the hand-built stack's whole-step peak, bench_long_sequence)."""
        cost = ("position-wise regions recomputed tile by tile in backward (their forward once more where "
                "checkpointing does not recompute them)")
        return [effpass.MemoryOption(technique="tile_sequence", options={"tile_rows": 4096}, lossless=True,
                                     group="sequence_tiling", changes="activations", label="tiles(4096)",
                                     min_rows=2 * 4096,  # regions of fewer than two tiles are left alone
                                     cost=cost),
                effpass.MemoryOption(technique="tile_sequence", options={"tile_rows": 1024}, lossless=True,
                                     group="sequence_tiling", changes="activations", label="tiles(1024)",
                                     min_rows=2 * 1024, max_rows=16384, order=1, cost=cost)]

    def validate(self) -> None:
        if self.tile_rows < 1:
            raise ValueError(f"tile_sequence.tile_rows: {self.tile_rows!r} must be a positive number of rows")

    def pin_length(self, seq: int, batch: int = 1):
        """``effpass.Pass.pin_length``: at ``seq`` positions the tiles are ``t`` positions, the last the rest; the
        exact cut of ``t`` is the same graph there, and at ``seq - k * t`` the same tiles, ``k`` fewer."""
        per_tile = max(1, self.tile_rows // max(1, batch))
        if self.cut == "exact" or seq * batch < 2 * self.tile_rows:
            return self, (per_tile if self.cut == "exact" and seq > per_tile else 0)
        bounds = _tile_bounds(seq, per_tile)
        if len(bounds) < 2:
            return self, 0
        t = bounds[0][1] - bounds[0][0]
        return dataclasses.replace(self, tile_rows=t * batch, cut="exact"), t

    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        # NOTE(exact): an exact cut tiles every region of more than one tile's rows (the planner's short replays
        # keep the tiles of a long sequence: two tiles, the second maybe shorter)
        min_rows = self.tile_rows + 1 if self.cut == "exact" else 2 * self.tile_rows
        regions, skipped = find_row_regions(gm, getattr(ctx, "model", None), min_rows=min_rows)
        if self.targets or self.exclude:
            keep = []
            for r in regions:
                where = r.block or module_path_of_node(r.nodes[0])
                ok = (not self.targets or glob_match(where, self.targets)) and not glob_match(where, self.exclude)
                (keep.append(r) if ok else skipped.append({"site": where, "reason": "outside targets"}))
            regions = keep
        stats = {"regions": 0, "tiles": 0, "rows": 0, "tiled_nodes": 0}
        prev = ctx.read(TiledRegions)
        base = prev.count if prev is not None else 0
        replaced: dict[fx.Node, fx.Node] = {}
        for i, r in enumerate(regions):
            n = tile_region(gm, r, self.tile_rows, base + i, replaced, self.cut)
            if n < 2:
                skipped.append({"site": r.block or r.nodes[0].name, "reason": "fewer than two tiles"})
                continue
            stats["regions"] += 1
            stats["tiles"] += n
            stats["rows"] = max(stats["rows"], r.rows)
            stats["tiled_nodes"] += len(r.nodes)
        if stats["regions"]:
            gm.graph.lint()
            gm.recompile()
            ctx.leave(TiledRegions(count=base + stats["regions"]))
        why = ""
        if not stats["regions"]:
            why = (f"{len(skipped)} region(s) left alone (reasons below; a sequence shorter than two tiles of "
                   f"tile_rows={self.tile_rows} rows is not tiled: lower tile_rows to tile it)" if skipped else
                   "no row-wise region (MLP or loss head over the sequence) found in this graph")
        return effpass.PassResult(changed=bool(stats["regions"]), stats=stats, skipped=skipped, why_unchanged=why)

    def transform_joint(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        if ctx.graph_kind != "joint" or ctx.read(TiledRegions) is None:
            return None
        from .marks import mark_tiles

        return effpass.PassResult(changed=True, stats=mark_tiles(gm, TAG))
