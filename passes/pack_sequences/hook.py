"""``pack_sequences``'s module phase: refuse token-mixing layers, the boundary hook, the packing counters.

The forward pre-hook reads the example boundaries from the call (``position_ids`` that restart at 0,
``cu_seq_lens_q``/``cu_seq_lens_k`` or ``seq_idx``), checks them in the graph (``torch._assert_async``, no host
sync), sets the per-call packing context (:mod:`._pack_ops`) and counts packed rows on the inputs' device
(:class:`PackingCounters`). :func:`packing_stats` gives the same figures for one batch on the host.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import effpass

from .ops import document_ids, pack_context_set, position_ids_from, set_context

__all__ = ["BOUNDARY_KWARGS", "packing_stats", "PackingCounters", "BoundaryHook", "mixes_tokens", "max_positions",
           "run_top_level_frame_eagerly", "unisolated_message"]

#: keyword arguments that carry example boundaries, in order of preference
BOUNDARY_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "position_ids")


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
def mixes_tokens(module: nn.Module) -> str | None:
    """Why ``module`` mixes tokens across positions outside attention, or None."""
    if isinstance(module, nn.RNNBase):
        return f"recurrent layer {type(module).__name__}"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        ks = module.kernel_size
        if any(s > 1 for s in ks):
            return f"convolution {type(module).__name__} with kernel {tuple(ks)}"
    return None


def max_positions(model: nn.Module) -> int | None:
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


def run_top_level_frame_eagerly(fn) -> bool:
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


class BoundaryHook:
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
                set_context(None)
            return None  # generation with a cache (decode steps count positions on): not a packed row
        present = [k for k in BOUNDARY_KWARGS if kwargs.get(k) is not None]
        if not present:
            if eager:
                set_context(None)
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
            raise effpass.WrongResultError(unisolated_message(self.model_name, self.unisolated))
        if eager:
            set_context(pos)
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
            # NOTE(recompiles): run eagerly (its frame is skipped, see run_top_level_frame_eagerly), so the
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



def unisolated_message(model_name: str, sites: list[tuple[str, str, str]]) -> str:
    listed = "; ".join(f"{site} in {g}: {why}" for g, site, why in sites[:4])
    more = f" (and {len(sites) - 4} more)" if len(sites) > 4 else ""
    return (f"pack_sequences: {model_name} has attention that could not be made block-diagonal per example, so "
            f"packed examples would attend to each other: {listed}{more}. Avoid it by training this model with "
            "padded batches (no packing), by removing what the reason names, or by leaving these modules out of "
            "the model's attention path; the pass never runs a packed row it did not isolate")

