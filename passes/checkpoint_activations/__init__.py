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
    joint graph partitioned on a copy); ``saved_bytes_after``: the same with this pass's marks (read from
    the real partition when no later pass has a joint hook, else a marked copy partitioned);
    ``saved_bytes_measured``: read from the real backward graph's inputs after partitioning;
    ``recompute_flops_before/after`` and ``recompute_flops_added``: FLOPs of forward ops that the
    backward graph recomputes; ``recompute_flops_measured``: the same, counted in the real backward graph; ``marked_save``, ``marked_recompute``, ``blocks``; budget mode adds
    ``budget_bytes`` and ``budget_met``. Activation bytes exclude parameters and graph inputs (they
    are alive anyway) and count a storage once.

Invariants relied on
    Forward nodes of the joint graph carry ``nn_module_stack`` (checked on torch 2.11 and 2.13); a
    multi-output op and its ``getitem`` users get the same policy (the min-cut fails otherwise); random
    ops that are recomputed are replayed with the same random numbers (the partitioner functionalizes
    their RNG state when any is marked for recompute).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx

import effpass
from effpass.graph import forward_nodes, is_primal, is_tangent, tensor_meta

from .budget import TorchBudget, plan_budget, refine_free_saves
from .measure import _storage_key, activation_bytes, node_flops, partition_stats  # noqa: F401
from .plan import (MUST_RECOMPUTE, MUST_SAVE, RECOMPUTE, _is_random, _packet_of_name, find_blocks,  # noqa: F401
                   mark_graph, num_forward_outputs, plan_policy)

__all__ = ["CheckpointActivations", "parse_bytes", "partition_stats", "mark_graph", "find_blocks"]

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
    #: forward op name -> its FLOPs (with detailed statistics only): the post-grad hook counts the ones the
    #: real backward graph recomputes
    forward_flops: dict = field(default_factory=dict)
    #: the unmarked partition's recompute FLOPs when the "after" statistics are read from the real partition
    #: (no later joint hook can change it: see ``transform_joint``); None when a copy was partitioned
    before_recompute_flops: int | None = None
    #: filled by the post-grad hook with the "after" statistics read from the real partition; the joint
    #: record's live statistics (so they stay the joint graph's, counted once)
    after: dict = field(default_factory=dict)
    #: names of the random forward ops (recomputing one replays its RNG state)
    random_ops: frozenset = frozenset()


def _later_joint_hooks(this: effpass.Pass, ctx) -> list[str]:
    """Names of the active passes whose joint hook runs after this pass's on the same graph."""
    names = [p.name for p in ctx.pipeline]
    later = ctx.pipeline[names.index(this.name) + 1:] if this.name in names else ()
    return [p.name for p in later if effpass.Phase.JOINT in type(p).phases()]


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
                                                "for a backward"}],
                                      why_unchanged="an inference graph (no gradient needed): nothing is saved for a "
                                                    "backward, so there is nothing to checkpoint")
        graph = gm.graph
        fwd = forward_nodes(graph)
        in_scope = ctx.scope.select_nodes(gm, [n for n in fwd if n.op == "call_function"], what="forward op")
        if not in_scope:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "no forward node in targets"}],
                                      why_unchanged="no forward op of this graph is in targets/exclude's scope: "
                                                    "widen targets (module-name globs) if this graph should be checkpointed")
        block_of = find_blocks(in_scope, self.targets, ctx.model)
        num_fwd = num_forward_outputs(gm)
        # NOTE(cost): partitioning a copy of the graph costs about as much as the real partition; it is
        # done only where the plan needs it (budget mode) or a dump/report asked for detailed statistics.
        before = partition_stats(gm, num_fwd) if (self.budget is not None or ctx.detailed_stats) else None
        # The marked graph's partition ("after") is the real one AOTAutograd runs next, unless a later joint
        # hook changes the graph first: then only, a marked copy is partitioned here.
        after_from_real = before is not None and self.budget is None and not _later_joint_hooks(self, ctx)
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
        if before is not None and after is None and not after_from_real:
            after = partition_stats(gm, num_fwd)
        blocks = sorted({b for b in block_of.values() if b})
        stats.update(
            marked_save=sum(1 for p in plan.values() if p[0] is MUST_SAVE),
            marked_recompute=sum(1 for p in plan.values() if p[0] is RECOMPUTE),
            blocks=len(blocks),
        )
        if before is not None:
            stats.update(saved_bytes_before=before["saved_bytes"], recompute_flops_before=before["recompute_flops"])
        if after is not None:
            stats.update(
                saved_bytes_after=after["saved_bytes"], recompute_flops_after=after["recompute_flops"],
                recompute_flops_added=after["recompute_flops"] - before["recompute_flops"],
                recomputed_rng_ops=after["recomputed_rng_ops"],
            )
        calls = [n for n in fwd if n.op == "call_function"]
        # the backward graph sees only the inputs it keeps; views of other inputs are not activations either
        marked = CheckpointMarked(
            stats=dict(stats), input_storages=frozenset(
                _storage_key(tensor_meta(n)) for n in graph.find_nodes(op="placeholder")
                if isinstance(tensor_meta(n), torch.Tensor)),
            forward_flops={} if before is None else {n.name: node_flops(n) for n in calls},
            before_recompute_flops=before["recompute_flops"] if after_from_real else None,
            random_ops=frozenset(n.name for n in calls if _is_random(n)) if after_from_real else frozenset())
        ctx.leave(marked)
        changed = bool(plan) or "torch_budget_fraction" in stats
        why = "" if changed else (
            f"no op of this graph was marked: {'no transformer block was found in it' if not blocks else 'the policy'}"
            f" ({self.policy!r} marks per block; blocks are the model's repeated layers, or its numbered children; "
            "name them with targets=[...] if this graph should be checkpointed)")
        return effpass.PassResult(changed=changed, stats=stats, why_unchanged=why,
                                  live_stats=(lambda: dict(marked.after)) if after_from_real else None)

    # -- post-grad phase: measure ------------------------------------------------------------------------
    def transform_post_grad(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        marked = ctx.read(CheckpointMarked)
        if ctx.graph_kind != "backward" or marked is None:
            return None
        saved = [n for n in gm.graph.find_nodes(op="placeholder") if not is_tangent(n)]
        inputs = [n for n in saved if is_primal(n)]
        stats = {"saved_bytes_measured": activation_bytes(saved, inputs, marked.input_storages)}
        if marked.forward_flops:
            # the forward ops this backward graph runs again (names survive partitioning), and random ops it
            # replays from their saved RNG state: what recompute_flops_after predicted
            calls = [n for n in gm.graph.nodes if n.op == "call_function"]
            replayed = [n for n in calls if "run_with_rng_state" in str(n.target)]
            stats["recompute_flops_measured"] = sum(
                marked.forward_flops[n.name] if n.name in marked.forward_flops else node_flops(n)
                for n in calls if n.name in marked.forward_flops or n in replayed)
            if marked.before_recompute_flops is not None:
                # no copy was partitioned: the marked graph's partition is this one (same graph, same partitioner);
                # the joint record shows them (its live statistics)
                marked.after.update(
                    saved_bytes_after=stats["saved_bytes_measured"],
                    recompute_flops_after=stats["recompute_flops_measured"],
                    recompute_flops_added=stats["recompute_flops_measured"] - marked.before_recompute_flops,
                    recomputed_rng_ops=len(replayed) + sum(1 for n in calls if n.name in marked.random_ops))
        return effpass.PassResult(stats=stats)
