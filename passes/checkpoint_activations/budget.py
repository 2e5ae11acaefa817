"""``checkpoint_activations``'s memory budget: from "full", save values greedily by recompute FLOPs avoided per byte
(a cost model of the partition, :class:`_CostModel`), seeded by torch's own knapsack where that is better; and
the "ops" policy's free saves (:func:`refine_free_saves`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from effpass.graph import forward_nodes, tensor_meta

from .measure import _nbytes, _storage_key, node_flops, partition_stats
from .plan import (MUST_SAVE, is_opaque, RECOMPUTE, Plan, _block_ids, _copy_to_getitems, _is_view_or_free,
                               _multi_output_parent, _packet)


def refine_free_saves(gm: fx.GraphModule, nodes: list[fx.Node], block_of: dict[fx.Node, str], plan: Plan) -> Plan:
    """Also save values whose saving lowers the saved bytes without adding recompute, or the recompute
    without adding bytes: e.g. the residual ``add`` after ``o_proj``: saved, it makes the matmul output
    dead in the backward and its own recompute disappears. One pass over the candidates (cost model)."""
    ids = _block_ids(nodes, block_of)
    model = _CostModel(gm, nodes, ids)
    saved = {n for n, (p, _) in plan.items() if p is MUST_SAVE and _multi_output_parent(n) is None}
    b0, f0, recomputed = model.walk(saved)
    for n in nodes:
        if n in saved or n not in plan or _multi_output_parent(n) is not None or _is_view_or_free(n):
            continue
        if n not in recomputed:
            # the walk never recomputes n, so saving it changes no decision of the walk: the same bytes and
            # FLOPs (what evaluate(saved | {n}) returns), never an improvement
            continue
        b, f, rec = model.walk(saved | {n})
        if (b < b0 and f <= f0) or (b <= b0 and f < f0):
            saved.add(n)
            b0, f0, recomputed = b, f, rec
    return _plan_from_saved(nodes, ids, saved)



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
        b, f, _ = self.walk(saved)
        return b, f

    def walk(self, saved: set[fx.Node]) -> tuple[int, int, set[fx.Node]]:
        """:meth:`evaluate` and the set of values the backward recomputes. Saving a value outside that set
        changes nothing (the walk's only use of ``saved`` is on values it would otherwise recompute)."""
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
        return sum(self.size(n) for n in stored), sum(self.flops.get(n, 0) for n in recomputed), recomputed


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
    plan = {n: (MUST_SAVE if n in saved or is_opaque(n) else RECOMPUTE, ids[n])
            for n in nodes if _multi_output_parent(n) is None}
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
