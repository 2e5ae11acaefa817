"""The dispatch mode that records what one training step does, op by op (``effpass.cost``).

Every aten op the step dispatches becomes an :class:`OpRecord`: where it ran (which compiled graph, or eager
code, or inside which custom op), its FLOPs (torch's ``flop_registry``, the table ``FlopCounterMode`` reads,
with the formulas custom ops register through :func:`effpass.register_flop_formula`), the values it reads and
writes (a *value* is one version of one storage: an in-place op makes a new version), their bytes, and whether
it synchronises with the host.

Custom ops that have a Python implementation (``torch.library.custom_op``, e.g. the fused loss head's
``effpass::linear_cross_entropy``) are *expanded* (except those declared one device kernel with
:func:`effpass.register_device_kernel`: a Triton launch, recorded whole): their implementation runs under this mode, so the chunked
kernels inside are counted op by op as they run (eagerly: every op one kernel). The custom op's own record keeps
its registered FLOPs (what ``FlopCounterMode`` sees); the ops inside carry the FLOPs they do, which the roofline
uses (``work_flops``).

On fake tensors (full-size models, no storage) the data-dependent values inside an expanded op are assumed, and
said so in the result's notes: ``nonzero`` keeps every element (every label valid), a scalar read on the host
(``.item()``, ``int(t)``, ``bool(t)``) reads ``1``/``True``/``1.0``. Each still counts as a host synchronisation.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpRecord", "CostMode", "operand_bytes", "indexed_bytes"]

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_NONZERO = torch.ops.aten.nonzero.default
#: allocation without a kernel (the memory is not touched until an op writes it)
_ALLOC = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}


@dataclass
class OpRecord:
    """One op of the recorded step."""

    op: str                      #: e.g. "aten.mm.default"
    packet: str                  #: e.g. "aten.mm" (the per-op table's key)
    graph: str                   #: "forward graph 1", "backward graph 2", "eager code"
    inside: str = ""             #: the custom op whose implementation ran this op ("" at the top level)
    flops: int = 0               #: as FlopCounterMode counts it (0 inside an expanded custom op)
    work_flops: int = 0          #: what the op computes, for the roofline (inner matmuls of expanded ops)
    reads: list = field(default_factory=list)    #: [(value id, bytes)]
    writes: list = field(default_factory=list)   #: [(value id, bytes)]
    sync: bool = False           #: a host synchronisation (data-dependent output or shape)
    head: bool = False           #: part of the loss head (see ``effpass.cost``)
    kind: str = "other"          #: "free", "fusible", "extern", "sync", "custom" (see ``kernels.classify``)
    dtype: torch.dtype | None = None  #: the first floating-point operand's dtype (the roofline's rate)
    expanded: bool = False       #: a custom op whose implementation was recorded (its own record has no kernel)


def operand_bytes(t: torch.Tensor) -> int:
    """Bytes an op touches to read or write ``t``: its elements not counting broadcast dimensions (stride 0),
    times the element size (a view touches its own elements, not its whole storage; an expanded tensor its
    storage's). Tensor subclasses (quantized weights) by their inner tensors."""
    from effpass.quantized import inner_tensors

    total = 0
    for inner in inner_tensors(t):
        n = 1
        for size, stride in zip(inner.shape, inner.stride()):
            if size == 0:
                n = 0
                break
            if stride != 0:
                n *= size
        total += n * inner.element_size()
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n



def _indexed_elements(base, args) -> int | None:
    """Elements ``aten::index`` / ``index_put`` touch in ``base`` for integer index tensors ``args[1]`` (rows
    indexed times the trailing slice); None for boolean masks or no tensor index."""
    idx = [i for i in (args[1] if len(args) > 1 else ()) if isinstance(i, torch.Tensor)]
    if not idx or any(i.dtype in (torch.bool, torch.uint8) for i in idx):
        return None
    try:
        rows = _numel(torch.broadcast_shapes(*[i.shape for i in idx]))
    except RuntimeError:
        rows = max(i.numel() for i in idx)
    return rows * _numel(base.shape[len(idx):])


def indexed_bytes(func, args) -> dict[int, int]:
    """Bytes of the operands an indexed op touches only in part, by ``id`` of the operand: a gather reads the
    rows (elements) it selects, not its whole source (an embedding lookup reads tokens x hidden of a vocabulary x
    hidden table; ``nll_loss`` reads one logit per row); a scatter writes (and reads, to accumulate) only the
    positions it updates. Every other operand: :func:`operand_bytes`."""
    name = getattr(getattr(func, "_schema", None), "name", "")
    a = list(args)

    def t(i):
        return a[i] if i < len(a) and isinstance(a[i], torch.Tensor) else None

    out: dict[int, int] = {}
    src = None
    if name == "aten::embedding" and t(0) is not None and t(1) is not None:
        src, n = t(0), t(1).numel() * _numel(t(0).shape[1:])
    elif name == "aten::gather" and t(0) is not None and t(2) is not None:
        src, n = t(0), t(2).numel()
    elif name == "aten::index_select" and t(0) is not None and t(2) is not None:
        dim = a[1] % max(t(0).dim(), 1)
        src, n = t(0), t(2).numel() * _numel(t(0).shape[:dim] + t(0).shape[dim + 1:])
    elif name in ("aten::nll_loss_forward", "aten::nll_loss2d_forward") and t(0) is not None and t(1) is not None:
        src, n = t(0), t(1).numel()
    elif name == "aten::index" and t(0) is not None:
        n = _indexed_elements(t(0), a)
        if n is not None:
            src = t(0)
    elif name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl", "aten::_index_put_impl_") \
            and t(0) is not None:
        n = _indexed_elements(t(0), a)
        if n is not None:
            src = t(0)
            if t(2) is not None:
                out[id(t(2))] = min(operand_bytes(t(2)), n * t(2).element_size())
    elif name in ("aten::index_copy", "aten::index_copy_", "aten::index_add", "aten::index_add_") \
            and t(0) is not None and t(3) is not None:
        src, n = t(0), t(3).numel()
    elif name in ("aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_",
                  "aten::scatter_reduce", "aten::scatter_reduce_") and t(0) is not None and t(2) is not None:
        src, n = t(0), t(2).numel()
    if src is not None:
        out[id(src)] = min(operand_bytes(src), n * src.element_size())
    return out


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # pragma: no cover - a tensor without a storage (sparse, nested)
        return None


def _has_implicit(func) -> bool:
    name = getattr(getattr(func, "_schema", None), "name", None)
    if name is None:
        return False
    full = name + (f".{func._schema.overload_name}" if func._schema.overload_name else "")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd")
    except RuntimeError:  # an op the dispatcher does not know (prim::device)
        return False


def _is_sync(func, args) -> bool:
    """A host synchronisation: a scalar read on the host, or an op whose output or shape depends on the data
    (``torch.Tag.data_dependent_output`` / ``dynamic_output_shape``; ``index`` only with a boolean mask)."""
    if func is _SCALAR_READ:
        return True
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        idx = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ())
    return True


def _is_fake(t) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor) or (isinstance(t, torch.Tensor) and t.device.type == "meta")


class CostMode(TorchDispatchMode):
    """Records the ops of a step (while ``recording``) as :class:`OpRecord` s; see the module docstring."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):  # NOTE: else Dynamo skips compiling under this mode
        return True

    def __init__(self, vocab: int | None = None, expand: bool = True):
        super().__init__()
        self.vocab = vocab
        self.expand = expand
        self.recording = False
        self.phase = "forward"
        self.records: list[OpRecord] = []
        self.assumed: dict[str, int] = {}     # data-dependent values assumed on fake tensors, by kind
        self._inside: list[str] = []
        self._vid: dict[int, int] = {}        # storage key -> current value id
        self._next = 0
        self._graphs: dict[tuple[str, str], str] = {}
        try:
            from torch.utils.flop_counter import flop_registry
        except Exception:  # pragma: no cover
            flop_registry = {}
        self._flops = flop_registry

    # ------------------------------------------------------------------------------------------------------
    def _value(self, t: torch.Tensor, new: bool) -> int:
        """The id of the value ``t`` holds; ``new``: ``t``'s storage was just written (a new version)."""
        st = _storage_key(t)
        if st is None:
            self._next += 1
            return self._next
        key = st._cdata
        if new or key not in self._vid:
            if key not in self._vid:
                weakref.finalize(st, self._vid.pop, key, None)
            self._next += 1
            self._vid[key] = self._next
        return self._vid[key]

    def _where(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if fn.startswith("<eval_with_key>"):
                key = (self.phase, fn)
                if key not in self._graphs:
                    self._graphs[key] = str(1 + sum(1 for k in self._graphs if k[0] == self.phase))
                return f"{self.phase} graph {self._graphs[key]}"
            f = f.f_back
        return "eager code"

    def _is_head(self, tensors, func) -> bool:
        if self._inside:
            return True
        if not self.vocab or func._schema.name in ("aten::embedding", "aten::embedding_dense_backward"):
            return False
        return any(self.vocab in t.shape for t in tensors)

    # ------------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_args = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        fake = any(_is_fake(a) for a in flat_args)
        # data-dependent values on fake tensors (see the module docstring): assumed, still counted as syncs
        if func is _SCALAR_READ and fake:
            out = 1.0 if args[0].is_floating_point() else (True if args[0].dtype == torch.bool else 1)
            if self.recording:
                self.assumed["scalar read on the host (.item(), int(), bool()) -> 1/True"] = \
                    self.assumed.get("scalar read on the host (.item(), int(), bool()) -> 1/True", 0) + 1
            return self._record(func, args, kwargs, flat_args, out)
        if func is _NONZERO and fake:
            a = args[0]
            out = torch.empty((a.numel(), a.dim()), dtype=torch.long, device=a.device)
            if self.recording:
                k = "nonzero keeps every element (every label valid)"
                self.assumed[k] = self.assumed.get(k, 0) + 1
            return self._record(func, args, kwargs, flat_args, out)
        if self.recording and _has_implicit(func):
            # below autograd (inside an expanded custom op) composite ops arrive whole: record what they run
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        opdef = self._custom_impl(func) if (self.recording and self.expand) else None
        if opdef is not None:
            rec = self._record(func, args, kwargs, flat_args, None, expanded=True)
            self._inside.append(str(func.name()))
            try:
                with self:
                    out = opdef(*args, **kwargs)
            finally:
                self._inside.pop()
            self._finish_custom(rec, func, args, kwargs, out)
            return out
        out = func(*args, **kwargs)
        if self.recording:
            self._record(func, args, kwargs, flat_args, out)
        return out

    @staticmethod
    def _custom_impl(func):
        """The Python implementation of a ``torch.library.custom_op`` (None for aten and other ops)."""
        if getattr(func, "namespace", "aten") in ("aten", "prims", "_c10d_functional", "c10d"):
            return None
        try:
            from torch._library.custom_ops import OPDEFS
        except Exception:  # pragma: no cover
            return None
        from effpass.memory_options import is_device_kernel

        if is_device_kernel(func._schema.name):  # one device kernel: recorded whole, never expanded
            return None
        opdef = OPDEFS.get(func._schema.name)
        return getattr(opdef, "_init_fn", None) if opdef is not None else None

    def _flop_count(self, func, args, kwargs, out, inplace: bool = False) -> int:
        """FlopCounterMode's count (``flop_registry``); ``inplace``: an in-place op without a formula of its own
        (``addmm_``, which FlopCounterMode does not count) by its out-of-place op's (the roofline's work)."""
        packet = getattr(func, "_overloadpacket", None)
        if packet is not None and packet not in self._flops and inplace and str(packet).endswith("_"):
            ns, _, name = str(packet).partition(".")
            packet = getattr(getattr(torch.ops, ns), name[:-1], None)
        if packet is None or packet not in self._flops:
            return 0
        try:
            return int(self._flops[packet](*args, **kwargs, out_val=out))
        except TypeError:
            # an overload the formula was not written for (``addmm.dtype_out``: an ``out_dtype`` argument and
            # ``out=``): the same product of the tensor operands
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            return int(self._flops[packet](*tensors, out_val=out))

    def _record(self, func, args, kwargs, flat_args, out, expanded=False):
        if not self.recording:
            return out
        schema = getattr(func, "_schema", None)
        name = str(func)
        packet = str(getattr(func, "_overloadpacket", name))
        rec = OpRecord(op=name, packet=packet, graph=self._where(), inside=self._inside[-1] if self._inside else "",
                       expanded=expanded)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)] if out is not None else []
        rec.sync = _is_sync(func, args)
        rec.head = self._is_head(flat_args + outs, func)
        rec.dtype = next((t.dtype for t in flat_args + outs if t.is_floating_point()), None)
        low = next((t.dtype for t in flat_args if t.dtype in (torch.bfloat16, torch.float16)), None)
        if low is not None and self._flops.get(getattr(func, "_overloadpacket", None)) is not None:
            rec.dtype = low  # a matmul of low-precision operands into an fp32 buffer runs at the low rate
        if out is not None:
            flops = self._flop_count(func, args, kwargs, out)
            rec.work_flops = flops or self._flop_count(func, args, kwargs, out, inplace=True)
            rec.flops = 0 if self._inside else flops
        # which arguments the op writes (in place or out=): a new version of their storage
        written = set()
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
                    for t in tree_flatten(v)[0]:
                        if isinstance(t, torch.Tensor):
                            written.add(id(t))
        alloc = schema is not None and schema.name in _ALLOC
        # ``out=`` arguments are written, not read (unless the same tensor is also an input: ``addmm(acc, ..., out=acc)``)
        out_only = set()
        if schema is not None:
            inputs = {id(t) for i, a in enumerate(schema.arguments) if not a.is_out
                      for t in tree_flatten(kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i])[0]
                      if isinstance(t, torch.Tensor)}
            out_only = {id(t) for i, a in enumerate(schema.arguments) if a.is_out
                        for t in tree_flatten(kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i])[0]
                        if isinstance(t, torch.Tensor) and id(t) not in inputs}
        part = indexed_bytes(func, args)
        in_keys = {}
        seen = set()
        for a in flat_args:
            st = _storage_key(a)
            key = st._cdata if st is not None else id(a)
            vid = self._value(a, new=False)
            in_keys[key] = vid
            if not alloc and id(a) not in out_only and (vid, id(a)) not in seen:  # a tensor passed twice: read once
                seen.add((vid, id(a)))
                rec.reads.append((vid, part.get(id(a), operand_bytes(a))))
        for a in flat_args:
            if id(a) in written:
                written.discard(id(a))  # once, however many arguments name it
                rec.writes.append((self._value(a, new=True), part.get(id(a), operand_bytes(a))))
        for o in outs:
            st = _storage_key(o)
            key = st._cdata if st is not None else id(o)
            if key in in_keys or any(id(o) == id(a) for a in flat_args):
                continue  # a view of (or the same tensor as) an input: nothing written
            rec.writes.append((self._value(o, new=True), operand_bytes(o)))
        if alloc:
            rec.writes = [(v, 0) for v, _ in rec.writes]
        self.records.append(rec)
        return rec if expanded else out

    def _finish_custom(self, rec: OpRecord, func, args, kwargs, out) -> None:
        """The expanded custom op's own record: its registered FLOPs (FlopCounterMode's), no bytes of its own
        (its implementation's ops carry them), the values it returns attributed to those ops."""
        if self._inside:  # a custom op inside another: its inner ops carry everything
            rec.flops = 0
            return
        try:
            rec.flops = self._flop_count(func, args, kwargs, out)
        except Exception:  # pragma: no cover - a formula that does not fit these arguments
            rec.flops = 0
        rec.reads, rec.writes = [], []
