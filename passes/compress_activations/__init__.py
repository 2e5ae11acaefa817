"""``compress_activations``: tensors saved for backward kept in int8 (or fp8 e4m3) with per-group scales,
decoded in backward (lossy; opt in).

What it does
    Every intermediate the partitioner saves between the forward and the backward graph (what the
    backward reads; parameters, graph inputs and outputs are left alone) is quantized where the forward
    has finished with it and dequantized just before the backward first reads it. Quantization is
    per group of ``group`` consecutive elements of the contiguous tensor (along the last dimension when it
    is a multiple of ``group``), absmax scaled: ``scale = absmax / 127`` and ``q = round(x / scale)`` in
    int8, or ``scale = absmax / 448`` and ``q = fp8_e4m3(x / scale)``; the scale is kept in fp32.

    torch's own machinery does the graph surgery: AOTAutograd inlines *traceable* saved-tensor hooks
    (``torch.autograd.graph.saved_tensors_hooks`` whose pack and unpack are ``fx.GraphModule``s) into the
    partitioned graphs, the pack hook as an epilogue of the forward and the unpack hook as a prologue of
    the backward, for the saved intermediates only (``functorch.config.saved_tensors_hooks_filtering_mode
    = "donated"``). The pass pushes such hooks around the lowering (``Pass.lowering_context``: compile time
    only, nothing runs at step time but the graphs), then, in the post-grad phase, moves each
    ``effpass.compress_saved`` right after the forward's last use of its input (so the full-precision
    tensor is freed there, not at the end of the forward) and each ``effpass.decompress_saved`` right before
    the backward's first use (so decoded tensors do not all exist at the backward's start).

Which tensors (decided per saved tensor, from its value; skipped ones are listed with the reason)
    Floating (fp32/bf16/fp16), contiguous, static shape, at least ``min_elements`` elements and a multiple
    of ``group``; inside ``targets``/``exclude`` (the module of the node that made it). Small tensors (a
    norm's rstd, attention's logsumexp: 1/hidden of the activations) are left: their scales would cost
    more than the saving.

Exactness (lossy; the forward is unchanged, so the loss is exact)
    Each decoded element: ``|x_hat - x| <= absmax_g / 254`` (int8: half a step of ``absmax_g / 127``) or
    ``<= absmax_g / 16`` (fp8 e4m3: 3 mantissa bits, half an ulp is 2^-4 of the value, and subnormals err
    by at most 2^-10 of the scale), plus the rounding of a bf16/fp16 result (half an ulp of ``x``);
    ``absmax_g`` is the absolute maximum of the element's group. Gradients computed from a compressed
    tensor inherit it linearly: a linear layer's weight gradient ``dW = dy^T x`` errs elementwise by at most
    ``sum_t |dy_ti| * absmax_g(t,j) / 254`` (tested exactly); whole-model figures are in docs/passes/compress_activations.md.

Phases
    ``lowering_context`` (the hooks), ``post_grad`` (placement; statistics).

Statistics (per graph)
    ``compressed`` (saved tensors compressed), ``saved_tensors``, ``saved_bytes_before`` /
    ``saved_bytes_after`` (activation bytes saved for backward, each storage once, storage-true: int8 codes
    plus fp32 scales), ``compressed_bytes_before`` / ``compressed_bytes_after`` (the compressed ones only),
    ``skipped`` with reasons.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx

import effpass
from effpass.graph import is_primal, is_tangent, module_path_of_node, tensor_meta
from effpass.graph_figures import storage_key as _storage_key, storage_nbytes as _storage_nbytes
from effpass.scope import glob_match

__all__ = ["CompressActivations", "compress", "decompress", "element_error_bound"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = getattr(torch, "float8_e4m3fn", None)
#: largest finite value of each code format
_QMAX = {"int8": 127.0, "fp8": 448.0}


# ------------------------------------------------------------------------------------------------------
# the codec (custom ops: one node each in the graphs, so the pass can place them)
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::compress_saved", mutates_args=())
def compress(x: torch.Tensor, group: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (contiguous, numel a multiple of ``group``) -> (codes (n/group, group), fp32 scales (n/group, 1))."""
    g = x.reshape(-1, group).float()
    amax = g.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX[fmt], torch.ones_like(amax))
    if fmt == "int8":
        q = torch.round(g / scale).clamp_(-127, 127).to(torch.int8)
    else:
        q = (g / scale).clamp_(-448.0, 448.0).to(_FP8)
    return q, scale


@compress.register_fake
def _(x, group, fmt):
    n = x.numel() // group
    return (x.new_empty((n, group), dtype=torch.int8 if fmt == "int8" else _FP8),
            x.new_empty((n, 1), dtype=torch.float32))


@torch.library.custom_op("effpass::decompress_saved", mutates_args=())
def decompress(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes and scales -> values of ``dtype``, shaped (n/group, group) (the caller reshapes)."""
    return (q.float() * scale).to(dtype)


@decompress.register_fake
def _(q, scale, dtype):
    return q.new_empty(q.shape, dtype=dtype)


def element_error_bound(x: torch.Tensor, group: int, fmt: str = "int8") -> torch.Tensor:
    """Per element of ``x``: the bound on ``|decoded - x|`` stated in the module docstring."""
    amax = x.reshape(-1, group).float().abs().amax(dim=1, keepdim=True).expand(-1, group)
    b = amax / (2 * _QMAX["int8"]) if fmt == "int8" else amax / 16.0
    b = b * (1 + 1e-6)  # the division and multiplication in fp32
    if x.dtype != torch.float32:
        b = b + x.reshape(-1, group).float().abs() * (torch.finfo(x.dtype).eps / 2) + b * torch.finfo(x.dtype).eps
    return b.reshape(x.shape)


# ------------------------------------------------------------------------------------------------------
# the hooks AOTAutograd inlines
# ------------------------------------------------------------------------------------------------------
class _Hook(fx.GraphModule):
    """A saved-tensor hook AOTAutograd accepts for inlining (it must be an ``fx.GraphModule``); it is
    traced per saved tensor, so it may decide from the tensor which graph it adds."""

    def __init__(self, fn):
        super().__init__(torch.nn.Module(), fx.Graph())
        self._fn = fn

    def __call__(self, *args):
        return self._fn(*args)


def _hook_info() -> dict:
    """What torch tells a pack hook about the saved value: ``_node`` (the forward node), ``_fw_graph``,
    ``_bw_graph`` (torch 2.13 has it; an empty dict where torch has none)."""
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:
        return {}
    return _get_saved_tensor_hook_context() or {}


def _match_rng_state_names(info: dict) -> None:
    """NOTE(torch-bug): when the partitioner functionalizes recomputed random ops (checkpointing over a
    dropout, even with p=0), the forward returns the RNG state as ``getitem_N`` while the backward takes it
    as ``rng_state_output_K``; AOTAutograd's hook inlining pairs saved values by name and fails ("could not
    find saved tensor ... in bw_g_inputs"). Saved values are passed positionally, so the unmatched names are
    paired in order and the backward's placeholders renamed to the forward's. Remove when torch names them
    alike (seen on torch 2.13)."""
    node, fw, bw = info.get("_node"), info.get("_fw_graph"), info.get("_bw_graph")
    if node is None or fw is None or bw is None:
        return
    bw_in = [p for p in bw.find_nodes(op="placeholder") if not is_tangent(p)]
    if any(p.name == node.name for p in bw_in):
        return
    bw_names = {p.name for p in bw_in}
    lone_fw = [o for o in fw.output_node().args[0] if isinstance(o, fx.Node) and o.name not in bw_names
               and o.target is operator.getitem and isinstance(o.args[0], fx.Node)
               and _is_rng_state_op(o.args[0].target)]
    lone_bw = [p for p in bw_in if p.name.startswith("rng_state_output")]
    if node not in lone_fw or len(lone_fw) != len(lone_bw):
        return  # not the known mismatch: let torch report it
    for o, p in zip(lone_fw, lone_bw):
        for q in bw.nodes:
            if q.name == o.name:  # a backward-internal node of the same name: names are local, move it aside
                if q.op == "placeholder":
                    return
                q._rename(f"{o.name}_bw")
        # the namespace keeps every name it handed out, so ``_rename`` would pick "<name>_N": set it directly
        p.name = o.name
        bw._graph_namespace._rename_object(p, o.name)
        p.target = o.name
    bw.owning_module.recompile() if bw.owning_module is not None else None


def _is_rng_state_op(target) -> bool:
    name = str(getattr(target, "_name", "")) or str(getattr(target, "__name__", "")) or type(target).__name__
    return "run_and_save_rng_state" in name or type(target).__name__ == "RunAndSaveRngState"


def _inline_supported() -> bool:
    try:
        from torch._functorch._aot_autograd.graph_compile import maybe_inline_graph_saved_tensors_hooks  # noqa: F401
        from torch._functorch._aot_autograd.utils import saved_tensors_hooks_are_inlineable  # noqa: F401
    except ImportError:
        return False
    return True


@effpass.register_pass("compress_activations", run_after=("checkpoint_activations", "tile_sequence",
                                                          "apply_autocast", "offload_activations"))
@dataclass(frozen=True, kw_only=True)
class CompressActivations(effpass.Pass):
    """Saved-for-backward activations kept in int8 / fp8 with per-group absmax scales (lossy).

    Forward graph, before (a Llama MLP saves ``mm`` and ``silu`` for its backward)::

        mm = aten.mm(x, w_gate); silu = aten.silu(mm); ...
        return (out, mm, silu)                       # saved: 2 x (S, F) fp32

    After ``CompressActivations()``::

        mm = aten.mm(x, w_gate); silu = aten.silu(mm)
        c = effpass.compress_saved(mm, 128, 'int8'); mm_hook_0 = c[0]; mm_hook_1 = c[1]   # after mm's last use
        ...
        return (out, mm_hook_0, mm_hook_1, silu_hook_0, silu_hook_1)   # (S*F/128, 128) int8 + (S*F/128, 1) fp32

    Backward, before its first use: ``mm = effpass.decompress_saved(mm_hook_0, mm_hook_1, float32).view(S, F)``.
    """

    format: Literal["int8", "fp8"] = field(default="int8", metadata={
        "doc": "code format: 'int8' (absmax/127 steps) or 'fp8' (float8_e4m3fn, absmax/448 scale)"})
    group: int = field(default=128, metadata={
        "doc": "elements per scale (consecutive in memory: along the last dimension when it is a multiple)"})
    min_elements: int = field(default=4096, metadata={
        "doc": "saved tensors with fewer elements are left as they are (their scales would eat the saving)"})

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: lossy, so tried only when ``allow`` names it."""
        return [effpass.MemoryOption(technique="compress_activations", options={"format": "int8"}, lossless=False,
                                     group="activation_compression", changes="activations", label="compress(int8)",
                                     cost="int8 codes + fp32 scale per 128 saved elements (~0.26x fp32, ~0.52x "
                                          "bf16); quantize in forward, dequantize in backward")]

    @classmethod
    def default_note(cls) -> str:
        return "off (lossy: gradients change within a stated bound; opt in)"

    def validate(self) -> None:
        if self.group < 2:
            raise ValueError(f"compress_activations.group: {self.group!r} must be an integer >= 2 (e.g. 32, 64, 128)")
        if self.min_elements < self.group:
            raise ValueError(f"compress_activations.min_elements: {self.min_elements!r} must be >= group ({self.group})")
        if self.format == "fp8" and _FP8 is None:
            raise ValueError(f"compress_activations.format: 'fp8' needs torch.float8_e4m3fn, absent in torch "
                             f"{torch.__version__}; use format='int8'")

    def verify_tolerance(self) -> float:
        # per gradient tensor (verify's measure): up to 1.4% measured with int8 on the tiny Llama (global 0.5%)
        return 0.02 if self.format == "int8" else 0.15

    # -- which tensors ----------------------------------------------------------------------------------
    def skip_reason(self, val: Any, node: fx.Node | None) -> str | None:
        """Why a saved tensor is left uncompressed (None: it is compressed)."""
        if not isinstance(val, torch.Tensor):
            return "not a tensor"
        if val.dtype not in _FLOATS:
            return f"dtype {val.dtype} (only fp32/bf16/fp16 are compressed)"
        if not all(isinstance(s, int) for s in val.shape):
            return "symbolic shape"
        if not val.is_contiguous():
            return "not contiguous (the decoded tensor would not have the saved strides)"
        if val.numel() < self.min_elements:
            return f"small: {val.numel()} elements < min_elements={self.min_elements}"
        if val.numel() % self.group:
            return f"{val.numel()} elements not a multiple of group={self.group}"
        if node is not None and (self.targets or self.exclude):
            path = module_path_of_node(node)
            if self.targets and not glob_match(path, self.targets):
                return f"module {path!r} outside targets"
            if glob_match(path, self.exclude):
                return f"module {path!r} excluded"
        return None

    # -- lowering: the hooks --------------------------------------------------------------------------
    def lowering_context(self, ctx):
        if not _inline_supported():
            raise RuntimeError(f"compress_activations needs AOTAutograd's inlining of saved-tensor hooks "
                               f"(torch >= 2.8); torch {torch.__version__} has none")
        group, fmt = self.group, self.format

        def pack(x):
            info = _hook_info()
            _match_rng_state_names(info)
            if self.skip_reason(x, info.get("_node")) is not None:
                return x
            q, scale = torch.ops.effpass.compress_saved(x.contiguous(), group, fmt)
            return q, scale, tuple(x.shape), x.dtype

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            q, scale, shape, dtype = packed
            return torch.ops.effpass.decompress_saved(q, scale, dtype).view(shape)

        return torch.autograd.graph.saved_tensors_hooks(_Hook(pack), _Hook(unpack))

    # -- post-grad: placement and statistics ------------------------------------------------------------
    def transform_post_grad(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        if ctx.graph_kind == "forward":
            return self._place_forward(gm, ctx)
        if ctx.graph_kind == "backward":
            return self._place_backward(gm, ctx)
        return None

    def _place_forward(self, gm, ctx):
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        originals: dict[str, tuple[Any, int]] = {}
        moved = 0
        for c in list(graph.find_nodes(op="call_function", target=torch.ops.effpass.compress_saved.default)):
            x = c.args[0]
            val = tensor_meta(x)
            for u in c.users:
                originals[u.name] = (_storage_key(val), _storage_nbytes(val))
            # NOTE(placement): AOTAutograd puts the pack hook at the forward's end, where every saved tensor
            # is still alive in full precision; right after the input's last other use it frees it early.
            others = [u for u in x.users if u is not c and u.op != "output"]
            last = max(others, key=order.__getitem__) if others else x
            if order[last] + 1 != order[c]:
                last.append(c)
                anchor = c
                for g in list(c.users):
                    anchor.append(g)
                    anchor = g
                moved += 1
        ctx.leave(_Compressed(originals=originals, primal_storages=frozenset(
            _storage_key(tensor_meta(n)) for n in graph.find_nodes(op="placeholder")
            if isinstance(tensor_meta(n), torch.Tensor))))
        if moved:
            graph.lint()
            gm.recompile()
        return effpass.PassResult(changed=bool(moved), stats={"moved_compress": moved})

    def _place_backward(self, gm, ctx):
        note = ctx.read(_Compressed)
        if note is None:
            return None
        graph = gm.graph
        moved = 0
        for d in list(graph.find_nodes(op="call_function", target=torch.ops.effpass.decompress_saved.default)):
            chain = [d] + [u for u in d.users if u.op == "call_function" and u.target in _VIEWS]
            order = {n: i for i, n in enumerate(graph.nodes)}
            users = [u for n in chain for u in n.users if u not in chain]
            if not users:
                continue
            first = min(users, key=order.__getitem__)
            if order[chain[-1]] + 1 != order[first]:
                for n in chain:
                    first.prepend(n)
                moved += 1
        saved = [n for n in graph.find_nodes(op="placeholder") if not is_tangent(n)]
        codes = {n for n in saved if n.name in note.originals}
        exclude = set(note.primal_storages)
        before: dict[Any, int] = {}
        after: dict[Any, int] = {}
        comp_before: dict[Any, int] = {}
        comp_after: dict[Any, int] = {}
        skipped = []
        for n in saved:
            val = tensor_meta(n)
            if not isinstance(val, torch.Tensor) or is_primal(n):
                continue
            key = _storage_key(val)
            if key in exclude:
                continue
            after[key] = _storage_nbytes(val)
            if n in codes:
                okey, obytes = note.originals[n.name]
                before[okey] = obytes
                comp_before[okey] = obytes
                comp_after[key] = _storage_nbytes(val)
            else:
                before[key] = _storage_nbytes(val)
                reason = self.skip_reason(val, n) or ("not an intermediate of this graph (an input's, parameter's "
                                                      "or output's storage): torch's hook filter leaves it")
                skipped.append({"site": n.name, "reason": reason})
        if moved:
            graph.lint()
            gm.recompile()
        stats = {"compressed": len(comp_before), "saved_tensors": len(after), "saved_bytes_before": sum(before.values()),
                 "saved_bytes_after": sum(after.values()), "compressed_bytes_before": sum(comp_before.values()),
                 "compressed_bytes_after": sum(comp_after.values()), "moved_decompress": moved,
                 "skipped": len(skipped)}
        return effpass.PassResult(changed=bool(moved), stats=stats, skipped=skipped)


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


@dataclass(frozen=True)
class _Compressed(effpass.Note):
    """Left by the forward's post-grad hook for the backward's: each code tensor's original storage
    (key, bytes), and the storages of the forward's inputs (not activations)."""

    originals: dict
    primal_storages: frozenset
