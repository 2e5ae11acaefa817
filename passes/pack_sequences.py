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
    boolean mask, which on CPU runs the fused flash kernel. Measured on CPU (``docs/pack_sequences.md``):
    ``flex_attention`` and a per-example loop were not faster and the loop needs the boundaries on the host.

Phase ordering: runs after ``fuse_attention`` (so hand-written attention is already an SDPA call) and
before ``apply_autocast`` / ``checkpoint_activations`` (which see the rewritten call).

Dynamic shapes: packed lengths vary every step. The boundary hook runs eagerly (Dynamo skips its frame,
see :func:`_run_top_level_frame_eagerly`) and marks the packed length of every per-token input (and the
example count of ``cu_seq_lens_*``) dynamic with ``maybe_mark_dynamic`` before the model's frame is traced,
so the model compiles once, with a symbolic length, and never recompiles for a new length
(``tests/test_pack_sequences.py`` counts it). Inlined into an outer ``torch.compile`` the hook is traced
instead, and Dynamo's automatic dynamic shapes give one recompile.

Statistics: the hook also counts, on the inputs' device (no host sync), examples, tokens, padding avoided
and the attended pairs per step (:class:`PackingCounters`); the torch-IR phase records each rewritten
site's FLOPs per pair. The module record's ``live_stats`` reads them when a report or dump is asked for.

Invariants: placeholders are never added or removed; every attention site of a graph is rewritten or listed
as unisolated (and a packed call then raises).
"""
from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import effpass
from effpass.attention import attention_op, masked_sdpa
from effpass.graph import Skip, copy_provenance, infer_fake_values, is_softmax as _is_softmax, shape_of, tensor_meta
from effpass.scope import module_path_of_node

__all__ = ["PackSequences", "packing_stats", "document_ids", "position_ids_from"]

#: keyword arguments that carry example boundaries, in order of preference
BOUNDARY_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "position_ids")
_PLACEHOLDER_RE = re.compile(r"^L_(?:kwargs_)?(seq_idx|cu_seq_lens_q|cu_seq_lens_k|position_ids)_$")
_TOKENS_RE = re.compile(r"^L_(?:kwargs_)?(input_ids|inputs_embeds|tokens)_$")
_CONTEXT_SET_OPS: set = set()  # filled below, once the custom op exists


# ------------------------------------------------------------------------------------------------------
# functions the rewritten graph calls (plain torch code: AOTAutograd traces them, no host sync)
# ------------------------------------------------------------------------------------------------------
def document_ids(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """Per-token example ids, shape ``(1 or B, n)``, from a boundary tensor of kind ``kind``."""
    if kind == "seq_idx":
        return boundary.long()
    if kind in ("cu_seq_lens_q", "cu_seq_lens_k"):
        idx = torch.arange(n, device=boundary.device)
        return torch.searchsorted(boundary[1:].contiguous().long(), idx, right=True)[None]
    return torch.cumsum((boundary == 0).long(), dim=-1)


def position_ids_from(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """``position_ids`` (restarting at 0 per example) from ``cu_seq_lens_*`` or ``seq_idx``."""
    idx = torch.arange(n, device=boundary.device)
    if kind == "seq_idx":
        s = boundary.long()
        new = torch.ones_like(s, dtype=torch.bool)
        new[..., 1:] = s[..., 1:] != s[..., :-1]
        start = torch.cummax(torch.where(new, idx.expand_as(s), 0), dim=-1).values
        return idx - start
    cu = boundary.long()
    doc = torch.searchsorted(cu[1:].contiguous(), idx, right=True)
    return (idx - cu[doc])[None]


def same_document_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(B, 1, N, N)`` boolean mask: True where query and key belong to the same example (and, if
    ``causal``, the key is not after the query)."""
    same = doc[:, None, :, None] == doc[:, None, None, :]
    if causal:
        idx = torch.arange(doc.shape[-1], device=doc.device)
        same = same & (idx[:, None] >= idx[None, :])
    return same


def packed_sdpa(q, k, v, same, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA with ``attn_mask`` (``is_causal`` already folded into ``same``) restricted to one example."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    if attn_mask is None:  # every row keeps its own token: the fused kernel is safe as is
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same, dropout_p=dropout_p, scale=scale, **kw)
    if attn_mask.dtype == torch.bool:
        mask = attn_mask & same
    else:
        mask = attn_mask.masked_fill(~same, torch.finfo(attn_mask.dtype).min)
    # NOTE: the model's own mask (padding) may empty a row: masked_sdpa keeps the fused kernel safe there
    return masked_sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kw)


def mask_scores(scores: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """Hand-written attention scores with the other examples' keys masked (HF's finfo.min convention)."""
    return scores.masked_fill(~same, torch.finfo(scores.dtype).min)


def packed_varlen(q, k, v, doc, is_causal, scale=None, enable_gqa=False):
    """Packed attention with torch's variable-length kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA
    FlashAttention): ``(B, H, N, D)`` rows whose ``doc`` ``(1 or B, N)`` ids never decrease along a row. The
    boundaries become ``cu_seqlens`` of fixed length ``B*N + 1`` (empty examples repeat an offset) and
    ``max_seqlen = N``, so nothing is read back to the host. NOTE: written for CUDA, untested on a GPU (none
    was available); :func:`_varlen_usable` chooses it only where the kernel exists."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, n, d = q.shape
    doc = doc.expand(b, n).long()
    doc = doc - doc[:, :1] + (torch.arange(b, device=q.device) * n)[:, None]  # ids unique across rows
    cu = torch.searchsorted(doc.reshape(-1).contiguous(), torch.arange(b * n + 1, device=q.device)).to(torch.int32)
    qf, kf, vf = (t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[-1]) for t in (q, k, v))
    out = varlen_attn(qf, kf, vf, cu, cu, n, n, scale=scale, window_size=(-1, 0) if is_causal else (-1, -1),
                      enable_gqa=bool(enable_gqa))
    return out.reshape(b, n, h, v.shape[-1]).transpose(1, 2)


# ------------------------------------------------------------------------------------------------------
# the per-call packing context: the boundary hook sets it once per call; graphs without a boundary input
# (after a graph break) read it through a custom op, so every graph Dynamo makes of the model is packed
# ------------------------------------------------------------------------------------------------------
class _PackContext:
    """Per-example document ids and positions ``(1 or B, N)`` of the packed call in progress (None: the call
    in progress is not a packed row). Set by the boundary hook (eagerly, or by :func:`pack_context_set` in a
    graph when the hook is traced inline), read by :func:`pack_context_get` in graphs that lack the boundary
    input. NOTE: one call at a time per process; a backward that recomputes (activation checkpointing) reads
    the context of the last forward, so run each forward's backward before the next packed forward."""

    doc: torch.Tensor | None = None
    pos: torch.Tensor | None = None


_CONTEXT = _PackContext()


def _set_context(pos: torch.Tensor | None) -> None:
    if pos is None:
        _CONTEXT.doc = _CONTEXT.pos = None
        return
    pos = pos.long()
    _CONTEXT.pos = pos
    _CONTEXT.doc = torch.cumsum((pos == 0).long(), dim=-1)


@torch.library.custom_op("effpass::pack_context_set", mutates_args=())
def pack_context_set(pos: torch.Tensor) -> torch.Tensor:
    """Records ``pos`` (per-example positions) as the packed call in progress; returns a copy of it (used as
    the call's ``position_ids``, so the op stays in a graph that traces the hook)."""
    _set_context(pos)
    return pos.clone()


@pack_context_set.register_fake
def _(pos):
    return torch.empty_like(pos)


_CONTEXT_SET_OPS.update({torch.ops.effpass.pack_context_set.default, torch.ops.effpass.pack_context_set,
                         pack_context_set})


@torch.library.custom_op("effpass::pack_context_get", mutates_args=())
def pack_context_get(like: torch.Tensor, batch_dim: int, length_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and per-example positions ``(B, N)`` of the packed call in progress, with ``B`` and ``N``
    read from ``like``'s dims. Outside a packed call: one document and positions ``0..N-1`` (the graph then
    computes what it did before the pass)."""
    b, n = like.shape[batch_dim], like.shape[length_dim]
    doc, pos = _CONTEXT.doc, _CONTEXT.pos
    if doc is None:
        pos = torch.arange(n, device=like.device).expand(b, n)
        return torch.zeros(b, n, dtype=torch.long, device=like.device), pos.contiguous()
    if doc.shape[-1] != n or doc.shape[0] not in (1, b):
        raise effpass.WrongResultError(
            f"pack_sequences: a graph without the boundary input expected a packed call of {b} row(s) of {n} "
            f"tokens, but the packed call in progress has {tuple(doc.shape)} (a forward of another packed batch "
            "ran between this forward and its backward?). Run each packed forward's backward before the next")
    return doc.to(like.device).expand(b, n).contiguous(), pos.to(like.device).expand(b, n).contiguous()


@pack_context_get.register_fake
def _(like, batch_dim, length_dim):
    b, n = like.shape[batch_dim], like.shape[length_dim]
    return like.new_empty((b, n), dtype=torch.long), like.new_empty((b, n), dtype=torch.long)


# ------------------------------------------------------------------------------------------------------
# statistics of a packed batch (host side, for logging one batch; the running figures are in the report)
# ------------------------------------------------------------------------------------------------------
def packing_stats(batch: dict, *, attention_layers: int = 1, heads: int = 1, head_dim: int = 1) -> dict[str, float]:
    """Examples per row, padding avoided and attention FLOPs (block-diagonal vs dense) of a packed batch.

    ``batch`` is what the collator returns (``position_ids``, ``cu_seq_lens_q`` or ``seq_idx``). Padding
    avoided is counted against a padded batch of the same examples padded to the longest one.
    FLOPs count the ``q @ k^T`` and ``p @ v`` matmuls of causal attention (``4 * d * pairs`` per head and
    layer); dense is the same row attended as one causal sequence.
    """
    kind, b = _batch_boundary(batch)
    n = b.shape[-1] if kind != "cu_seq_lens_q" and kind != "cu_seq_lens_k" else int(b[-1])
    doc = document_ids(kind, b, n)
    lengths = []
    for row in doc:
        lengths += torch.bincount(row - row.min()).tolist()
    lengths = [x for x in lengths if x]
    rows = doc.shape[0]
    real = sum(lengths)
    longest = max(lengths)
    per_head = 4 * head_dim * heads * attention_layers
    pairs_block = sum(x * (x + 1) // 2 for x in lengths)
    pairs_dense = rows * n * (n + 1) // 2
    return {"rows": rows, "examples": len(lengths), "examples_per_row": len(lengths) / rows, "tokens": real,
            "longest_example": longest, "padding_tokens_avoided": len(lengths) * longest - real,
            "attention_flops_block_diagonal": per_head * pairs_block, "attention_flops_dense": per_head * pairs_dense,
            "attention_flops_ratio": pairs_block / pairs_dense}


def _batch_boundary(batch: dict) -> tuple[str, torch.Tensor]:
    for name in BOUNDARY_KWARGS:
        if batch.get(name) is not None:
            return name, batch[name]
    raise ValueError(f"pack_sequences: the batch carries no example boundaries; expected one of {list(BOUNDARY_KWARGS)} "
                     f"(DataCollatorWithFlattening returns position_ids), got keys {sorted(batch)}")


# ------------------------------------------------------------------------------------------------------
# the module phase: refuse token-mixing layers, install the boundary hook
# ------------------------------------------------------------------------------------------------------
def _mixes_tokens(module: nn.Module) -> str | None:
    """Why ``module`` mixes tokens across positions outside attention, or None."""
    if isinstance(module, nn.RNNBase):
        return f"recurrent layer {type(module).__name__}"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        ks = module.kernel_size
        if any(s > 1 for s in ks):
            return f"convolution {type(module).__name__} with kernel {tuple(ks)}"
    return None


def _max_positions(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _mark_packed_length_dynamic(args: tuple, kwargs: dict, n: int) -> None:
    """Mark the packed length of every per-token input dynamic (``maybe_mark_dynamic``: not enforced), and
    the example count of ``cu_seq_lens_*``, so the model's frame is compiled once for all lengths."""
    for t in (*args, *kwargs.values()):
        if not isinstance(t, torch.Tensor):
            continue
        if t.dim() >= 2 and t.shape[1] == n:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
        t = kwargs.get(k)
        if isinstance(t, torch.Tensor) and t.dim() == 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _run_top_level_frame_eagerly(fn) -> bool:
    """Have Dynamo run ``fn`` (and what it calls) eagerly when it is a frame of its own (as a forward
    pre-hook called from ``nn.Module._call_impl``, which Dynamo skips), while an outer trace that inlines
    it still traces it (no graph break). False where this torch has no per-code frame strategy."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - older torch: the hook is compiled (one more recompile)
        return False
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return True


class PackingCounters:
    """Per-step packing figures, accumulated on the inputs' device (no host synchronisation per step) and
    read (one synchronisation) only when a report asks for them.

    Device counters: examples, tokens if every example were padded to its step's longest, and token pairs
    attended within examples (causal: ``sum(len*(len+1)/2)``; full: ``sum(len^2)``). Host counters (from
    shapes): steps, rows, tokens, and the pairs of the dense rows. The attention FLOPs use the per-pair cost
    of the attention sites the torch-IR phase rewrote (``4 * heads * head_dim`` per row and site; recorded
    at compile time in :attr:`sites`)."""

    def __init__(self):
        self.device_sums: dict[torch.device, torch.Tensor] = {}
        self.steps = self.rows = self.tokens = self.dense_causal = self.dense_full = 0
        #: attention site (module path) -> (FLOPs per attended pair and row, causal)
        self.sites: dict[str, tuple[int, bool]] = {}
        #: the model generates (a causal LM): its attention is causal even where the graph's mask says so
        #: only through a tensor (hand-written attention, SDPA with the model's own mask)
        self.causal_model = False

    @torch.no_grad()
    def add(self, pos: torch.Tensor) -> None:
        if pos.dim() != 2 or pos.numel() == 0:
            return
        b, n = pos.shape
        pos = pos.long()
        first = pos == 0
        doc = torch.cumsum(first, dim=-1) - 1 + torch.arange(b, device=pos.device)[:, None] * n
        lengths = torch.zeros(b * n, dtype=torch.long, device=pos.device).scatter_add_(
            0, doc.clamp(min=0).flatten(), torch.ones(b * n, dtype=torch.long, device=pos.device))
        examples = first.sum()
        step = torch.stack([examples, examples * lengths.max(), (pos + 1).sum(), (lengths * lengths).sum()])
        acc = self.device_sums.get(pos.device)
        if acc is None:
            self.device_sums[pos.device] = step
        else:
            acc.add_(step)
        self.steps += 1
        self.rows += b
        self.tokens += b * n
        self.dense_causal += b * n * (n + 1) // 2
        self.dense_full += b * n * n

    def snapshot(self) -> dict[str, Any]:
        """The figures so far (reads the device counters: one synchronisation)."""
        sums = [0, 0, 0, 0]
        for acc in self.device_sums.values():
            sums = [a + b for a, b in zip(sums, acc.tolist())]
        examples, padded, pairs_causal, pairs_full = sums
        out: dict[str, Any] = {"packed_steps": self.steps, "packed_rows": self.rows, "packed_examples": examples,
                               "examples_per_row": examples / self.rows if self.rows else 0.0,
                               "packed_tokens": self.tokens,
                               "padding_tokens_avoided": max(padded - self.tokens, 0) if self.steps else 0}
        causal = sum(c for c, is_causal in self.sites.values() if is_causal or self.causal_model)
        full = sum(c for c, is_causal in self.sites.values() if not (is_causal or self.causal_model))
        block = causal * pairs_causal + full * pairs_full
        dense = causal * self.dense_causal + full * self.dense_full
        out.update({"attention_flops_block_diagonal": block, "attention_flops_dense": dense,
                    "attention_flops_ratio": block / dense if dense else 0.0})
        return out


class _BoundaryHook:
    """Forward pre-hook: boundaries from the call's keyword arguments, checked in the graph."""

    def __init__(self, params: set[str], accepts_kwargs: bool, max_positions: int | None, require: bool,
                 check: bool, model_name: str):
        self.params, self.accepts_kwargs = params, accepts_kwargs
        self.max_positions, self.require, self.check = max_positions, require, check
        self.model_name = model_name
        self.stats = PackingCounters()
        #: attention sites that compiled graphs could not isolate: (graph, site, why); a packed call raises
        self.unisolated: list[tuple[str, str, str]] = []
        self.graphs = 0  #: graphs compiled (names graphs in errors)
        self.pending: torch.Tensor | None = None  #: positions of the call in progress, counted once it returns

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        eager = not torch.compiler.is_compiling()
        if eager:
            self.pending = None
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is True:
            if eager:
                _set_context(None)
            return None  # generation with a cache (decode steps count positions on): not a packed row
        present = [k for k in BOUNDARY_KWARGS if kwargs.get(k) is not None]
        if not present:
            if eager:
                _set_context(None)
            if self.require and module.training:
                raise ValueError(
                    f"pack_sequences: {self.model_name} was called in training without example boundaries: "
                    f"none of {list(BOUNDARY_KWARGS)} was given (keyword arguments: {sorted(kwargs)}). Packed "
                    "rows need them, e.g. DataCollatorWithFlattening(return_position_ids=True); for unpacked "
                    "batches use PackSequences(require_boundaries=False)")
            return None
        kwargs = dict(kwargs)
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if "position_ids" not in present:
            kind = present[0]
            if "position_ids" not in self.params:
                raise ValueError(f"pack_sequences: {self.model_name}.forward takes no position_ids, so its "
                                 f"positions cannot restart per example ({kind} was given)")
            n = ids.shape[-1] if ids is not None else int(kwargs[kind].shape[-1])
            kwargs["position_ids"] = position_ids_from(kind, kwargs[kind], n)
        elif "position_ids" not in self.params and not self.accepts_kwargs:
            raise ValueError(f"pack_sequences: {self.model_name}.forward takes no position_ids, so its positions "
                             "cannot restart per example; supported: models whose forward accepts position_ids")
        pos = kwargs["position_ids"]
        if self.check:
            if pos.dim() != 2:
                raise ValueError(f"pack_sequences: position_ids must be (batch, length), got shape {tuple(pos.shape)}")
            ok = (pos[:, :1] == 0).all() & ((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()
            torch._assert_async(ok, "pack_sequences: position_ids are not restarts of 0..n-1 per example "
                                    "(each example must count 0, 1, ..., len-1)")
            if self.max_positions is not None:
                torch._assert_async((pos < self.max_positions).all(),
                                    f"pack_sequences: an example is longer than the model's maximum of "
                                    f"{self.max_positions} positions")
        if self.unisolated:
            # NOTE(fail closed): a graph compiled earlier has an attention site this pass could not isolate
            raise effpass.WrongResultError(_unisolated_message(self.model_name, self.unisolated))
        if eager:
            _set_context(pos)
        else:  # traced inline into an outer graph: the op sets the context when that graph runs
            pos = kwargs["position_ids"] = pack_context_set(pos)
        for k in ("max_length_q", "max_length_k"):
            # NOTE(recompiles): Python ints that change every step; effpass's kernels do not need them
            kwargs.pop(k, None)
        if "use_cache" in self.params and kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False  # with a cache, HF's masks ignore the boundaries
        if not self.accepts_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        if eager:
            # NOTE(recompiles): run eagerly (its frame is skipped, see _run_top_level_frame_eagerly), so the
            # model's frame is compiled with a symbolic packed length from the first call: no recompile
            # when the length changes. Inlined into an outer trace, Dynamo's automatic dynamic shapes apply.
            _mark_packed_length_dynamic(args, kwargs, pos.shape[-1])
            if torch.is_grad_enabled():  # training steps only: evaluation / generation forwards are not counted
                # NOTE: counted when the forward returned (after_forward): a call that raised (a site the pass
                # could not isolate) is never reported as a packed row
                self.pending = pos
        return args, kwargs

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if self.pending is not None and not torch.compiler.is_compiling():
            self.stats.add(self.pending)
        self.pending = None


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
        mixing = [(n, why) for n, m in ctx.scope.select_modules(model, lambda n, m: _mixes_tokens(m) is not None)
                  for why in [_mixes_tokens(m)]]
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
        max_pos = self.max_positions or _max_positions(model)
        hook = _BoundaryHook(params, accepts_kwargs, max_pos, self.require_boundaries, self.check_inputs,
                             type(model).__name__)
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        after = model.register_forward_hook(hook.after_forward, with_kwargs=True)
        model._effpass_pack_hooks = [handle, after]
        model._effpass_pack_counters = hook.stats
        model._effpass_pack_hook = hook
        can_generate = getattr(model, "can_generate", None)
        hook.stats.causal_model = bool(can_generate()) if callable(can_generate) else False
        eager_hook = _run_top_level_frame_eagerly(_BoundaryHook.__call__)
        _run_top_level_frame_eagerly(_BoundaryHook.after_forward)
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
        sites = [n for n in graph.nodes if _is_sdpa(n) or _is_softmax(n)]
        if not sites:
            return effpass.PassResult(False, stats)
        boundary = _find_boundary(graph)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        new_nodes: list[fx.Node] = []

        def call(fn, *args, **kwargs):
            n = graph.call_function(fn, args, kwargs)
            new_nodes.append(n)
            return n

        prologue: _Prologue | None = None

        def get_prologue(site: fx.Node, like: fx.Node, batch_dim: int, length_dim: int) -> _Prologue:
            nonlocal prologue
            if prologue is None:
                if boundary is not None:
                    kind, bnode = boundary
                    stats[f"boundary_{kind}"] = 1
                    prologue = _Prologue.from_boundary(graph, placeholders, kind, bnode, call)
                else:  # after a graph break: the per-call context the boundary hook set
                    stats["boundary_from_context"] = 1
                    prologue = _Prologue.from_context(graph, site, like, batch_dim, length_dim, call)
            return prologue

        costs: dict[str, tuple[int, bool]] = {}  # attention site -> (FLOPs per attended pair and row, causal)
        unisolated: list[tuple[str, str, str]] = []
        for site in sites:
            where = _where(site)
            try:
                if not ctx.allows(site):
                    if _is_sdpa(site) or _attention_scores(site) is not None:
                        raise Skip("excluded by targets/exclude, but an attention site left alone mixes the "
                                    "packed examples")
                    continue
                if _is_sdpa(site):
                    op = attention_op(site)
                    if not op.maskable:
                        raise Skip(f"{op.owner}'s attention op {getattr(op.target, '__name__', op.target)} takes "
                                   "no other mask (pack_sequences cannot make it block-diagonal); run that pass "
                                   "after packing is off, or use SDPA")
                    q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(site)
                    sq, sk = shape_of(q)[-2], shape_of(k)[-2]
                    pro = get_prologue(site, q, 0, -2)
                    if not (_same(sq, pro.n_len) and _same(sk, pro.n_len)):
                        raise Skip(f"query/key lengths ({sq}, {sk}) are not the packed length {pro.n_len} "
                                    "(decoding with a cache or cross-attention)")
                    stats["positions_per_example"] += _per_example_positions(graph, site, pro, call)
                    q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(site)
                    varlen = self.kernel != "sdpa" and _varlen_usable(q, mask, dropout_p)
                    with graph.inserting_before(site):
                        if varlen:
                            new = call(packed_varlen, q, k, v, pro.doc, is_causal, scale, gqa)
                            stats["varlen"] += 1
                        else:
                            new = call(packed_sdpa, q, k, v, pro.mask(bool(is_causal)), attn_mask=mask,
                                       dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
                    _set_meta([new], site)
                    site.replace_all_uses_with(new)
                    graph.erase_node(site)
                    stats["sdpa_rewritten"] += 1
                    costs[where.rsplit(":", 1)[0] + f"#{len(costs)}"] = (_pair_cost(q, v), bool(is_causal))
                else:
                    found = _attention_scores(site)
                    if found is None:
                        continue  # not attention: a softmax over something else (e.g. MoE routing)
                    scores, extra = found
                    sh = shape_of(scores)
                    pro = get_prologue(site, scores, 0, -2)
                    if not (_same(sh[-1], pro.n_len) and _same(sh[-2], pro.n_len)):
                        raise Skip(f"scores {sh} are not (packed length {pro.n_len})^2 (cross-attention?)")
                    stats["positions_per_example"] += _per_example_positions(graph, site, pro, call)
                    found = _attention_scores(site)
                    scores, extra = found
                    # NOTE(sinks): extra columns concatenated after the N key columns (learned attention
                    # sinks) are not tokens: every row keeps them; only the token columns are masked
                    user = extra if extra is not None else site
                    with graph.inserting_before(user):
                        masked = call(mask_scores, scores, pro.mask(False))
                    _set_meta([masked], site)
                    user.replace_input_with(scores, masked)
                    stats["softmax_masked"] += 1
                    stats["sink_columns_kept"] += int(extra is not None)
                    costs[where.rsplit(":", 1)[0] + f"#{len(costs)}"] = (_scores_pair_cost(scores), False)
            except Skip as e:
                stats["skipped"] += 1
                skipped.append({"site": where, "reason": str(e)})
                unisolated.append((gname, where, str(e)))
        changed = stats["sdpa_rewritten"] + stats["softmax_masked"] > 0
        # FLOPs per attended (query, key) pair and row, summed over this graph's attention sites (static)
        stats["attention_flops_per_pair"] = sum(c for c, _ in costs.values())
        counters = getattr(ctx.model, "_effpass_pack_counters", None)
        if counters is not None and costs:
            # NOTE: keyed by module path, so a recompiled graph replaces its sites and graph pieces add up
            counters.sites.update(costs)
        if unisolated:
            # NOTE(fail closed): never a warning. A packed call in progress raises now; the graph may also
            # serve calls that are not packed (generation), so it is kept, and the boundary hook raises at
            # the next packed call.
            if hook is not None:
                hook.unisolated.extend(unisolated)
            if _CONTEXT.doc is not None or hook is None:
                raise effpass.WrongResultError(_unisolated_message(
                    type(ctx.model).__name__ if ctx.model is not None else "the model", unisolated))
        if changed:
            _set_meta([n for n in new_nodes if "example_value" not in n.meta], None)
            graph.lint()
        return effpass.PassResult(changed, stats, skipped=skipped)


class _Prologue:
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
            _set_meta([self._masks[causal]], None)
        return self._masks[causal]

    def pos_row(self) -> fx.Node:
        """Per-example positions of the (single) packed row, shape ``(N,)``."""
        if self._pos_row is None:
            with self.graph.inserting_after(self._anchor):
                self._pos_row = self.call(_first_row, self.pos)
            _set_meta([self._pos_row], None)
        return self._pos_row

    @classmethod
    def from_boundary(cls, graph, placeholders, kind, bnode, call) -> "_Prologue":
        src = bnode
        if kind in ("cu_seq_lens_q", "cu_seq_lens_k"):
            # NOTE: the packed length N is the tokens' length (cu_seq_lens has one entry per example)
            src = next((n for n in placeholders if _TOKENS_RE.match(str(n.target)) and shape_of(n)), None)
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
        _set_meta([n_len_node, doc, pos], None)
        pro = cls(graph, call, doc, pos, shape_of(src)[dim], pos)
        pro.batch = shape_of(bnode)[0] if kind in ("position_ids", "seq_idx") and shape_of(bnode) else 1
        return pro

    @classmethod
    def from_context(cls, graph, site, like, batch_dim, length_dim, call) -> "_Prologue":
        import operator

        with graph.inserting_before(site):
            both = call(torch.ops.effpass.pack_context_get.default, like, batch_dim, length_dim)
            doc = call(operator.getitem, both, 0)
            pos = call(operator.getitem, both, 1)
        _set_meta([both], None)
        vals = both.meta.get("example_value")
        if isinstance(vals, (tuple, list)) and len(vals) == 2:
            doc.meta["example_value"], pos.meta["example_value"] = vals
        else:
            _set_meta([doc, pos], None)
        pro = cls(graph, call, doc, pos, shape_of(like)[length_dim], pos)
        pro.batch = shape_of(like)[batch_dim]
        return pro


def _first_row(pos: torch.Tensor) -> torch.Tensor:
    return pos[0]


def positions_of(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """Per-example positions ``(1 or B, N)`` from a boundary tensor of kind ``kind``."""
    if kind == "position_ids":
        return boundary.long()
    return position_ids_from(kind, boundary, n).reshape(-1, n)


def _graph_name(graph: fx.Graph, hook) -> str:
    ins = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    listed = ", ".join(ins[:4]) + (", ..." if len(ins) > 4 else "")
    k = f" #{hook.graphs}" if hook is not None else ""
    return f"graph{k} (inputs {listed})"


def _unisolated_message(model_name: str, sites: list[tuple[str, str, str]]) -> str:
    listed = "; ".join(f"{site} in {g}: {why}" for g, site, why in sites[:4])
    more = f" (and {len(sites) - 4} more)" if len(sites) > 4 else ""
    return (f"pack_sequences: {model_name} has attention that could not be made block-diagonal per example, so "
            f"packed examples would attend to each other: {listed}{more}. Avoid it by training this model with "
            "padded batches (no packing), by removing what the reason names, or by leaving these modules out of "
            "the model's attention path; the pass never runs a packed row it did not isolate")


def _where(n: fx.Node) -> str:
    return f"{module_path_of_node(n) or '<root>'}:{n.name}"


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(a == b):
            return True
        # NOTE(dynamic lengths): the boundary's and the tokens' lengths are separate symbols when the model
        # never relates them (Falcon with ALiBi ignores position_ids). Evaluating the comparison guards on
        # it (as Dynamo does when it specialises): equal lengths, the only valid input, reuse the graph.
        return bool(a == b)
    except Exception:
        return False


def _is_sdpa(n: fx.Node) -> bool:
    """A call of a fused attention op with SDPA's signature (the core's registry, :mod:`effpass.attention`:
    SDPA, masked_sdpa and what other passes register). A registered op that takes no extra mask is a site
    too: :meth:`PackSequences.transform_torch_ir` refuses it (it cannot be isolated)."""
    return attention_op(n) is not None


def _softmax_input(sm: fx.Node) -> fx.Node | None:
    """The input of a softmax over the last dim of a tensor of >= 3 dims, else None."""
    x = sm.args[0] if sm.args else sm.kwargs.get("input")
    sh = shape_of(x)
    if sh is None or len(sh) < 3:
        return None
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if not isinstance(dim, int) or dim % len(sh) != len(sh) - 1:
        return None
    return x


def _attention_scores(sm: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """``(scores, None)`` for a softmax over a square ``(..., S, S)`` score matrix; ``(scores, cat)`` for a
    softmax over ``cat([scores, extra], -1)`` where ``scores`` is square (learned attention sinks: N x (N+k));
    None for any other softmax (not attention: MoE routing, ...)."""
    x = _softmax_input(sm)
    if x is None:
        return None
    sh = shape_of(x)
    if _static_same(sh[-1], sh[-2]):
        return x, None
    src = x
    for _ in range(6):  # back through elementwise steps between the cat and the softmax (casts, x - x.max())
        if src.op == "call_function" and src.target in (torch.cat, torch.concat, torch.concatenate):
            break
        nxt = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else None
        if nxt is None or src.op not in ("call_function", "call_method") or shape_of(nxt) != sh:
            return None
        src = nxt
    if src.op == "call_function" and src.target in (torch.cat, torch.concat, torch.concatenate):
        parts = src.args[0] if src.args else src.kwargs.get("tensors")
        dim = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
        if isinstance(parts, (list, tuple)) and parts and isinstance(parts[0], fx.Node):
            ps = shape_of(parts[0])
            if ps is not None and isinstance(dim, int) and dim % len(ps) == len(ps) - 1 and _static_same(ps[-1], ps[-2]):
                return parts[0], src
    return None


def _static_same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _sdpa_args(n: fx.Node):
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
    vals = dict(zip(names, n.args))
    for k, v in n.kwargs.items():
        vals[k] = v
    if "scale" not in vals and len(n.args) > 6:
        vals["scale"] = n.args[6]
    q, k, v = vals.get("query"), vals.get("key"), vals.get("value")
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        raise Skip("q, k or v is not a tensor")
    if shape_of(q) is None or len(shape_of(q)) != 4:
        raise Skip("q is not (batch, heads, length, head_dim)")
    is_causal = vals.get("is_causal", False)
    dropout = vals.get("dropout_p", 0.0)
    if not isinstance(is_causal, bool):
        raise Skip("is_causal is not a constant")
    mask = vals.get("attn_mask")
    if mask is not None and not isinstance(mask, fx.Node):
        raise Skip("attn_mask is not a tensor")
    return q, k, v, mask, dropout, is_causal, vals.get("scale"), bool(vals.get("enable_gqa", False))


def _static(x) -> int:
    try:
        return int(x)
    except Exception:  # a symbolic size with no static value
        return 0


def _pair_cost(q: fx.Node, v: fx.Node) -> int:
    """FLOPs per attended (query, key) pair and row of an SDPA call: ``2*H*D`` for ``q @ k^T`` plus
    ``2*H*Dv`` for ``p @ v``."""
    qs, vs = shape_of(q), shape_of(v)
    return 2 * _static(qs[-3]) * (_static(qs[-1]) + _static(vs[-1] if vs else qs[-1]))


def _scores_pair_cost(scores: fx.Node) -> int:
    """FLOPs per pair and row of hand-written attention: heads from the scores' shape, the head dim from the
    ``q @ k^T`` matmul found by walking back through elementwise ops (scaling, soft-capping)."""
    sh = shape_of(scores)
    heads = _static(sh[-3]) if len(sh) >= 3 else 1
    n, d = scores, 0
    for _ in range(8):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            break
        if n.target in (torch.matmul, torch.bmm, "matmul", "__matmul__") or getattr(n.target, "__name__", "") in (
                "matmul", "bmm", "matmul_"):
            qs = shape_of(n.args[0]) if n.args else None
            d = _static(qs[-1]) if qs else 0
            break
        n = next((a for a in n.args if isinstance(a, fx.Node) and shape_of(a) is not None), None)
    return 4 * heads * d


def _find_boundary(graph: fx.Graph) -> tuple[str, fx.Node] | None:
    found = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _CONTEXT_SET_OPS:  # the hook, traced inline
            return "position_ids", n
        if n.op != "placeholder":
            continue
        m = _PLACEHOLDER_RE.match(str(n.target))
        v = tensor_meta(n)
        if m and isinstance(v, torch.Tensor) and not v.dtype.is_floating_point:
            found[m.group(1)] = n
    # NOTE: position_ids first: its length is the packed length (cu_seq_lens need it separately)
    for kind in ("seq_idx", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kind in found:
            return kind, found[kind]
    return None


def _varlen_usable(q: fx.Node, mask, dropout_p) -> bool:
    """torch's varlen kernel takes this site: CUDA, fp16/bf16, no mask but causal, no dropout, and this torch
    has ``torch.nn.attention.varlen`` (feature-tested)."""
    if mask is not None or (not isinstance(dropout_p, (int, float))) or dropout_p != 0.0:
        return False
    v = tensor_meta(q)
    if not (isinstance(v, torch.Tensor) and v.is_cuda and v.dtype in (torch.float16, torch.bfloat16)):
        return False
    if v.shape[-1] % 8 or v.shape[-1] > 256:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _set_meta(nodes: list[fx.Node], like: fx.Node | None) -> None:
    """Provenance from ``like`` and fake example values for new nodes (best effort: AOT re-traces)."""
    for n in nodes:
        if like is not None:
            copy_provenance(n, like)
        infer_fake_values([n])


# ------------------------------------------------------------------------------------------------------
# per-example positions for masks and scalings computed from absolute row positions (``arange(N)``)
# ------------------------------------------------------------------------------------------------------
_INPLACE_FN = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv", "ifloordiv": "floordiv",
               "iand": "and_", "ior": "or_", "ixor": "xor", "imod": "mod"}
_VIEWS = {"view", "reshape", "unsqueeze", "expand", "expand_as", "to", "contiguous", "clone", "float", "long", "int",
          "type_as", "flatten", "squeeze", "transpose", "permute", "repeat", "__getitem__", "getitem", "detach"}
_CMP = {"lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"}
_LOGIC = {"and_", "or_", "xor", "__and__", "__or__", "__xor__", "invert", "__invert__", "logical_and", "logical_or",
          "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "where", "masked_fill", "abs"}


def _op_of(n: fx.Node) -> str:
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return _INPLACE_FN.get(name, name[:-1] if name.endswith("_") and not name.endswith("__") else name)


def _is_row_arange(n: fx.Node, n_len) -> bool:
    """``torch.arange(N)`` / ``arange(0, N)`` / ``arange(0, N, 1)`` of the packed length: absolute row positions."""
    if n.op != "call_function" or n.target is not torch.arange:
        return False
    sh = shape_of(n)
    if sh is None or len(sh) != 1 or not _same(sh[0], n_len):
        return False
    args = list(n.args)
    start = n.kwargs.get("start", args[0] if len(args) >= 2 else 0)
    step = n.kwargs.get("step", args[2] if len(args) >= 3 else 1)
    return isinstance(start, int) and start == 0 and isinstance(step, int) and step == 1


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _absolute_index(n: fx.Node, dep: set[fx.Node], n_len) -> bool:
    """``n`` indexes a per-token tensor (a dim of the packed length) with a position-derived index: the index
    names a token of the row, so it must stay absolute (a padding mask read at ``kv_idx``)."""
    op = _op_of(n)
    if op in ("getitem", "__getitem__") and len(n.args) >= 2:
        base, idx = n.args[0], n.args[1]
        idx_nodes = [a for a in (idx if isinstance(idx, (tuple, list)) else (idx,)) if isinstance(a, fx.Node)]
        if not any(a in dep for a in idx_nodes) or not isinstance(base, fx.Node):
            return False
    elif op in ("index_select", "gather", "take_along_dim", "index"):
        base = n.args[0] if n.args else None
    else:
        return False
    sh = shape_of(base) if isinstance(base, fx.Node) else None
    return sh is not None and any(_static_same(d, n_len) for d in sh)


def _shift_class(order: list[fx.Node], aranges: set[fx.Node], dep: set[fx.Node], n_len) -> dict[fx.Node, str]:
    """Abstract interpretation: how each position-derived value changes when every absolute position shifts by
    one example's offset: "P" shifts with it, "I" is unchanged (differences, comparisons of two positions, a
    per-token value read at a position), "X" changes otherwise (``pos // chunk``, ``log(pos)``)."""
    cls: dict[fx.Node, str] = {a: "P" for a in aranges}
    for n in order:
        if n in cls or n not in dep:
            continue
        ins = [cls.get(a, "C") for a in n.all_input_nodes]  # "C": does not depend on positions
        op = _op_of(n)
        if _absolute_index(n, dep, n_len):
            c = "I"
        elif "X" in ins:
            c = "X"
        elif op in _VIEWS:
            c = cls.get(n.args[0], "I") if isinstance(n.args[0], fx.Node) else "I"
        elif op in ("add", "__add__", "__radd__"):
            c = "X" if ins.count("P") > 1 else ("P" if "P" in ins else "I")
        elif op in ("sub", "__sub__", "__rsub__"):
            c = "I" if ins.count("P") == 2 else ("P" if "P" in ins else "I")
        elif op in _CMP:
            c = "I" if ins.count("P") in (0, 2) else "X"
        elif op in _LOGIC:
            c = "I" if "P" not in ins else "X"
        else:
            c = "I" if "P" not in ins else "X"
        cls[n] = c
    return cls


def _per_example_positions(graph: fx.Graph, site: fx.Node, pro: "_Prologue", call) -> int:
    """Give the masks and scalings that reach ``site`` from absolute row positions (``arange(N)``, e.g. HF's
    ``cache_position``: a chunked local-attention mask, a position-dependent attention temperature) the
    per-example positions instead: the position-derived nodes between the ``arange`` and the site are copied
    with the positions substituted (indexing a per-token tensor keeps the absolute index), and the site reads
    the copies. Returns the number of ``arange`` nodes substituted. With several packed rows in a call
    (``B > 1``), where one vector cannot stand for every row's positions, only what does not change under a
    shift of positions (differences, comparisons of two positions: causal and sliding-window masks) is left
    as is; anything else raises :class:`Skip`."""
    anc = _ancestors(site)
    aranges = {n for n in anc if _is_row_arange(n, pro.n_len)}
    if not aranges:
        return 0
    dep = set(aranges)
    order = [n for n in graph.nodes if n in anc]
    for n in order:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    site_ins = [a for a in site.all_input_nodes if a in dep]
    if not site_ins:
        return 0
    batch = pro.batch
    if not (isinstance(batch, int) and batch == 1):
        cls = _shift_class(order, aranges, dep, pro.n_len)
        bad = [a.name for a in site_ins if cls.get(a) in ("P", "X")]
        if bad:
            raise Skip(f"its mask or scaling ({', '.join(bad)}) is computed from absolute row positions "
                        "(arange over the packed row) in a way that differs per example (e.g. chunked local "
                        f"attention, a position-dependent temperature), and the call packs {batch} rows: per-example "
                        "positions can stand in only with one packed row per call (DataCollatorWithFlattening and "
                        "TRL padding_free make one row)")
        return 0
    subst: dict[fx.Node, fx.Node] = {}
    row = pro.pos_row()
    for a in aranges:
        dtype = getattr(tensor_meta(a), "dtype", torch.long)
        if dtype == torch.long:
            subst[a] = row
        else:
            with graph.inserting_before(site):
                subst[a] = call(torch.Tensor.to, row, dtype)
            _set_meta([subst[a]], a)
    for n in order:
        if n in aranges or n not in dep or not any(i in subst for i in n.all_input_nodes):
            continue
        if _absolute_index(n, dep, pro.n_len):
            continue  # reads a per-token tensor at a token of the row: stays absolute
        # NOTE: copies go right before the site: after their inputs (ancestors of the site) and after the
        # positions (which, read from the per-call context, may come after the original arange)
        with graph.inserting_before(site):
            copy = graph.node_copy(n, lambda x: subst.get(x, x))
        name = copy.target if isinstance(copy.target, str) else getattr(copy.target, "__name__", "")
        if name in _INPLACE_FN:  # NOTE: never mutate the per-example positions in place
            import operator

            copy.target = getattr(operator, _INPLACE_FN[name])
        elif copy.op == "call_method" and name.endswith("_") and not name.endswith("__"):
            copy.target = name[:-1]
        elif copy.op == "call_function" and name.endswith("_") and not name.endswith("__") and hasattr(torch, name[:-1]):
            copy.target = getattr(torch, name[:-1])
        subst[n] = copy
    site.args = fx.node.map_arg(site.args, lambda x: subst.get(x, x))
    site.kwargs = fx.node.map_arg(site.kwargs, lambda x: subst.get(x, x))
    return len(aranges)
