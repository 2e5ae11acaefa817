"""``pack_sequences``: packed rows (several examples concatenated in one row) computed correctly, for any model.

What it does
    Padding-free training concatenates examples into one row (``transformers.DataCollatorWithFlattening``,
    TRL's ``padding_free=True``). Each example must then attend only to itself, and its positions must
    restart at 0. Whether Hugging Face keeps the examples apart depends on the attention implementation,
    the cache flag and the family; custom models never do. This pass makes every attention in the graph
    block-diagonal per example (causal attention stays causal inside each example; bidirectional stays
    bidirectional), whatever the model does with the boundaries itself:

    * module phase (:meth:`PackSequences.prepare_module`): refuses models with layers that mix tokens
      across positions other than attention (convolutions over the sequence, recurrent layers), and
      installs a forward pre-hook on the model that reads the boundaries from the call:
      ``position_ids`` that restart at 0, ``cu_seq_lens_q``/``cu_seq_lens_k`` or ``seq_idx`` (what the
      collator returns), derives ``position_ids`` from the other two, checks them in the graph
      (``torch._assert_async``: restarts of ``0..n-1``, examples no longer than the model's maximum; no
      host synchronisation), drops the Python-int ``max_length_q/k`` (each new value would recompile),
      and turns ``use_cache`` off for packed calls (with a cache Hugging Face ignores the boundaries).
      Because the hook is on the eager model, Hugging Face models whose own masking honours the
      boundaries without a cache compute the same function eagerly (reference semantics).
    * torch-IR phase, in every graph Dynamo makes of the model: per-token document ids and per-example
      positions once per graph, from the boundary input (``cumsum(position_ids == 0)``,
      ``searchsorted(cu_seq_lens)`` or ``seq_idx``), or, in a graph without it (after a graph break such as
      OPT's layer-drop check), from the per-call context the hook set (``effpass::pack_context_get``); then

      - every fused attention call (the core's attention-op registry: SDPA, ``masked_sdpa``, what other
        passes register) becomes one whose mask is the original mask AND "same example";
      - every hand-written attention (a ``softmax`` over a ``(..., N, N)`` score matrix) gets
        ``masked_fill(~same, finfo.min)``; a softmax over ``cat([scores, sinks], -1)`` (learned attention
        sinks, N x (N+k)) gets the mask on the score columns only, so every row keeps its sink columns;
      - masks and scalings computed from absolute row positions (``arange(N)``: HF's ``cache_position``,
        chunked local attention, a position-dependent attention temperature) read per-example positions.

    Fail closed: a site that cannot be isolated (lengths other than the packed length, a registered op that
    takes no mask, a position-derived mask with several packed rows that differs per example, an excluded
    site) raises :class:`effpass.WrongResultError` naming the site, the graph and why, in the packed call that
    compiles the graph and in every later packed call (the hook checks); never a warning.

Kernels (``kernel``)
    ``"auto"``/``"varlen"``: on CUDA, fp16/bf16, no dropout and no other mask than causal, torch's varlen
    kernel (``torch.nn.attention.varlen.varlen_attn``, feature-tested; boundaries as ``cu_seqlens`` of fixed
    length ``B*N+1`` so no host sync; untested: no GPU here). Everywhere else SDPA with the block-diagonal
    boolean mask, which on CPU runs the fused flash kernel. Measured on CPU (``docs/passes/pack_sequences.md``):
    ``flex_attention`` and a per-example loop were not faster and the loop needs the boundaries on the host.

Phase ordering: runs after ``fuse_attention`` (so hand-written attention is already an SDPA call) and
before ``apply_autocast`` / ``checkpoint_activations`` (which see the rewritten call).

Dynamic shapes: packed lengths vary every step. The boundary hook runs eagerly (Dynamo skips its frame,
see :func:`run_top_level_frame_eagerly`) and marks the packed length of every per-token input (and the
example count of ``cu_seq_lens_*``) dynamic with ``maybe_mark_dynamic`` before the model's frame is traced,
so the model compiles once, with a symbolic length, and never recompiles for a new length
(``tests/passes/pack_sequences/test_pack_sequences.py`` counts it). Inlined into an outer ``torch.compile`` the hook is traced
instead, and Dynamo's automatic dynamic shapes give one recompile.

Statistics: the hook also counts, on the inputs' device (no host sync), examples, tokens, padding avoided
and the attended pairs per step (:class:`PackingCounters`); the torch-IR phase records each rewritten
site's FLOPs per pair. The module record's ``live_stats`` reads them when a report or dump is asked for.

Invariants: placeholders are never added or removed; every attention site of a graph is rewritten or listed
as unisolated (and a packed call then raises).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx
import torch.nn as nn

import effpass
from effpass.attention import attention_op
from effpass.graph import Skip, annotate_new_nodes, is_softmax, shape_of, site_name

from .hook import (BoundaryHook, max_positions, mixes_tokens, packing_stats,  # noqa: F401
                         run_top_level_frame_eagerly, unisolated_message)
from .matching import (TOKENS_RE, attention_scores, find_boundary, is_sdpa, pair_cost, per_example_positions,
                          same, scores_pair_cost, sdpa_args, varlen_usable)
from .ops import (document_ids, first_row, mask_scores, packed_sdpa, packed_varlen,  # noqa: F401
                        position_ids_from, positions_of, same_document_mask, context_doc)

__all__ = ["PackSequences", "packing_stats", "document_ids", "position_ids_from"]


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("pack_sequences", run_after=("fuse_attention", "inject_lora"))
@dataclass(frozen=True, kw_only=True)
class PackSequences(effpass.Pass):
    """Packed rows: every attention block-diagonal per example, positions restarting per example.

    Before (a packed row, Llama with SDPA; the examples attend to each other)::

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, scale=0.125)

    After::

        doc  = effpass.passes.pack_sequences.document_ids("position_ids", position_ids, N)  # once
        same = same_document_mask(doc, causal=True)                                        # once
        out  = packed_sdpa(q, k, v, same, attn_mask=None, scale=0.125)
    """

    kernel: Literal["auto", "sdpa", "varlen"] = field(default="auto", metadata={
        "doc": "'sdpa': SDPA with the block-diagonal mask (CPU: fused flash kernel); 'varlen': torch's varlen "
               "kernel (torch.nn.attention.varlen, CUDA FlashAttention; untested on GPU) where it applies (CUDA, "
               "fp16/bf16, causal or no mask, no dropout), SDPA elsewhere; 'auto': the same as 'varlen'"})
    require_boundaries: bool = field(default=True, metadata={
        "doc": "a training call without position_ids / cu_seq_lens_* / seq_idx is an error (packed rows "
               "without boundaries would mix examples)"})
    check_inputs: bool = field(default=True, metadata={
        "doc": "check in the graph (torch._assert_async, no host sync) that position_ids restart at 0 and count "
               "up by 1, and that no example is longer than the model's maximum positions"})
    max_positions: int = field(default=0, metadata={
        "doc": "the longest example allowed; 0: the model config's max_position_embeddings / n_positions"})

    def validate(self) -> None:
        if self.max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {self.max_positions}")

    @classmethod
    def default_note(cls) -> str:
        return "off (turn on for packed rows: DataCollatorWithFlattening, TRL padding_free=True)"

    # -- module phase ---------------------------------------------------------------------------------
    def prepare_module(self, model: nn.Module, ctx) -> effpass.PassResult:
        mixing = [(n, why) for n, m in ctx.scope.select_modules(model, lambda n, m: mixes_tokens(m) is not None)
                  for why in [mixes_tokens(m)]]
        if mixing:
            listed = ", ".join(f"{n} ({why})" for n, why in mixing[:6])
            raise ValueError(
                f"pack_sequences: {type(model).__name__} has layers that mix tokens across positions outside "
                f"attention, which would mix the packed examples: {listed}{' ...' if len(mixing) > 6 else ''}. "
                "Train it with padded batches, or exclude these modules if they do not run over the sequence "
                "(exclude=[...])")
        for h in getattr(model, "_effpass_pack_hooks", []):
            h.remove()
        sig = inspect.signature(model.forward)
        params = set(sig.parameters)
        accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        max_pos = self.max_positions or max_positions(model)
        hook = BoundaryHook(params, accepts_kwargs, max_pos, self.require_boundaries, self.check_inputs,
                             type(model).__name__)
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        after = model.register_forward_hook(hook.after_forward, with_kwargs=True)
        model._effpass_pack_hooks = [handle, after]
        model._effpass_pack_counters = hook.stats
        model._effpass_pack_hook = hook
        can_generate = getattr(model, "can_generate", None)
        hook.stats.causal_model = bool(can_generate()) if callable(can_generate) else False
        eager_hook = run_top_level_frame_eagerly(BoundaryHook.__call__)
        run_top_level_frame_eagerly(BoundaryHook.after_forward)
        return effpass.PassResult(True, {"boundary_hook": 1, "max_positions": max_pos or 0,
                                         "position_ids_accepted": int("position_ids" in params),
                                         "length_marked_dynamic": int(eager_hook)},
                                  live_stats=hook.stats.snapshot)

    # -- torch-IR phase -------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        stats = {"sdpa_rewritten": 0, "softmax_masked": 0, "sink_columns_kept": 0, "positions_per_example": 0,
                 "varlen": 0, "boundary_from_context": 0, "skipped": 0}
        skipped: list[dict] = []
        hook = getattr(ctx.model, "_effpass_pack_hook", None)
        if hook is not None:
            hook.graphs += 1
        gname = _graph_name(graph, hook)
        sites = [n for n in graph.nodes if is_sdpa(n) or is_softmax(n)]
        if not sites:
            return effpass.PassResult(False, stats, why_unchanged=(
                "no attention (SDPA or softmax) in this graph: nothing to keep packed examples apart in"))
        rw = _GraphRewrite(graph, stats)
        unisolated: list[tuple[str, str, str]] = []
        for site in sites:
            where = site_name(site)
            try:
                if not ctx.allows(site):
                    if is_sdpa(site) or attention_scores(site) is not None:
                        raise Skip("excluded by targets/exclude, but an attention site left alone mixes the "
                                   "packed examples")
                    continue
                if is_sdpa(site):
                    rw.sdpa(site, where, varlen_ok=self.kernel != "sdpa")
                else:
                    rw.softmax(site, where)
            except Skip as e:
                stats["skipped"] += 1
                skipped.append({"site": where, "reason": str(e)})
                unisolated.append((gname, where, str(e)))
        changed = stats["sdpa_rewritten"] + stats["softmax_masked"] > 0
        # FLOPs per attended (query, key) pair and row, summed over this graph's attention sites (static)
        stats["attention_flops_per_pair"] = sum(c for c, _ in rw.costs.values())
        counters = getattr(ctx.model, "_effpass_pack_counters", None)
        if counters is not None and rw.costs:
            # NOTE: keyed by module path, so a recompiled graph replaces its sites and graph pieces add up
            counters.sites.update(rw.costs)
        if unisolated:
            # NOTE(fail closed): never a warning. A packed call in progress raises now; the graph may also
            # serve calls that are not packed (generation), so it is kept, and the boundary hook raises at
            # the next packed call.
            if hook is not None:
                hook.unisolated.extend(unisolated)
            if context_doc() is not None or hook is None:
                raise effpass.WrongResultError(unisolated_message(
                    type(ctx.model).__name__ if ctx.model is not None else "the model", unisolated))
        if changed:
            annotate_new_nodes([n for n in rw.new_nodes if "example_value" not in n.meta])
            graph.lint()
        return effpass.PassResult(changed, stats, skipped=skipped)


class _GraphRewrite:
    """One graph's rewrite: the sites, the prologue they share (made at the first site) and the new nodes."""

    def __init__(self, graph: fx.Graph, stats: dict):
        self.graph, self.stats = graph, stats
        self.boundary = find_boundary(graph)
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.new_nodes: list[fx.Node] = []
        self.costs: dict[str, tuple[int, bool]] = {}  # attention site -> (FLOPs per attended pair and row, causal)
        self._pro: Prologue | None = None

    def call(self, fn, *args, **kwargs) -> fx.Node:
        n = self.graph.call_function(fn, args, kwargs)
        self.new_nodes.append(n)
        return n

    def prologue(self, site: fx.Node, like: fx.Node) -> Prologue:
        if self._pro is None:
            if self.boundary is not None:
                kind, bnode = self.boundary
                self.stats[f"boundary_{kind}"] = 1
                self._pro = Prologue.from_boundary(self.graph, self.placeholders, kind, bnode, self.call)
            else:  # after a graph break: the per-call context the boundary hook set
                self.stats["boundary_from_context"] = 1
                self._pro = Prologue.from_context(self.graph, site, like, 0, -2, self.call)
        return self._pro

    def _cost(self, where: str, cost: int, causal: bool) -> None:
        self.costs[where.rsplit(":", 1)[0] + f"#{len(self.costs)}"] = (cost, causal)

    def sdpa(self, site: fx.Node, where: str, varlen_ok: bool) -> None:
        """A fused attention call becomes one with the original mask AND "same example"."""
        op = attention_op(site)
        if not op.maskable:
            raise Skip(f"{op.owner}'s attention op {getattr(op.target, '__name__', op.target)} takes "
                       "no other mask (pack_sequences cannot make it block-diagonal); run that pass "
                       "after packing is off, or use SDPA")
        q, k, *_ = sdpa_args(site)
        sq, sk = shape_of(q)[-2], shape_of(k)[-2]
        pro = self.prologue(site, q)
        if not (same(sq, pro.n_len) and same(sk, pro.n_len)):
            raise Skip(f"query/key lengths ({sq}, {sk}) are not the packed length {pro.n_len} "
                       "(decoding with a cache or cross-attention)")
        self.stats["positions_per_example"] += per_example_positions(self.graph, site, pro, self.call)
        q, k, v, mask, dropout_p, is_causal, scale, gqa = sdpa_args(site)
        with self.graph.inserting_before(site):
            if varlen_ok and varlen_usable(q, mask, dropout_p):
                new = self.call(packed_varlen, q, k, v, pro.doc, is_causal, scale, gqa)
                self.stats["varlen"] += 1
            else:
                new = self.call(packed_sdpa, q, k, v, pro.mask(bool(is_causal)), attn_mask=mask,
                                dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        annotate_new_nodes([new], site)
        site.replace_all_uses_with(new)
        self.graph.erase_node(site)
        self.stats["sdpa_rewritten"] += 1
        self._cost(where, pair_cost(q, v), bool(is_causal))

    def softmax(self, site: fx.Node, where: str) -> None:
        """Hand-written attention: the scores get ``masked_fill(~same, finfo.min)`` (a softmax that is not over
        a square score matrix, e.g. MoE routing, is not attention and is left alone)."""
        found = attention_scores(site)
        if found is None:
            return
        sh = shape_of(found[0])
        pro = self.prologue(site, found[0])
        if not (same(sh[-1], pro.n_len) and same(sh[-2], pro.n_len)):
            raise Skip(f"scores {sh} are not (packed length {pro.n_len})^2 (cross-attention?)")
        self.stats["positions_per_example"] += per_example_positions(self.graph, site, pro, self.call)
        scores, extra = attention_scores(site)
        # NOTE(sinks): extra columns concatenated after the N key columns (learned attention
        # sinks) are not tokens: every row keeps them; only the token columns are masked
        user = extra if extra is not None else site
        with self.graph.inserting_before(user):
            masked = self.call(mask_scores, scores, pro.mask(False))
        annotate_new_nodes([masked], site)
        user.replace_input_with(scores, masked)
        self.stats["softmax_masked"] += 1
        self.stats["sink_columns_kept"] += int(extra is not None)
        self._cost(where, scores_pair_cost(scores), False)


class Prologue:
    """The per-graph nodes every site shares: document ids, per-example positions, one mask per causality."""

    def __init__(self, graph, call, doc: fx.Node, pos: fx.Node, n_len, anchor: fx.Node):
        self.graph, self.call, self.doc, self.pos, self.n_len = graph, call, doc, pos, n_len
        self._anchor = anchor
        self._masks: dict[bool, fx.Node] = {}
        self._pos_row: fx.Node | None = None
        self.batch = None  #: packed rows per call (static int, or a symbol)

    def mask(self, causal: bool) -> fx.Node:
        if causal not in self._masks:
            with self.graph.inserting_after(self._anchor):
                self._masks[causal] = self.call(same_document_mask, self.doc, causal)
            annotate_new_nodes([self._masks[causal]])
        return self._masks[causal]

    def pos_row(self) -> fx.Node:
        """Per-example positions of the (single) packed row, shape ``(N,)``."""
        if self._pos_row is None:
            with self.graph.inserting_after(self._anchor):
                self._pos_row = self.call(first_row, self.pos)
            annotate_new_nodes([self._pos_row])
        return self._pos_row

    @classmethod
    def from_boundary(cls, graph, placeholders, kind, bnode, call) -> "Prologue":
        src = bnode
        if kind in ("cu_seq_lens_q", "cu_seq_lens_k"):
            # NOTE: the packed length N is the tokens' length (cu_seq_lens has one entry per example)
            src = next((n for n in placeholders if TOKENS_RE.match(str(n.target)) and shape_of(n)), None)
            if src is None:
                raise Skip("cu_seq_lens boundaries without input_ids / inputs_embeds in the graph")
        dim = 1 if src is not bnode else -1
        after = bnode if bnode.op != "placeholder" else placeholders[-1]
        with graph.inserting_after(after):
            n_len_node = call(torch.Tensor.size, src, dim)
        with graph.inserting_after(n_len_node):
            doc = call(document_ids, kind, bnode, n_len_node)
        with graph.inserting_after(doc):
            pos = call(positions_of, kind, bnode, n_len_node)
        annotate_new_nodes([n_len_node, doc, pos])
        pro = cls(graph, call, doc, pos, shape_of(src)[dim], pos)
        pro.batch = shape_of(bnode)[0] if kind in ("position_ids", "seq_idx") and shape_of(bnode) else 1
        return pro

    @classmethod
    def from_context(cls, graph, site, like, batch_dim, length_dim, call) -> "Prologue":
        import operator

        with graph.inserting_before(site):
            both = call(torch.ops.effpass.pack_context_get.default, like, batch_dim, length_dim)
            doc = call(operator.getitem, both, 0)
            pos = call(operator.getitem, both, 1)
        annotate_new_nodes([both])
        vals = both.meta.get("example_value")
        if isinstance(vals, (tuple, list)) and len(vals) == 2:
            doc.meta["example_value"], pos.meta["example_value"] = vals
        else:
            annotate_new_nodes([doc, pos])
        pro = cls(graph, call, doc, pos, shape_of(like)[length_dim], pos)
        pro.batch = shape_of(like)[batch_dim]
        return pro


def _graph_name(graph: fx.Graph, hook) -> str:
    ins = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    listed = ", ".join(ins[:4]) + (", ..." if len(ins) > 4 else "")
    k = f" #{hook.graphs}" if hook is not None else ""
    return f"graph{k} (inputs {listed})"

