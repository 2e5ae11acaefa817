"""``quantize_linear``: store linear weights in int8, NF4 (double quantization) or int4, or run their
matmuls in fp8. Built on torchao's tensor subclasses; ``nn.Linear`` modules stay in place.

Phase: module only (``prepare_module``). Quantized weights are state that must exist before the optimizer
is built and that ``state_dict()`` must carry, so they are made on the eager model, not inside a graph
(see torch-facts "Therefore state that must exist before the optimizer ...").

Each in-scope ``nn.Linear`` keeps its class, its place and its ``bias``; only ``.weight`` changes, to a
frozen tensor subclass (``_quant_formats``) that keeps the original ``dtype`` and ``shape``, so model code
reading ``module.weight.dtype`` (T5) keeps working:

* int8: torchao's ``Int8Tensor`` (``Int8WeightOnlyConfig``'s format) as :class:`Int8WeightTensor`;
* nf4: torchao's ``NF4Tensor`` (``to_nf4``: QLoRA NF4, double quantization) as :class:`NF4WeightTensor`;
* int4: torchao's ``Int4TilePackedTo4dTensor`` (tinygemm) on CUDA for bf16 weights; elsewhere effpass's own
  group-wise format (torchao 0.18 has no CPU int4 kernel), with a Triton kernel on CUDA;
* fp8: the module becomes torchao's ``Float8Linear`` (float8 training, ``torchao.float8``; weight unchanged
  and trainable), optionally with FSDP2 fp8 all-gather.

``F.linear`` on a quantized weight is differentiable with respect to the input (the weight is frozen), so
the prepared eager model and the compiled one compute the same function and LoRA adapters on top train
(QLoRA). Also handled:

* ``nn.Linear`` subclasses with their own ``forward`` (Falcon's ``FalconLinear``): a probe checks that the
  forward computes ``F.linear(x, weight, bias)``; then the instance's class becomes a subclass of its class
  with ``nn.Linear.forward`` (``isinstance`` still holds) and the weight is quantized. Otherwise skipped.
* GPT-2's ``Conv1D`` (weight ``[in, out]``, ``addmm``): replaced by an ``nn.Linear`` holding the
  transposed weight (as bitsandbytes' integration does), then quantized.
* MoE experts kept as 3-D parameters (transformers 5, every layout: ``[experts, out, in]`` read with
  ``F.linear(x, w[e])``, GPT-OSS's transposed ``x @ w[e] + b[e]``, Llama 4's ``bmm``): int8 and NF4 quantize
  them per expert (``_quant_experts.ExpertsWeightTensor``) and switch transformers' experts implementation
  to the ``"eager"`` loop where it has one; a probe checks the experts' output. int4 and fp8 list them as
  skipped with the reason.

Ordering: no ``run_after``. ``inject_lora`` runs after this pass (QLoRA): the quantized ``nn.Linear`` is a
plain linear base for it, marked ``__effpass_linear__ = True`` so that merging an adapter into it is
refused. ``wrap_fsdp`` runs after every module pass.

Modules: this one (the pass: options, scope, the per-linear loop, the joint-graph recompute marks),
``_quant_linear`` (fp8 modules, outlier columns, linear subclasses and Conv1D, module-tree edits),
``_quant_expert_sites`` (the MoE experts path and its probe), ``_quant_formats`` / ``_quant_experts`` (the
weight formats) and ``_quant_kernels`` (the int4 Triton kernel).

Invariants: a quantized linear's ``state_dict`` holds its quantized weight (a tensor subclass), the bias
and, with ``outlier_threshold``, the outlier columns; loading it into a model prepared with the same
options reproduces the outputs bit for bit. Every candidate (linear, linear subclass, Conv1D, expert
tensor) appears in ``stats["modules"]`` as quantized or skipped with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

import effpass
from effpass.graph import parameter_only_nodes, val
from effpass.linear_like import direct_weight_read
from effpass.quantized import is_quantized, storage_bytes
from effpass.scope import glob_match_within

from .expert_sites import expert_tensors, quantize_experts
from .linear import (conv1d_class, dequantized_weight, float8_linear, fp8_supported, is_float8_linear,
                            outlier_hook, outlier_load_pre_hook, probe_matches, set_submodule,
                            weight_problem, with_linear_forward)

SCHEMES = ("int8", "int4", "nf4", "fp8")
KERNELS = ("auto", "torchao", "triton")

# also readable here, loaded on first use (module __getattr__): Fp8Linear (torchao's Float8Linear), NF4_CODE,
# nf4_code_from_normal_quantiles, sqnr, Int8WeightTensor, NF4WeightTensor, Int4WeightTensor, ExpertsWeightTensor
__all__ = ["QuantizeLinear", "fp8_supported", "dequantized_weight", "is_quantized"]

# NOTE(import hygiene): torchao (and the formats built on it) load when the pass first runs, or when one of
# these names is first read, never on ``import effpass.passes``.
_FORMAT_NAMES = ("NF4_CODE", "INT4_KERNELS", "Int4WeightTensor", "Int8WeightTensor", "NF4WeightTensor",
                 "dequantize_weight", "int8pack_applies", "nf4_code_from_normal_quantiles", "nf4_scaler_block",
                 "sqnr", "to_nf4_weight")


def _formats():
    from . import formats as _quant_formats

    return _quant_formats


def _experts_formats():
    from . import experts as _quant_experts

    return _quant_experts


def __getattr__(name: str):
    if name in _FORMAT_NAMES:
        return getattr(_formats(), name)
    if name == "ExpertsWeightTensor":
        return _experts_formats().ExpertsWeightTensor
    if name == "Fp8Linear":
        from effpass.quantized import quiet_torchao_import

        with quiet_torchao_import():
            from torchao.float8.float8_linear import Float8Linear

        return Float8Linear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("quantize_linear")
@dataclass(frozen=True, kw_only=True)
class QuantizeLinear(effpass.Pass):
    """Quantize linear weights in place (int8 / NF4 via torchao, int4) or run their matmuls in fp8.

    Before (module tree)::

        q_proj: Linear(64 -> 64)   weight: Tensor fp32 [64, 64]                            16 KiB
    After ``QuantizeLinear(scheme="nf4")``::

        q_proj: Linear(64 -> 64)   weight: NF4WeightTensor (torchao NF4Tensor) fp32 [64, 64] ~2.1 KiB
    ``forward(x) = F.linear(x, weight, bias)``: the subclass computes ``x @ dequant(W).T`` (or a kernel
    computing the same).
    """

    scheme: Literal["int8", "int4", "nf4", "fp8"] = field(default="int8", metadata={
        "doc": "int8: torchao Int8Tensor, per-output-channel symmetric; nf4: torchao NF4Tensor (QLoRA, block 64, "
               "double quantization); int4: group-wise asymmetric (own format); fp8: e4m3 matmuls, weight kept"})
    group_size: int = field(default=128, metadata={"doc": "int4: input features per scale/zero point"})
    block_size: int = field(default=64, metadata={"doc": "nf4: weights per absmax constant"})
    double_quant: bool = field(default=True, metadata={
        "doc": "nf4: quantize the absmax constants to int8 per 256 (QLoRA); torchao's NF4 always does, so "
               "only True is valid"})
    kernel: Literal["auto", "torchao", "triton"] = field(default="auto", metadata={
        "doc": "auto: effpass's fastest path (int8: aten int8pack for CPU bf16/fp16 inference; nf4: pair-table "
               "dequantize; int4: Triton on CUDA); torchao: torchao's own linear (int8, nf4; int4: tinygemm on CUDA bf16, "
               "inference only: no backward); triton: int4 only"})
    outlier_threshold: float = field(default=0.0, metadata={
        "doc": "keep input-feature columns whose max |w| exceeds this many std of the weight in high "
               "precision (LLM.int8 idea); 0 disables"})
    fp8_granularity: Literal["tensorwise", "rowwise"] = field(default="rowwise", metadata={
        "doc": "fp8: one scale per tensor or per row (per token / per output channel)"})
    fp8_emulate: bool = field(default=False, metadata={
        "doc": "fp8: emulate the fp8 casts with plain matmuls on any device (for tests only)"})
    fp8_fsdp_all_gather: bool = field(default=False, metadata={
        "doc": "fp8 (tensorwise): FSDP2 all-gathers the weights in fp8 (torchao's enable_fsdp_float8_all_gather); "
               "call torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model) after each optimizer step"})
    experts: bool = field(default=True, metadata={
        "doc": "MoE expert weights (3-D parameters): quantize them (int8, nf4) or list them as skipped"})

    @classmethod
    def default_note(cls) -> str:
        return "off (lossy: opt in with QuantizeLinear(scheme=...))"

    @classmethod
    def memory_options(cls, model=None, *, world_size=1):
        """For the memory planner: an NF4 or int8 frozen base under LoRA adapters (lossy; the output head
        stays in full precision, as QLoRA keeps it)."""
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        exclude = [n for n, m in model.named_modules() if head is not None and m is head and n] if model else []
        return [effpass.MemoryOption(technique=s, options={"scheme": s, "exclude": exclude}, lossless=False,
                                     group="base_weights", changes="parameters", phase="module",
                                     requires=("inject_lora",), label=f"{s} base", order=i,
                                     cost=f"dequantizes the {s} base weights in every matmul")
                for i, s in enumerate(("int8", "nf4"))]

    def validate(self) -> None:
        for name in ("group_size", "block_size"):
            v = getattr(self, name)
            if v <= 0 or v % 2:
                raise ValueError(f"quantize_linear: {name} must be a positive even number, got {v}")
        if self.outlier_threshold < 0:
            raise ValueError(f"quantize_linear: outlier_threshold must be >= 0 (0 disables), got {self.outlier_threshold}")
        if not self.double_quant:
            raise ValueError("quantize_linear: double_quant=False is not available: NF4 weights are torchao NF4Tensors, "
                             "which always double-quantize their absmax constants (QLoRA's default, ~0.127 bits per "
                             "weight); use double_quant=True")
        valid_kernels = {"int8": ("auto", "torchao"), "nf4": ("auto", "torchao"), "int4": ("auto", "triton", "torchao"),
                         "fp8": ("auto",)}[self.scheme]
        if self.kernel not in valid_kernels:
            raise ValueError(f"quantize_linear: kernel={self.kernel!r} does not apply to scheme={self.scheme!r}; "
                             f"valid kernels for it: {list(valid_kernels)}")
        if self.scheme == "fp8" and self.outlier_threshold:
            raise ValueError("quantize_linear: outlier_threshold applies to int8/int4/nf4, not scheme='fp8'")
        if self.fp8_emulate and self.scheme != "fp8":
            raise ValueError(f"quantize_linear: fp8_emulate=True needs scheme='fp8', got {self.scheme!r}")
        if self.fp8_fsdp_all_gather and (self.scheme != "fp8" or self.fp8_granularity != "tensorwise"):
            raise ValueError("quantize_linear: fp8_fsdp_all_gather=True needs scheme='fp8' with "
                             f"fp8_granularity='tensorwise' (torchao supports fp8 all-gather for tensorwise scales "
                             f"only), got scheme={self.scheme!r}, fp8_granularity={self.fp8_granularity!r}")

    # -- the joint graph: recompute dequantized weights rather than save them ------------------------
    def transform_joint(self, gm: torch.fx.GraphModule, ctx) -> effpass.PassResult | None:
        """Mark the ops that compute a weight from quantized parameters alone (dequantization, its casts and
        views) ``MUST_RECOMPUTE``: the backward recomputes them from the quantized parameters (as the eager
        autograd functions do) instead of keeping a full-precision copy of every weight from the forward to
        the backward. Without it AOTAutograd's CSE merges the backward's dequantization into the forward's
        and the partitioner saves the dequantized weights (measured: +51 MiB at 4 layers of hidden 512)."""
        from torch.utils.checkpoint import CheckpointPolicy

        if ctx.graph_kind != "joint":
            return None
        found = parameter_only_nodes(gm.graph, ctx.parameter_inputs)
        if found is None:
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "the joint graph's inputs could not be "
                                                "matched to the model's parameters: dequantized weights are left "
                                                "to the partitioner"}])
        derived, params = found
        quantized = {p for p in params if isinstance(val(p), torch.Tensor)
                     and not val(p).is_floating_point()}
        from_quantized: set = set(quantized)
        marked = 0
        for n in gm.graph.nodes:
            if n not in derived or not any(i in from_quantized for i in n.all_input_nodes):
                continue
            from_quantized.add(n)
            v = val(n)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                marked += 1
        if not marked:
            return None
        return effpass.PassResult(changed=True, stats={"dequant_recompute_nodes": marked})

    # -- what can be quantized -----------------------------------------------------------------------
    def _shape_problem(self, k: int, n: int, numel: int) -> str | None:
        if self.scheme == "int4" and k % self.group_size:
            return f"in_features={k} is not divisible by group_size={self.group_size}"
        if self.scheme == "nf4" and k % self.block_size:
            return f"in_features={k} is not divisible by block_size={self.block_size}"
        if self.scheme == "fp8" and (k % 16 or n % 16):
            return f"fp8 matmuls need in/out features divisible by 16, got {k}x{n}"
        return None

    def _linear_problem(self, lin: nn.Linear, tied: set[int]) -> str | None:
        if is_float8_linear(lin) or getattr(lin, "__effpass_linear__", False):
            return "already quantized"
        problem = weight_problem(lin.weight, tied)
        if problem:
            return problem
        problem = self._shape_problem(lin.in_features, lin.out_features, lin.weight.numel())
        if problem:
            return problem
        if type(lin).forward is not nn.Linear.forward and not getattr(type(lin), "__effpass_linear_forward__", False):
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(3, lin.in_features, generator=g).to(lin.weight)
            with torch.no_grad():
                ref = F.linear(x, lin.weight, lin.bias)
            bad = probe_matches(lambda: lin(x), ref)
            if bad:
                return (f"{type(lin).__name__} has its own forward, which does not compute F.linear(x, weight, bias) "
                        f"on a probe ({bad})")
        return None

    # -- quantizing ----------------------------------------------------------------------------------
    def _quantize_tensor(self, w: torch.Tensor) -> torch.Tensor:
        fmt = _formats()
        if self.scheme == "int8":
            if self.kernel == "torchao":
                from torchao.quantization.granularity import PerRow
                from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

                return Int8Tensor.from_hp(w.detach(), PerRow())
            return fmt.Int8WeightTensor.from_float(w)
        if self.scheme == "nf4":
            return fmt.to_nf4_weight(w, self.block_size, fast=self.kernel != "torchao")
        if self.scheme == "int4":
            if self.kernel == "torchao":
                # torchao's int4 weight-only format (tinygemm, ``aten._weight_int4pack_mm``): CUDA and bf16 only,
                # and INFERENCE only - torchao 0.18 gives it no backward (no derivative for the int4 matmul, no
                # dequantize), so "auto" keeps effpass's format, whose kernel has one (ran on an H100, 2026-11-27:
                # "auto" with torchao's format failed the input-gradient check).
                if w.device.type != "cuda" or w.dtype != torch.bfloat16:
                    raise ValueError(f"quantize_linear: scheme='int4', kernel='torchao' needs bf16 weights on CUDA "
                                     f"(torchao's tinygemm); got {w.dtype} on {w.device.type}; use kernel='auto'")
                fmt.register_torchao_int4()
                from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import (
                    Int4TilePackedTo4dTensor)

                return Int4TilePackedTo4dTensor.from_hp(w.detach(), [1, self.group_size])
            if self.kernel == "triton" or w.device.type == "cuda":
                from . import kernels as _quant_kernels  # noqa: F401  (registers INT4_KERNELS["triton"])
            return fmt.Int4WeightTensor.from_float(w, self.group_size, self.kernel)
        raise AssertionError(self.scheme)  # pragma: no cover

    def _kernel_names(self, lin: nn.Module, device: torch.device) -> tuple[str, str]:
        """(path for inference, path when the input needs a gradient) on ``device``."""
        fmt = _formats()
        w = lin.weight
        if is_float8_linear(lin):
            k = "torchao Float8Linear " + ("(emulated)" if lin.config.emulate else "(torch._scaled_mm)")
            return k, k
        if isinstance(w, fmt.Int8WeightTensor):
            fast = device.type == "cpu" and w.qdata.dim() == 2
            return ("aten._weight_int8pack_mm (bf16/fp16 activations), else torchao Int8Tensor" if fast
                    else "torchao Int8Tensor"), "torchao Int8Tensor"
        if isinstance(w, fmt.NF4WeightTensor):
            return "nf4 pair-table dequantize+linear", "nf4 pair-table dequantize+linear"
        if isinstance(w, fmt.Int4WeightTensor):
            k = w.kernel_for(device)
            return k, k
        return f"torchao {type(w).__name__}", f"torchao {type(w).__name__}"

    def _add_outliers(self, lin: nn.Linear) -> torch.Tensor:
        """Split off outlier input columns (kept exact); returns the weight left to quantize."""
        w = lin.weight.detach()
        idx = torch.zeros(0, dtype=torch.long, device=w.device)
        if self.outlier_threshold > 0:
            colmax = w.float().abs().amax(dim=0)
            idx = torch.nonzero(colmax > self.outlier_threshold * w.float().std()).flatten()
        if self.outlier_threshold <= 0:
            return w
        # NOTE(state_dict): registered even when empty, so every linear of a model has the same keys
        lin.register_buffer("outlier_idx", idx)
        lin.register_buffer("outlier_weight", w[:, idx].clone())
        lin.register_forward_hook(outlier_hook)
        lin._register_load_state_dict_pre_hook(outlier_load_pre_hook, with_module=True)
        if not idx.numel():
            return w
        w = w.clone()
        w[:, idx] = 0  # the outlier columns no longer inflate the scales of the rest
        return w

    # -- scope ----------------------------------------------------------------------------------------
    def _check_patterns(self, model: nn.Module, candidates: list[str], experts: list[str]) -> None:
        names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]

        def hits(glob, pool):
            return any(glob_match_within(n, glob) for n in pool)

        pool = candidates + experts
        for kind, globs, space in (("targets", self.targets, pool), ("exclude", self.exclude, names)):
            for glob in globs:
                if not hits(glob, space):
                    sample = ", ".join(repr(n) for n in pool[:8]) + (" ..." if len(pool) > 8 else "")
                    what = "quantizable module or expert tensor" if kind == "targets" else "module or parameter"
                    raise effpass.TargetMatchError(
                        f"quantize_linear: {kind} pattern {glob!r} matches no {what}; linear and expert names "
                        f"here include: {sample or '(none)'}")

    def prepare_module(self, model: nn.Module, ctx) -> effpass.PassResult:
        conv1d = conv1d_class()

        def is_candidate(m):
            return isinstance(m, nn.Linear) or (conv1d is not None and isinstance(m, conv1d))

        candidates = [(n, m) for n, m in model.named_modules() if n and is_candidate(m)
                      and ".lora_" not in n]
        experts = expert_tensors(model) if self.experts else []
        self._check_patterns(model, [n for n, _ in candidates], [n for n, _, _ in experts])
        if self.scheme == "fp8" and not self.fp8_emulate:
            bad = sorted({str(m.weight.device) for _, m in candidates if not fp8_supported(m.weight.device)})
            if bad:
                raise ValueError(
                    f"quantize_linear: scheme='fp8' needs torch._scaled_mm on a CUDA GPU with compute capability "
                    f">= 8.9 (Ada/Hopper), but the linears are on {bad}; choose scheme 'int8', "
                    "'int4' or 'nf4' there (fp8_emulate=True exists for tests only)")
        seen: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
        tied = {i for i, c in seen.items() if c > 1}

        report: dict[str, dict] = {}
        skipped: list[dict] = []
        before = after = params = 0
        storages: set = set()

        def skip(name, kind, reason):
            report[name] = {"status": "skipped", "kind": kind, "reason": reason}
            skipped.append({"site": name, "reason": reason})

        for name, mod in candidates:
            if not ctx.scope.allows_module(name, mod):
                continue
            kind = "conv1d" if not isinstance(mod, nn.Linear) else (
                "linear" if type(mod) is nn.Linear else "linear_subclass")
            read = direct_weight_read(model, name) if self.scheme != "fp8" else None  # fp8 keeps the weight
            if read:
                skip(name, kind, f"{read}, outside the linear's forward: a quantized weight supports only the "
                                 "linear's own matmul")
                continue
            if kind == "conv1d":
                problem = weight_problem(mod.weight, tied)
                if problem:
                    skip(name, kind, problem)
                    continue
                k, n = mod.weight.shape
                problem = self._shape_problem(k, n, mod.weight.numel())
                if problem:
                    skip(name, kind, problem)
                    continue
                lin = nn.Linear(k, n, bias=mod.bias is not None, device="meta")
                lin.weight = nn.Parameter(mod.weight.detach().t().contiguous(), requires_grad=mod.weight.requires_grad)
                if mod.bias is not None:
                    lin.bias = mod.bias
                set_submodule(model, name, lin)
                orig_weight, mod = mod.weight, lin
            else:
                problem = self._linear_problem(mod, tied)
                if problem:
                    skip(name, kind, problem)
                    continue
                orig_weight = mod.weight
                if kind == "linear_subclass" and not getattr(type(mod), "__effpass_linear_forward__", False):
                    mod.__class__ = with_linear_forward(type(mod))
            b0 = orig_weight.numel() * orig_weight.element_size()
            dev = orig_weight.device
            if self.scheme == "fp8":
                mod = float8_linear(mod, self.fp8_granularity, self.fp8_emulate, self.fp8_fsdp_all_gather)
                set_submodule(model, name, mod)
                b1 = b0
            else:
                w = self._add_outliers(mod)
                mod.weight = nn.Parameter(self._quantize_tensor(w), requires_grad=False)
                mod.__effpass_linear__ = True  # NOTE(lora): a quantized base; lora.merge refuses it
                b1 = storage_bytes(mod.weight, storages) + sum(
                    b.numel() * b.element_size() for n_, b in mod.named_buffers(recurse=False) if n_.startswith("outlier_"))
            inference, grad = self._kernel_names(mod, dev)
            report[name] = {"status": "quantized", "kind": kind, "scheme": self.scheme,
                            "weight_type": type(mod.weight).__name__, "shape": [mod.out_features, mod.in_features],
                            "bytes_before": b0, "bytes_after": b1, "kernel": inference, "kernel_grad": grad,
                            "outlier_columns": int(getattr(mod, "outlier_idx", torch.zeros(0)).numel())}
            if kind == "conv1d":
                report[name]["note"] = "Conv1D replaced by nn.Linear with the transposed weight"
            if kind == "linear_subclass":
                report[name]["note"] = f"{type(mod).__name__}.forward verified linear on a probe; uses nn.Linear.forward"
            before, after, params = before + b0, after + b1, params + orig_weight.numel()
            del orig_weight

        switched = quantize_experts(self, model, experts, ctx, tied, report, skipped, storages)
        n_expert_q = sum(1 for r in report.values() if r["status"] == "quantized" and r["kind"] == "experts")
        for r in report.values():
            if r["status"] == "quantized" and r["kind"] == "experts":
                before, after, params = before + r["bytes_before"], after + r["bytes_after"], params + r["numel"]
        quantized = sum(1 for r in report.values() if r["status"] == "quantized")
        if not quantized:
            ctx.scope.warn_nothing_to_act_on(f"nothing was quantized ({len(skipped)} candidates skipped, see the "
                                             "pass's 'skipped' entries); the pass leaves the model unchanged")
        stats = {"scheme": self.scheme, "quantized": quantized - n_expert_q, "quantized_expert_tensors": n_expert_q,
                 "skipped": len(skipped), "bytes_before": before, "bytes_after": after,
                 "bytes_per_param": round(after / params, 4) if params else 0.0, "modules": report}
        if switched:
            stats["experts_implementation"] = switched
        return effpass.PassResult(changed=bool(quantized), stats=stats, skipped=skipped)
