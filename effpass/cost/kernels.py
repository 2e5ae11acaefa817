"""From recorded ops to kernels: which ops launch a kernel, which fuse, and each kernel's memory traffic.

The fusion rule (an approximation of what Inductor does on the same aten graph; docs/cost_model.md):

* *free* ops launch nothing and move no bytes: views (every output aliases an input, nothing written) and
  allocations (``empty``: memory is not touched until an op writes it);
* *fusible* ops are pointwise ops (``torch.Tag.pointwise``), reductions (``torch.Tag.reduction``), fills,
  copies and casts, concatenation and padding, gathers (``embedding``, ``index_select``, ``gather``, ``index``)
  and the softmax / NLL family, which Inductor lowers to loops it can fuse;
* in a compiled graph, a fusible op joins the kernel of a fusible producer in the same graph while no other
  kernel has read from that kernel yet (so a fused kernel never depends on its own consumer: no cycles);
  otherwise it starts a kernel. Every other op (matmuls, attention, scatters with accumulation, sorts, custom
  ops, anything unknown) is a kernel of its own. No horizontal fusion (independent chains are not merged);
* outside compiled graphs (eager code, the autograd engine) and inside an expanded custom op (whose
  implementation runs eagerly even under Inductor) every op that is not free is its own kernel;
* a host read of a scalar (``.item()``) is a synchronisation, not a kernel; ``nonzero`` is both.

A kernel reads each value it does not produce itself once (its bytes as the reading op sees it: a view reads its
own elements) and writes each value it produces that another kernel reads or that nothing reads during the step
(graph outputs, gradients); a value produced and consumed inside one fused kernel stays in registers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .counter import OpRecord
from ..devices import GPU, kernel_seconds

__all__ = ["Kernel", "classify", "build_kernels", "FUSIBLE"]

#: fusible ops that carry no pointwise/reduction tag (schema names)
FUSIBLE = frozenset({
    "aten::zeros", "aten::ones", "aten::full", "aten::zeros_like", "aten::ones_like", "aten::full_like",
    "aten::fill_", "aten::zero_", "aten::arange", "aten::scalar_tensor", "aten::lift_fresh_copy",
    "aten::_to_copy", "aten::clone", "aten::copy_", "aten::copy", "aten::cat", "aten::constant_pad_nd",
    "aten::slice_backward", "aten::select_backward", "aten::slice_scatter", "aten::select_scatter",
    "aten::gather", "aten::index_select", "aten::embedding", "aten::index",
    "aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data", "aten::_log_softmax_backward_data",
    "aten::nll_loss_forward", "aten::nll_loss_backward", "aten::native_dropout", "aten::native_layer_norm",
    "aten::native_layer_norm_backward", "aten::_fused_rms_norm", "aten::logsumexp", "aten::expand_copy",
    "aten::permute_copy", "aten::repeat", "aten::tril", "aten::triu", "aten::masked_fill",
})


def _schema_name(rec: OpRecord) -> str:
    ns, _, rest = rec.op.partition(".")
    return f"{ns}::{rest.partition('.')[0]}"


def classify(rec: OpRecord) -> str:
    """One of ``custom`` (an expanded custom op's own record), ``sync`` (a scalar read on the host), ``free``,
    ``fusible``, ``extern`` (see the module docstring)."""
    if rec.expanded:
        return "custom"
    name = _schema_name(rec)
    if name == "aten::_local_scalar_dense":
        return "sync"
    if not any(b for _, b in rec.writes) and not rec.work_flops:
        return "free"
    if rec.work_flops:
        return "extern"
    try:
        ns, _, rest = rec.op.partition(".")
        packet_name, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, ns), packet_name), overload or "default")
        tags = set(op.tags)
    except Exception:
        tags = set()
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags or name in FUSIBLE:
        return "fusible"
    return "extern"


@dataclass
class Kernel:
    """One kernel launch (or one host synchronisation, ``launches == 0``) of the step."""

    graph: str
    ops: list = field(default_factory=list)   #: indices into the records
    launches: int = 1
    flops: int = 0          #: FlopCounterMode's count of its ops
    work_flops: int = 0     #: what it computes (the roofline's)
    bytes: int = 0
    syncs: int = 0
    head: bool = False
    dtype: torch.dtype | None = None
    seconds: float = 0.0


def build_kernels(records: list[OpRecord], gpu: GPU) -> tuple[list[Kernel], list[int]]:
    """The kernels of ``records`` (see the module docstring) and each record's share of the bytes (the bytes a
    kernel reads are credited to the op that first reads the value, the bytes it writes to the op that writes it:
    the shares add up to the kernels' bytes)."""
    kernels: list[Kernel] = []
    kernel_of: list[int | None] = [None] * len(records)
    producer: dict[int, int] = {}        # value id -> kernel index that wrote it
    consumed: set[int] = set()           # kernels another kernel has read from (closed for fusion)
    fusing: dict[int, bool] = {}         # kernel index -> it is a fused (fusible, in-graph) kernel
    for i, rec in enumerate(records):
        kind = rec.kind = classify(rec)
        if kind == "free":
            continue
        srcs = {producer[v] for v, _ in rec.reads if v in producer}
        in_graph = " graph " in rec.graph and not rec.inside
        k = None
        if kind == "fusible" and in_graph:
            cands = [s for s in srcs if fusing.get(s) and s not in consumed and kernels[s].graph == rec.graph]
            if cands:
                k = max(cands)
        if k is None:
            k = len(kernels)
            kernels.append(Kernel(graph=rec.graph, launches=0 if kind in ("sync", "custom") else 1))
            fusing[k] = kind == "fusible" and in_graph
        consumed.update(s for s in srcs if s != k)
        kern = kernels[k]
        kern.ops.append(i)
        kernel_of[i] = k
        kern.flops += rec.flops
        kern.work_flops += rec.work_flops
        kern.syncs += int(rec.sync)
        kern.head = kern.head or rec.head
        if rec.work_flops or kern.dtype is None:  # a matmul's operands set the rate
            kern.dtype = rec.dtype
        for v, _ in rec.writes:
            producer[v] = k
    # who reads each value (kernels), to decide which produced values reach memory
    readers: dict[int, set[int]] = {}
    for i, rec in enumerate(records):
        k = kernel_of[i]
        if k is None:
            continue
        for v, _ in rec.reads:
            readers.setdefault(v, set()).add(k)
    share = [0] * len(records)
    for k, kern in enumerate(kernels):
        read_seen: set[int] = set()
        written: dict[int, tuple[int, int]] = {}   # value -> (record index, bytes) of its last write here
        for i in kern.ops:
            rec = records[i]
            for v, b in rec.reads:
                if producer.get(v) == k and v in written:
                    continue  # produced earlier in this kernel
                if v in read_seen:
                    continue
                read_seen.add(v)
                share[i] += b
            for v, b in rec.writes:
                written[v] = (i, b)
        for v, (i, b) in written.items():
            others = readers.get(v, set()) - {k}
            if others or v not in readers:
                share[i] += b
        kern.bytes = sum(share[i] for i in kern.ops)
        kern.seconds = (kernel_seconds(gpu, kern.work_flops, kern.bytes, kern.dtype) if kern.launches else
                        (kern.work_flops / (gpu.matmul_flops if kern.dtype in (torch.bfloat16, torch.float16)
                                            else gpu.fp32_flops) if kern.work_flops else 0.0))
        kern.seconds += kern.syncs * gpu.sync_s
    return kernels, share
