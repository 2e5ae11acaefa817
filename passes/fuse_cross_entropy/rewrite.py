"""The row-wise rewrite of ``fuse_cross_entropy``: a region of the graph (``_fuse_ce_region.find_regions``: whatever is
computed row by row from one or two heads' logits: entropy, KL / JSD between a student and a teacher, z-loss) becomes
one ``effpass::linear_rowwise`` op on the heads' rows, its columns reshaped to the per-row values they replace.
Called by the pass with its options (``chunk_bytes``, ``keep_logits``); shares the head helpers of ``heads.py``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from effpass.graph import is_static, size_hint

from .heads import (check_head, compute_dtype, count_head, drop_logits, emit_head, logits_readers, node_caller,
                    set_meta_or_skip)
from .kernels import default_chunk_bytes
from .matching import Skip, _val, erase_unused
from .region import Region, build_row_fn
from .rowwise import register_row_fn, rowwise_rows


def _grad_enabled_at(graph: fx.Graph, node: fx.Node) -> bool:
    """Whether gradients are enabled where ``node`` runs (``torch.no_grad`` regions appear in torch IR as
    ``torch._C._set_grad_enabled`` calls; the graph starts with them enabled)."""
    on = True
    for n in graph.nodes:
        if n is node:
            return on
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled and n.args:
            on = bool(n.args[0])
    return on


def _needs_grad(n: fx.Node) -> bool:
    v = _val(n)
    return bool(isinstance(v, torch.Tensor) and v.requires_grad)


def rewrite_region(graph: fx.Graph, region: Region, ctx, stats: dict, *, chunk_bytes: int, keep_logits: bool,
                   budget_rows: int = 0) -> None:
    """A region (``region.find_regions``) -> ``effpass::linear_rowwise`` on the heads' rows, its columns
    reshaped to the per-row values they replace; reductions of everything become sums of the row sums.
    ``chunk_bytes`` and ``keep_logits``: the pass's options of those names."""
    gm, what = build_row_fn(region)
    inside = set(region.members) | set(region.entries)
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for kind, n in what for u in ([u for u in n.users if u not in inside] if kind == "node"
                                               else [n])]
    anchor = min(readers, key=order.get)
    if len(region.sites) == 2 and region.sites[0].proj is region.sites[1].proj:
        raise Skip("both inputs of the row-wise computation come from the same projection")
    heads = []
    for site in region.sites:
        vocab, width = check_head(site)
        heads.append((vocab, width))
    n_rows = 1
    for d in region.leading:
        n_rows *= d   # a SymInt for a dynamic (packed) length: never int() it (a guard would specialise the graph)
    symbolic = not isinstance(n_rows, int)
    if symbolic and sum(not isinstance(d, int) for d in region.leading) > 1:
        raise Skip(f"the logits' rows {tuple(region.leading)} have more than one symbolic dim (the per-row "
                   "results could not be reshaped without baking a size into the graph)")
    inputs = ([s.h for s in region.sites] + [s.weight for s in region.sites] + list(region.externals)
              + [s.bias for s in region.sites if isinstance(s.bias, fx.Node)]
              + [x for s in region.sites if s.lora is not None for x in s.lora[:2]])
    late = [i for i in inputs if isinstance(i, fx.Node) and order[i] >= order[anchor]]
    if late:
        raise Skip(f"{late[0].name} is computed after {anchor.name}, which reads the row-wise result")
    grad_on = _grad_enabled_at(graph, anchor)
    needs = [_needs_grad(n if kind == "node" else n) for kind, n in what]
    if any(needs) and not grad_on:
        raise Skip(f"the row-wise result needs a gradient but {anchor.name} runs without gradients")
    computes = {compute_dtype(graph, s) for s in region.sites}
    if len(computes) != 1:
        raise Skip("the two heads run their matmuls in different dtypes (autocast)")
    compute = computes.pop()
    hv = _val(region.sites[0].h)
    vocab = region.vocab
    rows_b, hb = size_hint(n_rows), size_hint(hv.numel()) * hv.element_size()
    if budget_rows and not symbolic:  # pinned (the pass's budget_rows): as for that many rows
        rows_b, hb = budget_rows, hb // max(rows_b, 1) * budget_rows
    stat_budget = chunk_bytes or default_chunk_bytes(rows_b, vocab, hb)
    # a symbolic row count leaves the default budget to run time (0: the op computes it from each call's rows)
    budget = stat_budget if not symbolic else chunk_bytes
    consumed = set(region.members) | {u for kind, u in what if kind == "split"}
    reads = [logits_readers(s, consumed) for s in region.sites]
    new: list[fx.Node] = []
    call = node_caller(graph, new)
    with graph.inserting_before(anchor):
        args, weights = [], []
        for site, (v, width) in zip(region.sites, heads):
            x, weight, x2, w2 = emit_head(graph, site, call, new, v, width)
            args += [x, weight, site.bias, x2, w2]
            weights.append(weight)
        args += [None] * (10 - len(args))
        ext = []
        for e in region.externals:
            tail = tuple(_val(e).shape[len(region.leading):])
            ext.append(call(torch.reshape, e, (-1,) + tail))
        t = [[s.pre, 1.0 if s.softcap else 0.0, s.post] for s in region.sites] + [[1.0, 0.0, 1.0]]
        key = register_row_fn(gm)
        # what needs a gradient (the graph's own flags: a frozen teacher, a frozen or quantized head have none)
        grad_mask = []
        for site in region.sites:
            lora = site.lora if site.lora is not None else (None, None, 1.0)
            grad_mask += [_needs_grad(site.h), _needs_grad(site.weight),
                          isinstance(site.bias, fx.Node) and _needs_grad(site.bias),
                          lora[0] is not None and _needs_grad(lora[0]), lora[1] is not None and _needs_grad(lora[1])]
        grad_mask += [False] * (10 - len(grad_mask))
        if grad_on and any(needs) and any(grad_mask):
            # the gradients computed in the forward (the backward scales them): no second pass over the logits
            both = call(torch.ops.effpass.linear_rowwise_train.default, *args, ext, key, t[0], t[1], budget,
                        compute, len(what), grad_mask, list(needs))
            res = call(operator.getitem, both, 0)
            stats["rowwise_grad_in_forward"] += 1
        else:
            res = call(torch.ops.effpass.linear_rowwise.default, *args, ext, key, t[0], t[1], budget, compute,
                       len(what))
        outs = []
        for j, ((kind, n), need) in enumerate(zip(what, needs)):
            col = call(operator.getitem, res, (slice(None), j))
            if kind == "node":
                v = _val(n)
                # the one symbolic dim (a packed length) is -1: the column holds exactly its rows
                col = call(torch.reshape, col, tuple(int(d) if isinstance(d, int) else -1 for d in v.shape))
            else:
                src, u, how = next(s for s in region.splits if s[1] is n)
                sv = _val(src)
                if not symbolic:
                    col = call(torch.sum, col)
                    if how in ("mean", "kl_mean"):
                        col = call(operator.truediv, col, float(sv.numel()))
                    elif how == "kl_batchmean":
                        col = call(operator.truediv, col, float(sv.shape[0]))
                elif how in ("mean", "kl_mean"):   # sum / (rows * V) = mean over the rows / V
                    col = call(operator.truediv, call(torch.mean, col), float(vocab))
                elif how == "kl_batchmean":       # sum / dim 0 = mean over the rows * the other leading dims
                    if not isinstance(sv.shape[0], int) and is_static(region.leading[1:]):
                        other = 1
                        for d in region.leading[1:]:
                            other *= int(d)
                        col = call(torch.mean, col)
                        col = call(operator.mul, col, float(other)) if other != 1 else col
                    elif isinstance(sv.shape[0], int):
                        col = call(operator.truediv, call(torch.sum, col), float(sv.shape[0]))
                    else:
                        raise Skip(f"{u.name} divides by a symbolic batch size")
                else:
                    col = call(torch.sum, col)
                v = _val(n)
            if v.dtype != torch.float32:
                col = call(torch.Tensor.to, col, v.dtype)
            if not need and grad_on:
                col = call(torch.Tensor.detach, col)
            outs.append(col)
    set_meta_or_skip(graph, new, anchor, args[0], (n_rows, heads[0][1]))
    for (kind, n), col in zip(what, outs):
        if kind == "node":
            n.replace_all_uses_with(col, delete_user_cb=lambda u: u not in inside)
        else:
            n.replace_all_uses_with(col)
            graph.erase_node(n)
    erase_unused(graph, list(reversed(region.members)))
    rows = size_hint(n_rows)
    for site, (chain_set, returned, used_elsewhere), weight in zip(region.sites, reads, weights):
        keep = bool(used_elsewhere) or keep_logits
        dropped = drop_logits(graph, site, chain_set, returned, keep)
        stats["logits_bytes_avoided"] += 0 if keep else rows * vocab * 4
        stats["logits_returned"] += int(bool(returned) and keep)
        stats["logits_dropped"] += int(dropped)
        count_head(stats, site, weight, compute)
    stats["rowwise_sites"] += 1
    stats["two_head_sites"] += int(len(region.sites) == 2)
    stats["rowwise_outputs"] += len(what)
    stats["chunks"] += -(-rows // rowwise_rows(rows, vocab, len(region.sites), stat_budget))
    stats["chunk_bytes"] = stat_budget
    stats["symbolic_rows"] += int(symbolic)
