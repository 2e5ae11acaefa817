"""Export what effpass made: ``effpass.export_onnx(model, example_inputs, path, passes=[...])``.

The passes run as in ``effpass.compile`` (module phase on the eager model, then the torch-IR phase on the
graph Dynamo captures); the transformed inference graph is then handed to torch's ONNX exporter
(``torch.onnx.export(..., dynamo=True)``). Joint and post-grad passes act on training graphs inside
AOTAutograd and are not part of an inference export (a warning names any that were asked for).

* Hugging Face models are exported with the KV cache off (``config.use_cache = False``): the exporter
  cannot return the ``DynamicCache`` an HF model builds in eval mode; the file computes the logits.
* int8 weights stay int8 in the file: each quantized linear (recognised by :func:`quantized_linear_parts`:
  effpass's ``QuantizedLinear(scheme="int8")`` or an ``nn.Linear`` whose weight is a torchao
  ``Int8Tensor``) becomes ``DequantizeLinear(int8 initializer, per-row scales, axis=0)`` followed by the
  matmul. The exporter's graph optimiser (torch's default ``optimize=True``; here off unless asked for)
  constant-folds a Cast/Mul dequantisation of an int8 initializer back into an fp32 initializer, but
  leaves ``DequantizeLinear`` alone; the export checks that every int8 weight is still an INT8
  initializer in the saved file and raises if not.
* Other packed weights (int4, NF4) are exported through their module's reference dequantisation code
  (packed uint8 initializers plus unpacking ops); fp8 weights are exported in their high precision.
* Fused attention (``aten.scaled_dot_product_attention``) exports as torch's exporter translates it: one
  ONNX ``Attention`` op at ``opset=23`` (onnxruntime 1.32 runs it), its decomposition (MatMul/Softmax)
  at the exporter's default opset (20 with torch 2.13).
* An op ONNX cannot express raises :class:`OnnxExportError` naming the op and the pass that produced it
  (``node.meta["effpass_pass"]``), or the module it came from.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..backend import EffpassBackend, copy_dynamo_graph_module
from ..config import compile_options
from ..dump import claim_graph_dir
from ..pass_api import Phase
from ..report import GraphReport

__all__ = ["export_onnx", "ExportResult", "OnnxExportError", "QuantizedLinearParts", "quantized_linear_parts",
           "stored_initializer_bytes"]


class OnnxExportError(RuntimeError):
    """The transformed graph cannot be written as ONNX (an op ONNX cannot express, a graph break, ...)."""


# ------------------------------------------------------------------------------------------------------
# the int8 adapter
# ------------------------------------------------------------------------------------------------------
@dataclass
class QuantizedLinearParts:
    """A linear layer whose weight is stored as int8 per output channel: ``W ~= qweight * scales[:, None]``."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N]
    bias: torch.Tensor | None
    source: str  # "effpass.QuantizedLinear" or "torchao.Int8Tensor"


def quantized_linear_parts(module: nn.Module) -> QuantizedLinearParts | None:
    """(int8 weight, per-row scales, bias) of a quantized linear, or None if ``module`` is not one this
    exporter keeps in int8. Recognised:

    * effpass's ``QuantizedLinear`` with ``scheme="int8"`` and no full-precision outlier columns
      (duck-typed: ``scheme``, ``qweight``, ``scales``, ``outlier_idx`` attributes);
    * an ``nn.Linear`` whose ``weight`` is a torchao ``Int8Tensor`` (torchao >= 0.18: ``qdata`` int8
      [N, K], ``scale`` [N] / [N, 1] or one per tensor, symmetric: ``zero_point`` None or all zero,
      weight-only: no ``act_quant_kwargs``).
    """
    if getattr(module, "scheme", None) == "int8" and isinstance(getattr(module, "qweight", None), torch.Tensor):
        q, s = module.qweight, getattr(module, "scales", None)
        outliers = getattr(module, "outlier_idx", None)
        if (q.dtype == torch.int8 and q.dim() == 2 and isinstance(s, torch.Tensor) and s.numel() == q.shape[0]
                and (outliers is None or outliers.numel() == 0)):
            return QuantizedLinearParts(q, s.reshape(-1).float(), getattr(module, "bias", None),
                                        "effpass.QuantizedLinear")
        return None
    if isinstance(module, nn.Linear):
        w = module.weight
        q, s = getattr(w, "qdata", None), getattr(w, "scale", None)
        zp = getattr(w, "zero_point", None)
        symmetric = zp is None or (isinstance(zp, torch.Tensor) and not bool(zp.any()))
        if (isinstance(q, torch.Tensor) and isinstance(s, torch.Tensor) and q.dtype == torch.int8 and q.dim() == 2
                and symmetric and getattr(w, "act_quant_kwargs", None) is None):
            n = q.shape[0]
            if s.numel() == n:
                s = s.reshape(-1)
            elif s.numel() == 1:
                s = s.reshape(1).expand(n)
            else:
                return None  # per-group scales: not a per-row int8 weight
            return QuantizedLinearParts(q, s.float().contiguous(), module.bias, "torchao.Int8Tensor")
    return None


@torch.library.custom_op("effpass_export::dequantize_int8", mutates_args=())
def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``qweight * scales[:, None]`` in fp32; written to ONNX as ``DequantizeLinear(axis=0)``."""
    return qweight.float() * scales.float()[:, None]


@dequantize_int8.register_fake
def _(qweight, scales):
    return qweight.new_empty(qweight.shape, dtype=torch.float32)


class _Int8Linear(nn.Module):
    """What a quantized linear becomes for export: the int8 weight and scales as buffers, dequantised by
    one op that the exporter writes as ``DequantizeLinear``."""

    def __init__(self, parts: QuantizedLinearParts):
        super().__init__()
        self.register_buffer("qweight", parts.qweight.detach().contiguous())
        self.register_buffer("scales", parts.scales.detach().float().contiguous())
        self.bias = parts.bias
        self.source = parts.source

    def forward(self, x):
        w = torch.ops.effpass_export.dequantize_int8(self.qweight, self.scales)
        return F.linear(x, w.to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)


class _DequantizedLinear(nn.Module):
    """Other packed linears (int4, NF4, int8 with outliers): the module's reference dequantisation."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        b = self.inner.bias
        return F.linear(x, self.inner.dequantize(x.dtype), b.to(x.dtype) if b is not None else None)


def _swap_quantized_linears(model: nn.Module) -> dict[str, list[str]]:
    swapped: dict[str, list[str]] = {"int8": [], "dequantized": []}
    for name, mod in list(model.named_modules()):
        if not name:
            continue
        parts = quantized_linear_parts(mod)
        if parts is not None:
            new: nn.Module = _Int8Linear(parts)
            swapped["int8"].append(name)
        elif getattr(mod, "__effpass_linear__", False) and callable(getattr(mod, "dequantize", None)) \
                and getattr(mod, "scheme", None) not in (None, "fp8"):
            new = _DequantizedLinear(mod)
            swapped["dequantized"].append(name)
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return swapped


def _onnx_translations() -> dict:
    from onnxscript import opset18 as op

    def dequantize_int8_onnx(qweight, scales):  # traced by the exporter (onnxscript ops, no @script)
        return op.DequantizeLinear(qweight, scales, axis=0)

    return {torch.ops.effpass_export.dequantize_int8.default: dequantize_int8_onnx}


# ------------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------------
@dataclass
class ExportResult:
    path: str
    input_names: list[str]
    output_names: list[str]
    #: module names whose weights were written as int8 DequantizeLinear / through reference dequantisation
    int8_linears: list[str] = field(default_factory=list)
    dequantized_linears: list[str] = field(default_factory=list)
    #: bytes of the initializers in the saved file, by ONNX data type name (weights, not metadata)
    initializer_bytes: dict[str, int] = field(default_factory=dict)
    #: max |onnxruntime - transformed PyTorch graph| / max |transformed graph| per output (check=True)
    max_rel_error: dict[str, float] = field(default_factory=dict)
    onnx_ops: dict[str, int] = field(default_factory=dict)
    report: Any = None


def _require(*mods: str) -> None:
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"effpass.export_onnx needs {missing}: pip install 'effpass[onnx]' "
                          "(onnx, onnxscript, onnxruntime)")


def _flatten_inputs(example_inputs) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TypeError("example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword "
                        f"inputs, got {type(example_inputs).__name__}")
    named = [(f"input_{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    named += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return args, kwargs, named


def _op_origin(node: fx.Node) -> str:
    made_by = node.meta.get("effpass_pass")
    if made_by:
        return f"made by pass {made_by!r}"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = getattr(cls, "__name__", str(cls)).rsplit(".", 1)[-1]
        return f"from the model's own code (module {path!r}, {cls_name}; no pass made it)"
    return "from the model's own code (no pass made it)"


def _non_core_ops(gm: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    out = []
    for n in gm.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        ns = t.namespace if hasattr(t, "namespace") else str(t).split(".")[0]
        if ns in ("aten", "prims", "effpass_export"):
            continue
        out.append((str(t.name() if hasattr(t, "name") and callable(t.name) else t), n))
    return out


class _ExportModule(nn.Module):
    """Calls the transformed Dynamo graph with the model's tensors as constants and the user's inputs."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, slots: list[tuple[str, Any]]):
        super().__init__()
        self.gm = gm
        self.model = model  # parameters and buffers keep their names in the file
        self.slots = slots  # per graph input: ("param", fqn) | ("buffer", fqn) | ("input", i) | ("const", name)

    def forward(self, *inputs):
        args = []
        for kind, ref in self.slots:
            if kind == "param":
                args.append(self.model.get_parameter(ref))
            elif kind == "buffer":
                args.append(self.model.get_buffer(ref))
            elif kind == "input":
                args.append(inputs[ref])
            else:
                args.append(getattr(self, ref))
        out = self.gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def export_onnx(model: nn.Module, example_inputs, path: str, passes: Sequence | dict | None = None, *,
                opset: int | None = None, inplace: bool = False, dump_dir: str | None = None,
                check: bool = True, strict: bool = False, optimize: bool = False) -> ExportResult:
    """Apply ``passes`` to ``model`` and write its transformed inference graph to ``path`` as ONNX.

    ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs (shapes are
    fixed to these). ``passes=None`` is the default pipeline, ``[]`` none. The model is deep-copied first
    unless ``inplace=True`` (module-level passes such as ``quantize_linear`` change it). ``check=True``
    runs the file in onnxruntime on the CPU and records its error against the transformed PyTorch graph
    (``ExportResult.max_rel_error``). ``opset``: the ONNX opset (default: the exporter's).
    ``optimize=True`` runs the exporter's graph optimiser (fewer nodes; it also folds constants such as
    rotary tables into new fp32 initializers, so the file stores more than the model's tensors).
    """
    _require("onnx", "onnxscript", *(("onnxruntime",) if check else ()))
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_onnx expects an nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    args, kwargs, named = _flatten_inputs(example_inputs)
    if not inplace:
        model = copy.deepcopy(model)
    model.eval()
    # NOTE(onnx): the exporter cannot return the DynamicCache an HF model makes in eval mode.
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "use_cache"):
        cfg.use_cache = False

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    options = compile_options(passes=passes, lowering="eager", strict=strict, dump_dir=dump_dir, device=device)
    backend = EffpassBackend(options, model=model)
    late = [p.name for p in backend.manager.active
            if set(type(p).phases()) & {Phase.JOINT, Phase.POST_GRAD}
            and not set(type(p).phases()) & {Phase.MODULE, Phase.TORCH_IR}]
    if late and passes is not None:
        warnings.warn(f"effpass.export_onnx: pass(es) {late} act only on training graphs (joint/post-grad) and "
                      "are not part of an inference export", RuntimeWarning, stacklevel=2)
    mreport = backend.report.module
    if dump_dir:
        mreport.dump_path = os.path.join(dump_dir, "module")
        os.makedirs(mreport.dump_path, exist_ok=True)
    ctx = backend.manager.run_module_phase(model, mreport, device=device, lowering="eager",
                                           backend_factory=lambda: backend, compile_kwargs={})
    if backend.dump and mreport.dump_path:
        backend.dump.write_index(mreport)
    if not ctx.compile_root:
        raise OnnxExportError("a module-level pass compiled parts of the model itself (wrap_fsdp?): "
                              "a sharded model cannot be exported; export without it")
    swapped = _swap_quantized_linears(model)

    # Capture: Dynamo hands over one graph; the torch-IR passes run on a copy, which is what we export.
    captured: list[tuple[fx.GraphModule, list]] = []
    last_out: list = []

    def capture(gm, graph_inputs, **_):
        report = GraphReport(f"graph_{len(captured):03d}")
        if backend.options.dump_dir:
            report.dump_path = claim_graph_dir(backend.options.dump_dir, "graph")
            report.graph_id = os.path.basename(report.dump_path)
        backend.report.graphs.append(report)
        gm2 = copy_dynamo_graph_module(gm)
        backend.manager.run_graph_phase(Phase.TORCH_IR, gm2, report, "torch_ir", example_inputs=graph_inputs,
                                        model=model, device=device, lowering="eager")
        if backend.dump:
            backend.dump.write_index(report)
        captured.append((gm2, list(graph_inputs)))

        def run(*a):
            out = gm2(*a)
            last_out[:] = list(out) if isinstance(out, (list, tuple)) else [out]
            return out

        return run

    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
    for attempt in range(2):
        try:
            with torch.no_grad():
                ref = compiled(*args, **kwargs)
        except Exception as e:
            if "graph break" in str(e).lower() or type(e).__name__ in ("Unsupported", "UserError"):
                raise OnnxExportError(f"export needs the model as one graph, but Dynamo could not capture it "
                                      f"whole: {type(e).__name__}: {str(e).splitlines()[0]}") from e
            raise
        if captured:
            break
        # Dynamo reused code compiled earlier for this model without calling our backend: start afresh
        # (only then: a reset drops every compiled function of the process).
        torch._dynamo.reset()
    if not captured:
        raise OnnxExportError("Dynamo did not hand a graph to the exporter's backend")
    gm, graph_inputs = captured[-1]
    graph_out = list(last_out)

    # Which graph input is what: the model's parameters/buffers (by identity) or the caller's inputs.
    by_id: dict[int, tuple[str, str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ("param", fqn))
    for fqn, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), ("buffer", fqn))
    user = {id(t): i for i, (_, t) in enumerate(named)}
    slots: list[tuple[str, Any]] = []
    consts: dict[str, torch.Tensor] = {}
    used_inputs: list[int] = []
    for i, x in enumerate(graph_inputs):
        if id(x) in by_id:
            slots.append(by_id[id(x)])
        elif id(x) in user:
            used_inputs.append(user[id(x)])
            slots.append(("input", used_inputs.index(user[id(x)])))
        elif isinstance(x, torch.Tensor):
            name = f"_const_{i}"
            consts[name] = x.detach()
            slots.append(("const", name))
        else:
            raise OnnxExportError(f"graph input {i} is a {type(x).__name__} ({x!r}); export needs static shapes")
    wrapper = _ExportModule(gm, model, slots)
    for name, t in consts.items():
        wrapper.register_buffer(name, t)
    input_names = [named[i][0] for i in used_inputs]
    export_args = tuple(named[i][1] for i in used_inputs)

    output_names = _output_names(ref, graph_out)
    from torch.onnx import export as onnx_export

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # NOTE(int8): the optimiser's constant folding turns a Cast/Mul dequantisation of an int8
            # initializer (what a module's reference dequantize code exports as) back into an fp32
            # initializer; it leaves DequantizeLinear alone. Hence DequantizeLinear, and the check below.
            # Off by default so the file stores exactly the model's tensors (no folded rotary tables).
            onnx_export(wrapper, export_args, path, dynamo=True, optimize=optimize, opset_version=opset,
                        input_names=input_names, output_names=output_names,
                        custom_translation_table=_onnx_translations(), external_data=_needs_external(model),
                        verbose=False, report=False)
    except Exception as e:
        bad = _non_core_ops(gm)
        if bad:
            names = "; ".join(f"{op} (node {n.name}, {_op_origin(n)})" for op, n in bad)
            first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split(". ")[0][:300]
            raise OnnxExportError(f"ONNX cannot express op(s): {names}. Leave that pass out of the export "
                                  f"(passes=[...]) or give the op an ONNX translation. Exporter: "
                                  f"{type(e).__name__}: {first}") from e
        raise OnnxExportError(f"torch.onnx.export failed on the transformed graph (passes: "
                              f"{[p.name for p in backend.manager.active]}): {type(e).__name__}: {e}") from e

    import onnx

    m = onnx.load(path)
    init_bytes = stored_initializer_bytes(m)
    ops: dict[str, int] = {}
    for node in m.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    int8_names = {i.name for i in m.graph.initializer if i.data_type == onnx.TensorProto.INT8}
    if len(int8_names) < len(swapped["int8"]):
        raise OnnxExportError(f"{len(swapped['int8'])} int8 weights went in, but the file holds {len(int8_names)} "
                              "INT8 initializers: the export turned quantized weights back into floats")
    result = ExportResult(path=path, input_names=input_names, output_names=output_names,
                          int8_linears=swapped["int8"], dequantized_linears=swapped["dequantized"],
                          initializer_bytes=init_bytes, onnx_ops=ops, report=backend.report)
    if check:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3  # errors only (ORT warns that it cannot constant-fold CastLike)
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        got = sess.run(None, {n: t.detach().cpu().numpy() for n, t in zip(input_names, export_args)})
        for name, g, r in zip(output_names, got, graph_out):
            if isinstance(r, torch.Tensor) and r.is_floating_point():
                r = r.detach().float().cpu()
                err = (torch.from_numpy(g).float() - r).abs().max().item()
                result.max_rel_error[name] = err / max(r.abs().max().item(), 1e-30)
    return result


def _needs_external(model: nn.Module) -> bool:
    n = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return n > 1_500_000_000  # protobuf's 2 GiB limit


def _output_names(ref: Any, graph_out: list) -> list[str]:
    """Name the graph's outputs after the model's output fields when they are the same tensors."""
    fields: dict[int, str] = {}
    items = ref.items() if isinstance(ref, Mapping) else (
        [(f.name, getattr(ref, f.name)) for f in dataclasses.fields(ref)] if dataclasses.is_dataclass(ref) else [])
    for k, v in items:
        if isinstance(v, torch.Tensor):
            fields.setdefault(id(v), str(k))
    if isinstance(ref, (tuple, list)):
        for i, v in enumerate(ref):
            if isinstance(v, torch.Tensor):
                fields.setdefault(id(v), f"output_{i}")
    names, seen = [], set()
    for i, t in enumerate(graph_out):
        n = fields.get(id(t), f"output_{i}")
        if n in seen:
            n = f"{n}_{i}"
        seen.add(n)
        names.append(n)
    return names


def stored_initializer_bytes(model_proto) -> dict[str, int]:
    """Bytes of the weights stored in an ONNX model (its initializers and Constant-node tensors), by data
    type, from shapes and element sizes: not the file size (which adds per-node metadata)."""
    import onnx
    from onnx import helper

    out: dict[str, int] = {}

    def add(t):
        n = 1
        for d in t.dims:
            n *= d
        size = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        name = onnx.TensorProto.DataType.Name(t.data_type)
        out[name] = out.get(name, 0) + n * size

    for t in model_proto.graph.initializer:
        add(t)
    for node in model_proto.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    add(a.t)
    return out
