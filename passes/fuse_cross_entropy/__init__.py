"""``fuse_cross_entropy``: train large-vocabulary models without materialising the logits.

What it does
    Finds the output projection (``lm_head``: a linear, optionally tied to the embedding, with a bias,
    a LoRA adapter or a dequantised weight) followed by a cross-entropy in the graph Dynamo hands over,
    and replaces the pair with one opaque custom op, ``effpass::linear_cross_entropy``, that computes the
    loss in chunks of logits: forward and backward never hold more than one chunk (a tile of
    ``rows x vocabulary`` logits; about three tiles' worth of buffers while it runs). Rows whose label is
    ``ignore_index`` skip the projection entirely.

Recognised forms (the matcher walks back from each ``F.cross_entropy``)
    * Hugging Face's loss code (``ForCausalLMLoss``): ``logits.float()``, the label shift by ``pad`` +
      slice, ``view(-1, V)``, ``cross_entropy(..., ignore_index=-100, reduction="mean")``, or
      ``reduction="sum"`` followed by ``/ num_items_in_batch`` (gradient accumulation: the division stays
      in the graph);
    * user code calling ``F.cross_entropy`` on returned logits in the same graph, with the shift done on
      the logits (``logits[:, :-1]``), any ``reduction`` (``"none"`` returns per-token losses that may be
      weighted), ``label_smoothing`` and ``ignore_index``;
    * between projection and loss: casts, ``contiguous``, reshapes and slices that keep the vocabulary
      dim, scaling by constants (Cohere's ``logit_scale``) and Gemma 2's soft-capping
      ``tanh(z / c) * c``;
    * the projection: ``F.linear(h, W, b)`` with any ``W`` (a parameter, the tied embedding, a dequantised
      weight from ``quantize_linear``), or ``linear(h, W) + (linear(linear(dropout(h), A), B) * s)`` (a
      LoRA head from ``inject_lora``: the adapter path is the op's second projection).

Logits
    In training (the loss needs a gradient) the logits the model returns are not computed: the output's
    ``logits`` is ``None``, as with Liger-Kernel and Unsloth, unless ``keep_logits=True`` (then they are
    computed as before, and the loss still runs chunked). Graphs whose loss needs no gradient (evaluation,
    generation, ``torch.no_grad``) are left unchanged. Logits used by other computations in the graph
    (an accuracy metric) are kept.

The kernel
    ``sum``/``mean`` reductions: one custom op computes the loss and the gradients of its inputs in the
    forward, chunk by chunk (as Liger does); its registered backward only scales them by the incoming
    gradient, so the backward holds no logits at all. ``reduction="none"``: the forward saves the per-row
    log-sum-exp and the backward (another custom op) recomputes each chunk. The default budget is the
    larger of the batch's hidden states and ``MIN_CHUNK_ROWS`` (256; a quarter of the rows when that is
    fewer) full rows of logits: every chunk
    re-reads the head's weight and its gradient, so fewer rows make the step bandwidth-bound. A chunk is
    a full row block when the budget holds at least 128 full rows (one pass: 3 matmul-equivalents, as
    unfused); otherwise (a small explicit ``chunk_bytes``) a ``rows x vocab`` tile with an online
    log-sum-exp (two passes: 4 matmul-equivalents). A quantized head's weight (``quantize_linear``) is
    dequantised once in the graph and the plain weight feeds the op.
    Being custom ops, Inductor cannot fuse, reorder or keep extra chunks alive.
    ``kernel="torch"`` calls torch's ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` instead
    (feature-tested: torch >= 2.13; plain projections with mean/sum reductions, no transform, smoothing or
    autocast; other sites use effpass's kernel). The default is effpass's kernel: it covers every form
    above, and with a 64 MiB budget its compiled step ran 2.7x faster than a hand-wired eager step using
    torch's chunked path on CPU (docs/passes/fuse_cross_entropy.md).

Phase: torch IR (``transform_torch_ir``). Runs after ``fuse_attention``, ``apply_autocast`` (a projection
inside an autocast region runs its matmuls in the region's dtype inside the op: bf16 matmuls, fp32
log-sum-exp), ``inject_lora`` and ``quantize_linear`` (the head may be a LoRA or quantized linear), and
``checkpoint_activations`` (its joint hook runs first; this pass then marks the op ``MUST_SAVE`` so the
partitioner never recomputes it).

Other vocabulary-sized computations
    Chosen-token log-probabilities (``log_softmax`` + ``gather``, ``gather - logsumexp``) become the per-row op;
    whatever else is computed row by row from one or two heads' logits (entropy, KL / JSD between a student and
    a teacher, z-loss; ``region.py``) becomes ``effpass::linear_rowwise``, which runs the extracted
    row function on blocks of full rows and differentiates it per block in the backward. TRL's chunked
    log-prob op (routed by ``effpass/integrations/_trl_kernels.py``) is counted as ``trl_logprob_sites``.

Invariants: only matched nodes are replaced; placeholders are never added or removed; the loss and every
gradient equal the unfused graph's within 1e-5 relative in fp32 (the sums are ordered differently).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx
import torch.nn.functional as F

import effpass
from effpass.facts import FusesLossHead
from effpass.integrations.huggingface import set_hf_loss_type  # noqa: F401  (re-exported)
from effpass.graph import is_static, size_hint
from effpass.scope import module_path_of_node

from .kernels import (MIN_CHUNK_ROWS, MIN_FULL_ROWS, NO_IGNORE, OPS, default_chunk_bytes,  # noqa: F401 (re-exported)
                               default_rows_chunk_bytes, linear_cross_entropy, num_chunks, plan_chunks)
from .heads import (check_head, compute_dtype, count_head, drop_logits, emit_head, logits_readers, node_caller,
                    set_meta_or_skip)
from .region import find_regions
from .rewrite import _needs_grad, rewrite_region
from .matching import LogProbSite, Site, Skip, _CE_FNS, _is_fn, _val, ce_args, erase_unused, match, match_logprob


__all__ = ["FuseCrossEntropy", "default_chunk_bytes", "linear_cross_entropy", "plan_chunks",
           "set_hf_loss_type"]


def _slabs(rows: int, vocab: int, xv) -> int:
    """The vocabulary slabs the Triton tiles' backward loops over (what ``chunks`` counts on that path)."""
    from .triton_tiles import slab_entries

    return -(-vocab // slab_entries(rows, vocab, xv.element_size())) if rows > 0 else 0


@effpass.register_pass("fuse_cross_entropy",
                       run_after=("fuse_attention", "apply_autocast", "inject_lora", "quantize_linear",
                                  "checkpoint_activations"))
@dataclass(frozen=True, kw_only=True)
class FuseCrossEntropy(effpass.Pass):
    """Output projection + cross-entropy -> one chunked op that never holds the full logits.

    Before (Hugging Face Gemma 2 with labels, torch IR)::

        logits = F.linear(h, embed_weight)                        # (B, S, V): tied head
        logits = torch.tanh(logits / 30.0) * 30.0                 # final-logit soft-capping
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]       # shift
        loss   = F.cross_entropy(logits.float().view(-1, V), labels.view(-1), ignore_index=-100)
        return loss, logits

    After::

        loss = effpass::linear_cross_entropy(h.reshape(-1, H), embed_weight, ..., labels.view(-1),
                                             ignore_index=-100, pre=1/30, softcap=True, post=30, mean=True)[0]
        return loss, None                                         # logits not computed (keep_logits=False)
    """

    summary = "output projection + cross-entropy computed in chunks; logits never materialised"

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: the loss head without full logits (lossless)."""
        return [effpass.MemoryOption(technique="fuse_cross_entropy", lossless=True, group="loss_head",
                                     changes="logits", cost="the head's matmuls in chunks; logits recomputed "
                                                             "in backward")]

    keep_logits: bool = field(default=False, metadata={
        "doc": "also compute and return the logits in training (default: the output's logits is None)"})
    chunk_bytes: int = field(default=0, metadata={
        "doc": "bytes of one fp32 chunk of logits; 0: the larger of the batch's hidden states and "
               "min(256, rows / 4) rows of logits"})
    budget_rows: int = field(default=0, metadata={
        "doc": "the default chunk budget computed as for a batch of this many rows (0: the batch's own; the "
               "planner's short replays pin a long sequence's chunks, effpass/planning/tiles.py)"})
    kernel: Literal["effpass", "triton", "chunked", "torch"] = field(default="effpass", metadata={
        "doc": "'effpass': effpass's custom ops, with the Triton tiles (logits kept in registers) on a CUDA "
               "device where Triton is installed and the chunked torch kernel elsewhere; 'triton': the Triton "
               "tiles (a CUDA device, or TRITON_INTERPRET=1 on a CPU; else an error); 'chunked': the chunked "
               "torch kernel on every device; 'torch': torch's F.linear_cross_entropy with chunking (torch >= 2.13; "
               "plain heads, mean/sum, no soft-capping or smoothing; else effpass's)"})

    def validate(self) -> None:
        if self.budget_rows < 0:
            raise ValueError(f"fuse_cross_entropy.budget_rows must be >= 0 (0: the batch's own), got {self.budget_rows}")
        if self.chunk_bytes < 0:
            raise ValueError(f"fuse_cross_entropy.chunk_bytes must be >= 0 (0: the default budget), "
                             f"got {self.chunk_bytes}")

    def pin_length(self, seq: int, batch: int = 1):
        """``effpass.Pass.pin_length``: the default chunk budget follows the batch's rows; pinned to ``seq``'s."""
        if self.chunk_bytes or self.budget_rows:
            return self, 0
        return dataclasses.replace(self, budget_rows=seq * batch), 0

    def facts(self) -> tuple:
        """The head is fused with the loss in the graph holding both (read by wrap_fsdp)."""
        return (FusesLossHead(),)

    @classmethod
    def enabled_by_default(cls, device=None) -> bool:
        return True

    @classmethod
    def default_note(cls) -> str:
        return "on for every device (same loss and gradients; the training output's logits become None)"

    # -- torch IR ---------------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        stats = {"fused": 0, "logits_bytes_avoided": 0, "chunks": 0, "chunk_bytes": 0, "logits_returned": 0,
                 "logits_dropped": 0, "lora_heads": 0, "low_precision_matmuls": 0, "torch_kernel": 0,
                 "dequantized_heads": 0, "skipped": 0, "left_alone_no_grad": 0, "logprob_sites": 0,
                 "rowwise_sites": 0, "two_head_sites": 0, "rowwise_outputs": 0, "trl_logprob_sites": 0,
                 "input_grad_in_forward": 0, "rowwise_grad_in_forward": 0, "symbolic_rows": 0, "triton_tiles": 0}
        skipped: list[dict] = []
        for ce in [n for n in graph.nodes if _is_fn(n, _CE_FNS)]:
            where = f"{module_path_of_node(ce) or '<root>'}:{ce.name}"
            out = _val(ce)
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                stats["left_alone_no_grad"] += 1
                skipped.append({"site": where, "reason": "the loss needs no gradient (evaluation): left unchanged"})
                continue
            model = ctx.model
            if model is not None and hasattr(model, "training") and not model.training:
                stats["left_alone_no_grad"] += 1
                skipped.append({"site": where, "reason": "the model is in eval mode: left unchanged"})
                continue
            try:
                site = match(ce, ctx.model)
                if not ctx.allows(site.proj):
                    continue
                self._rewrite(graph, site, ctx, stats)
            except Skip as e:
                stats["skipped"] += 1
                skipped.append({"site": where, "reason": str(e)})
        deferred: list[tuple[fx.Node, str]] = []
        for n in list(graph.nodes):
            if getattr(n, "_erased", False) or n.op not in ("call_function", "call_method"):
                continue
            try:
                lp = match_logprob(n, ctx.model)
                if lp is None or not ctx.allows(lp.site.proj):
                    continue
                self._rewrite_logprob(graph, lp, ctx, stats)
            except Skip as e:
                deferred.append((n, str(e)))  # the row-wise rewrite below may still fuse it
        # what is left: row-wise functions of the heads' distributions (entropy, KL / JSD, z-loss, a
        # log-prob whose full log-softmax is also read)
        regions, why = find_regions(graph, ctx.model, set())
        for region in regions:
            if not all(ctx.allows(s.proj) for s in region.sites):
                continue
            try:
                rewrite_region(graph, region, ctx, stats, chunk_bytes=self.chunk_bytes, keep_logits=self.keep_logits,
                               budget_rows=self.budget_rows)
            except Skip as e:
                why.append({"node": region.members[0], "reason": str(e)})
        for n, reason in deferred + [(w["node"], w["reason"]) for w in why]:
            if getattr(n, "_erased", False):
                continue  # fused after all
            stats["skipped"] += 1
            skipped.append({"site": f"{module_path_of_node(n) or '<root>'}:{n.name}", "reason": reason})
        # TRL's fused LM head (DPO/KTO/GRPO/SFT trainers), routed through effpass's custom op
        # (effpass/integrations/_trl_kernels.py): already chunked, counted so the report says so
        stats["trl_logprob_sites"] = sum(1 for n in graph.nodes if n.op == "call_function"
                                         and "trl_chunked_logprob" in str(n.target) and "backward" not in str(n.target))
        changed = stats["fused"] > 0 or stats["logprob_sites"] > 0 or stats["rowwise_sites"] > 0
        if changed:
            graph.lint()
        why = ""
        if not changed:
            if stats["trl_logprob_sites"]:
                why = f"{stats['trl_logprob_sites']} TRL chunked log-prob site(s): the head is already chunked"
            elif stats["left_alone_no_grad"] and not stats["skipped"]:
                why = "the loss needs no gradient (evaluation or no labels): the logits are returned unchanged"
            elif skipped:
                why = f"{len(skipped)} loss site(s) found, none fusable (reasons below)"
            else:
                why = ("no cross-entropy, log-prob or row-wise function of a linear head in this graph (a model called "
                       "without labels computes no loss: pass labels=, or compute the loss inside the compiled call)")
        return effpass.PassResult(changed=changed, stats=stats, skipped=skipped, why_unchanged=why)

    # -- shared by the rewriters ---------------------------------------------------------------------
    @staticmethod
    def _frozen_head(site: Site) -> bool:
        """Only the hidden states need a gradient (a frozen or quantized head, LoRA on other layers): the per-row op
        then computes their gradient in its forward pass (``x_grad``) instead of recomputing the logits."""
        return (_needs_grad(site.h) and site.lora is None and not _needs_grad(site.weight)
                and not (isinstance(site.bias, fx.Node) and _needs_grad(site.bias)))

    def _plan(self, graph: fx.Graph, site: Site, consumers, n_rows, vocab: int, per_row: bool = False):
        """``(chain_set, returned, keep, compute, budget, stat_budget)`` of a one-head site: who reads its logits,
        whether they are kept, the matmul dtype and the chunk budget (``per_row``: the per-row op's default, a
        cache-sized tile on CPU). A symbolic row count (``n_rows`` a ``SymInt``: a packed length) leaves the
        default budget to run time (0: the op computes the same default from each call's rows; a constant here
        would be specialised to the traced length); ``stat_budget`` is then the traced example's, for the
        statistics."""
        chain_set, returned, used_elsewhere = logits_readers(site, consumers)
        hv = _val(site.h)
        hb = size_hint(hv.numel()) * hv.element_size()
        rows = size_hint(n_rows)
        if self.budget_rows and isinstance(n_rows, int):  # pinned: as for budget_rows rows (hb: rows x width)
            rows, hb = self.budget_rows, hb // max(rows, 1) * self.budget_rows
        default = (default_rows_chunk_bytes(rows, vocab, hb, hv.device.type) if per_row
                   else default_chunk_bytes(rows, vocab, hb))
        budget = self.chunk_bytes or (default if isinstance(n_rows, int) else 0)
        return (chain_set, returned, bool(used_elsewhere) or self.keep_logits, compute_dtype(graph, site),
                budget, self.chunk_bytes or default)

    # -- cross-entropy ------------------------------------------------------------------------------------
    def _rewrite(self, graph: fx.Graph, site: Site, ctx, stats: dict) -> None:
        ce = site.ce
        a = ce_args(ce)
        vocab, width = check_head(site)
        n_rows = _val(a["input"]).shape[0]   # a SymInt for a dynamic (packed) length: never int() it (a guard)
        per_row = a["reduction"] == "none"
        chain_set, returned, keep, compute, budget, stat_budget = self._plan(graph, site, {ce}, n_rows, vocab,
                                                                             per_row)
        new: list[fx.Node] = []
        call = node_caller(graph, new)
        with graph.inserting_before(ce):
            x, weight, x2, w2 = emit_head(graph, site, call, new, vocab, width)
            target = a["target"]
            reduction = a["reduction"]
            eps, ignore = float(a["label_smoothing"]), int(a["ignore_index"])
            use_torch = self.kernel == "torch" and self._torch_supports(site, reduction, eps, compute)
            # a frozen head's per-row form computes its input gradient in the forward (2 matmul-equivalents) on the
            # chunked kernel; the Triton tiles recompute instead (3, with no elementwise pass over a logit tile)
            tiles = not use_torch and self._tiles(site, _val(site.h))
            xg = not tiles and reduction == "none" and eps == 0.0 and self._frozen_head(site)
            if use_torch:
                loss = call(F.linear_cross_entropy, x, weight, target, linear_bias=site.bias,
                            reduction=reduction, ignore_index=ignore,
                            options=torch.nn.LinearCrossEntropyOptions())
            elif reduction == "none" or tiles:
                # with the Triton tiles a mean/sum is the per-row op summed in the graph: its backward then takes
                # the incoming gradient as each row's factor (no gradient computed in the forward and rescaled)
                res = call(torch.ops.effpass.linear_cross_entropy_rows.default, x, weight, x2, w2, site.bias,
                           target, ignore, eps, site.pre, site.softcap, site.post, budget, compute, xg, self.kernel)
                stats["input_grad_in_forward"] += int(xg)
                loss = call(operator.getitem, res, 0)  # 0 on ignored rows
                if reduction != "none":
                    loss = call(torch.sum, loss)
                if reduction == "mean":  # over the valid rows (0/0 is nan, as torch's mean)
                    loss = call(operator.truediv, loss, call(torch.sum, call(operator.ne, target, ignore)))
            else:
                def needs(n):
                    v = _val(n)
                    return bool(isinstance(v, torch.Tensor) and v.requires_grad)

                mask = [needs(site.h), site.lora is not None and needs(site.lora[0]), needs(weight),
                        site.lora is not None and needs(w2), site.bias is not None and needs(site.bias)]
                res = call(torch.ops.effpass.linear_cross_entropy.default, x, weight, x2, w2, site.bias,
                           target, ignore, eps, site.pre, site.softcap, site.post, reduction == "mean", budget,
                           compute, mask, self.kernel)
                loss = call(operator.getitem, res, 0)
            out_dtype = _val(ce).dtype
            if out_dtype != torch.float32:
                loss = call(torch.Tensor.to, loss, out_dtype)
        set_meta_or_skip(graph, new, ce, x, (n_rows, width))
        ce.replace_all_uses_with(loss)
        graph.erase_node(ce)
        dropped = drop_logits(graph, site, chain_set, returned, keep)
        stats["fused"] += 1
        rows = size_hint(n_rows)
        stats["logits_bytes_avoided"] += rows * vocab * 4
        stats["chunks"] += 1 if use_torch else (_slabs(rows, vocab, _val(site.h)) if tiles
                                                else num_chunks(rows, vocab, stat_budget, per_row))
        stats["chunk_bytes"] = stat_budget
        stats["symbolic_rows"] += int(not isinstance(n_rows, int))
        stats["logits_returned"] += int(bool(returned) and keep)
        stats["logits_dropped"] += int(dropped)
        stats["torch_kernel"] += int(use_torch)
        stats["triton_tiles"] += int(tiles)
        count_head(stats, site, weight, compute)

    def _tiles(self, site: Site, xv) -> bool:
        """Whether the site runs on the Triton tiles (``triton_tiles.wanted``); ``kernel="triton"`` where they
        cannot run is an error naming why."""
        from effpass.devices import device_type_for

        from .triton_tiles import available, wanted

        if self.kernel == "triton":
            why = available(device_type_for(xv))
            if why:
                raise ValueError(f"effpass fuse_cross_entropy: kernel='triton' cannot run here: {why}; valid "
                                 "kernels: 'effpass' (Triton on CUDA, chunked elsewhere), 'chunked', 'torch'")
        return wanted(self.kernel, xv, second_projection=site.lora is not None, x_grad=False)

    # -- chosen-token log-probabilities ---------------------------------------------------------------------
    def _rewrite_logprob(self, graph: fx.Graph, lp: LogProbSite, ctx, stats: dict) -> None:
        """``log_softmax(proj(h))[..., t]`` -> ``-linear_cross_entropy_rows(h, W, ..., t)`` (no ignored rows:
        a negative or too large index raises, as gather does), reshaped to the gather's shape."""
        site, anchor = lp.site, lp.out
        vocab, width = check_head(site)
        iv = _val(lp.index)
        if not isinstance(iv, torch.Tensor):
            raise Skip("the index has no static example value")
        n_rows = iv.numel()   # a SymInt for a dynamic (packed) length: never int() it (a guard)
        chain_set, returned, keep, compute, budget, stat_budget = self._plan(graph, site, set(lp.nodes), n_rows,
                                                                             vocab, True)
        new: list[fx.Node] = []
        call = node_caller(graph, new)
        with graph.inserting_before(anchor):
            x, weight, x2, w2 = emit_head(graph, site, call, new, vocab, width)
            target = call(torch.reshape, lp.index, (-1,))
            tiles = self._tiles(site, _val(site.h))
            xg = not tiles and self._frozen_head(site)
            res = call(torch.ops.effpass.linear_cross_entropy_rows.default, x, weight, x2, w2, site.bias, target,
                       NO_IGNORE, 0.0, site.pre, site.softcap, site.post, budget, compute, xg, self.kernel)
            stats["input_grad_in_forward"] += int(xg)
            stats["triton_tiles"] += int(tiles)
            out = call(torch.neg, call(operator.getitem, res, 0))
            if is_static(iv.shape):
                shape = tuple(int(d) for d in iv.shape)
                out = call(torch.reshape, out, shape[:-1] if lp.squeezed else shape)
            else:  # symbolic sizes: the index's own shape, read in the graph (no size is baked in)
                out = call(torch.Tensor.reshape_as, out, lp.index)
                if lp.squeezed:
                    out = call(torch.squeeze, out, -1)
            if _val(anchor).dtype != torch.float32:
                out = call(torch.Tensor.to, out, _val(anchor).dtype)
        set_meta_or_skip(graph, new, anchor, x, (n_rows, width))
        anchor.replace_all_uses_with(out)
        erase_unused(graph, list(lp.nodes))
        dropped = drop_logits(graph, site, chain_set, returned, keep)
        stats["logprob_sites"] += 1
        rows = size_hint(n_rows)
        stats["logits_bytes_avoided"] += 0 if keep else rows * vocab * 4
        stats["chunks"] += _slabs(rows, vocab, _val(site.h)) if tiles else num_chunks(rows, vocab, stat_budget, True)
        stats["chunk_bytes"] = stat_budget
        stats["symbolic_rows"] += int(not isinstance(n_rows, int))
        stats["logits_returned"] += int(bool(returned) and keep)
        stats["logits_dropped"] += int(dropped)
        count_head(stats, site, weight, compute)

    # -- row-wise functions of one or two heads (entropy, KL / JSD, z-loss) ------------------------------
    @staticmethod
    def _torch_supports(site: Site, reduction: str, eps: float, compute: str) -> bool:
        return (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
                and site.lora is None and not site.softcap and site.pre == 1.0 and eps == 0.0 and not compute
                and reduction in ("mean", "sum"))

    # -- joint: never recompute the op ----------------------------------------------------------------
    def transform_joint(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        from torch.utils.checkpoint import CheckpointPolicy

        ops = OPS
        marked = 0
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in ops and "recompute" in n.meta:
                for m in [n, *n.users]:
                    m.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked += 1
        return effpass.PassResult(changed=marked > 0, stats={"marked_save": marked}) if marked else effpass.PassResult(
            why_unchanged="no fused op here carries a checkpoint mark (this hook only keeps fused ops saved, never "
                          "recomputed, under checkpoint_activations)")
