"""The cost of one training step on a GPU, estimated on a CPU (``effpass cost``, :func:`step_cost`).

One step (forward and backward, no optimizer) of the model compiled by effpass with the eager lowering runs under
a dispatch mode (:mod:`effpass.cost.counter`) that records every aten op: FLOPs (torch's own ``flop_registry``,
the table ``FlopCounterMode`` reads, so the totals equal its figure), the bytes each op reads and writes, host
synchronisations. The ops are grouped into kernels by a simple fusion rule that stands for Inductor's
(:mod:`effpass.cost.kernels`), and each kernel is timed by a roofline on a named GPU
(:mod:`effpass.devices`). The step runs on real tensors (small models) or on fake tensors (full-size
models: shapes only, nothing allocated).

The *loss head* is the ops that touch a tensor with a vocabulary-sized dimension (the logits' matmul, the loss,
their gradients; not the input embedding) and everything inside an effpass custom op (the fused loss ops).
Per pass, the step runs again without that pass: ``passes[name]`` is what the pass adds (positive) or removes
(negative). See docs/cost_model.md for what is counted, the constants and how to read the output.
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .counter import CostMode, OpRecord, operand_bytes
from ..devices import DEVICES, GPU, get_device, kernel_seconds
from .kernels import Kernel, build_kernels, classify

__all__ = ["StepCost", "step_cost", "config_step_cost", "DEVICES", "GPU", "get_device", "kernel_seconds",
           "CostMode", "OpRecord", "Kernel", "build_kernels", "classify", "operand_bytes", "KEYS"]

#: the figures every part of a :class:`StepCost` reports
KEYS = ("flops", "bytes", "host_syncs", "kernels", "est_time_s")


def _zero() -> dict:
    return {"flops": 0, "bytes": 0, "host_syncs": 0, "kernels": 0, "est_time_s": 0.0}


def _add(acc: dict, kern: Kernel) -> None:
    acc["flops"] += kern.flops
    acc["bytes"] += kern.bytes
    acc["host_syncs"] += kern.syncs
    acc["kernels"] += kern.launches
    acc["est_time_s"] += kern.seconds


@dataclass
class StepCost:
    """The estimated cost of one training step (forward + backward) on ``device``.

    ``totals``, ``head`` and every entry of ``graphs``, ``ops`` and ``passes`` hold :data:`KEYS`: FLOPs (as
    ``FlopCounterMode`` counts them), bytes read and written by kernels, host synchronisations, kernel launches
    and the roofline time in seconds. ``graphs`` and ``ops`` add up to ``totals`` (an op's
    ``kernels`` are those it starts, its ``bytes`` and ``est_time_s`` its share of its kernel's); ``passes[name]`` is the step
    with the pipeline minus the step without ``name``.
    """

    device: str
    pipeline: list
    totals: dict
    head: dict
    graphs: dict
    ops: dict
    passes: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    tensors: str = "real"
    records: list = field(default_factory=list, repr=False)   # OpRecord per op (not in to_dict)
    kernel_list: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``flops``, ``bytes``, ``host_syncs``, ``kernels``, ``est_time_s`` at the top level, the
        same under ``head`` and under ``passes.<name>``, and ``graphs``, ``ops``, ``device``, ``pipeline``,
        ``tensors``, ``notes``."""
        return {**self.totals, "head": dict(self.head), "passes": {k: dict(v) for k, v in self.passes.items()},
                "graphs": {k: dict(v) for k, v in self.graphs.items()},
                "ops": {k: dict(v) for k, v in self.ops.items()}, "device": self.device,
                "pipeline": list(self.pipeline), "tensors": self.tensors, "notes": list(self.notes)}

    def summary(self, top: int = 12) -> str:
        def row(name, d):
            return (name, _num(d["flops"]), _size(d["bytes"]), str(d["host_syncs"]), str(d["kernels"]),
                    f"{d['est_time_s'] * 1e3:.3f}")

        head = ("", "FLOPs", "bytes", "syncs", "kernels", "est. ms")
        lines = [f"one training step (forward + backward) on {self.device}, {self.tensors} tensors; passes: "
                 f"{', '.join(self.pipeline) or '(none)'}"]
        rows = [head, row("total", self.totals), row("loss head", self.head)]
        rows += [row(k, v) for k, v in self.graphs.items()]
        lines.append(_table(rows))
        if self.passes:
            lines.append("\nwhat each pass adds (+) or removes (-): the step with the pipeline minus without it")
            lines.append(_table([head] + [row(k, v) for k, v in self.passes.items()]))
        ops = sorted(self.ops.items(), key=lambda kv: -kv[1]["est_time_s"])[:top]
        lines.append(f"\nops by estimated time (top {len(ops)} of {len(self.ops)})")
        lines.append(_table([head] + [row(k, v) for k, v in ops]))
        share = self.head["est_time_s"] / self.totals["est_time_s"] if self.totals["est_time_s"] else 0.0
        lines.append(f"\nloss head: {100 * share:.1f}% of the estimated time")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _num(n: float) -> str:
    n = float(n)
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}" if n != int(n) else str(int(n))


def _size(n: float) -> str:
    from effpass.planning import format_bytes

    return format_bytes(n)


def _table(rows) -> str:
    from effpass.inspect import table

    return table([tuple(str(c) for c in r) for r in rows])


# ------------------------------------------------------------------------------------------------------
# running the step
# ------------------------------------------------------------------------------------------------------
def _vocab_of(model) -> int | None:
    n = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(n, int) and n > 0:
        return n
    get = getattr(model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    w = getattr(emb, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) else None


def _is_fake_model(model) -> bool:
    from .counter import _is_fake

    return any(_is_fake(p) for p in model.parameters())


def _resolve(passes, device_dtype) -> list:
    """Pass objects of ``passes`` (None: the default pipeline on a CUDA device for the model's dtype)."""
    import effpass
    from effpass.config import default_pipeline

    if passes is None:
        return default_pipeline(torch.device("cuda"), dtype=device_dtype)
    out = []
    for p in passes:
        out.append(effpass.make_pass(p) if isinstance(p, str) else p)
    return out


from effpass.planning.result import _call  # noqa: E402  (one way to call a model on a step's inputs)


def _loss_of(out):
    from effpass.verification import loss_of

    return loss_of(out)


def _copy_model(model, fake_mode):
    """A copy of ``model`` to compile (module passes change it); fake tensors are made again, not deep-copied
    (tied parameters stay tied: each tensor object is copied once)."""
    if fake_mode is None:
        return copy.deepcopy(model)
    memo: dict[int, Any] = {}

    def fresh(t):
        with fake_mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)

    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            ft = fresh(t)
            memo[id(t)] = torch.nn.Parameter(ft, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else ft
    for m in model.modules():  # tensors held as plain attributes (rotary embeddings' original_inv_freq)
        for v in m.__dict__.values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = fresh(v)
    return copy.deepcopy(model, memo)


def _record_step(model, inputs, pipeline, vocab, loss_fn, fake_mode, expand) -> tuple[CostMode, list[str]]:
    """Compile a copy of ``model`` with ``pipeline`` (eager lowering), run a warm step, record a second."""
    import effpass
    from effpass.planning.estimate import replay_patches  # the replay's process-wide patches (public there)

    torch._dynamo.reset()
    mode = CostMode(vocab=vocab, expand=expand)
    loss_fn = loss_fn or _loss_of
    ctx = contextlib.ExitStack()
    from effpass.devices import targeting

    ctx.enter_context(targeting("cuda"))  # kernels that choose by device take their CUDA path (counted as such)
    if fake_mode is not None:
        ctx.enter_context(replay_patches(torch.device("cpu"), inductor=False))
        ctx.enter_context(fake_mode)
    try:
        with ctx:
            work = _copy_model(model, fake_mode)
            with mode:
                compiled = effpass.compile(work, passes=list(pipeline), lowering="eager")
                for record in (False, True):
                    for p in work.parameters():
                        p.grad = None
                    mode.recording = record
                    mode.phase = "forward"
                    loss = loss_fn(_call(compiled, inputs))
                    mode.phase = "backward"
                    loss.backward()
                    mode.recording = False
                    del loss
            names = [p.name for p in effpass.backend_of(work).options.passes] if effpass.backend_of(work) else []
            for p in work.parameters():
                p.grad = None
    finally:
        torch._dynamo.reset()
    return mode, names


def _summarise(mode: CostMode, gpu: GPU, names) -> StepCost:
    kernels, share = build_kernels(mode.records, gpu)
    totals, head = _zero(), _zero()
    graphs: dict[str, dict] = {}
    ops: dict[str, dict] = {}
    for kern in kernels:
        _add(totals, kern)
        if kern.head:
            _add(head, kern)
        _add(graphs.setdefault(kern.graph, _zero()), kern)
    first_of = {kern.ops[0]: kern for kern in kernels}
    # a kernel's time is shared among its ops by the bytes credited to them (all of it to its first op when it
    # moves none): a fused chain's time is not all its first op's
    seconds = [0.0] * len(mode.records)
    for kern in kernels:
        if kern.bytes:
            for i in kern.ops:
                seconds[i] += kern.seconds * share[i] / kern.bytes
        else:
            seconds[kern.ops[0]] += kern.seconds
    for i, rec in enumerate(mode.records):
        if rec.kind == "free":
            continue
        key = f"{rec.inside} > {rec.packet}" if rec.inside else rec.packet
        d = ops.setdefault(key, {**_zero(), "calls": 0})
        d["calls"] += 1
        d["flops"] += rec.flops
        d["bytes"] += share[i]
        d["host_syncs"] += int(rec.sync)
        d["est_time_s"] += seconds[i]
        kern = first_of.get(i)
        if kern is not None:
            d["kernels"] += kern.launches
    notes = []
    if mode.assumed:
        notes.append("fake tensors: data-dependent values assumed (" +
                     "; ".join(f"{k}: {n}x" for k, n in mode.assumed.items()) + ")")
    if not mode.vocab:
        notes.append("no vocabulary size found (model.config.vocab_size or an output embedding): no loss head")
    return StepCost(device=gpu.name, pipeline=list(names), totals=totals, head=head, graphs=graphs, ops=ops,
                    notes=notes, records=mode.records, kernel_list=kernels)


def _minus(a: dict, b: dict) -> dict:
    return {k: a[k] - b[k] for k in KEYS}


def step_cost(model: torch.nn.Module, inputs, passes=None, device: str | GPU = "h100", *,
              loss_fn: Callable | None = None, vocab: int | None = None, per_pass: bool = True,
              expand: bool = True) -> StepCost:
    """The estimated cost of one training step of ``model`` on ``inputs`` (a dict of keyword arguments, a tuple
    or a tensor) compiled by effpass with ``passes`` (pass objects or names; None: the default pipeline on a
    CUDA device, ``[]``: none, i.e. plain compile's graphs) on the GPU ``device`` (``"h100"``, ``"h200"`` or a
    :class:`GPU`). The model is copied, never changed. Its parameters may be fake tensors (made under a
    ``FakeTensorMode``, whose mode is then used for the step): nothing is allocated.

    ``loss_fn(output) -> scalar`` (default: ``output.loss``, a leading scalar, or a sum); ``vocab``: the
    vocabulary size that marks the loss head (default: ``model.config.vocab_size`` or the output embedding's
    rows); ``per_pass``: also run without each pass (``StepCost.passes``); ``expand``: record the ops inside
    custom ops with a Python implementation (the fused loss head's chunks) rather than the op alone.
    """
    gpu = get_device(device)
    vocab = vocab if vocab is not None else _vocab_of(model)
    fake_mode = None
    if _is_fake_model(model):
        p = next(iter(model.parameters()))
        fake_mode = getattr(p, "fake_mode", None)
        if fake_mode is None:
            raise ValueError("effpass cost: the model's parameters are on the meta device; make them fake tensors "
                             "(build the model under torch._subclasses.FakeTensorMode) or real ones")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    pipeline = _resolve(passes, dtype)
    mode, names = _record_step(model, inputs, pipeline, vocab, loss_fn, fake_mode, expand)
    cost = _summarise(mode, gpu, names)
    cost.tensors = "fake" if fake_mode is not None else "real"
    if per_pass:
        for p in pipeline:
            rest = [q for q in pipeline if q is not p]
            other, _ = _record_step(model, inputs, rest, vocab, loss_fn, fake_mode, expand)
            cost.passes[p.name] = _minus(cost.totals, _summarise(other, gpu, []).totals)
    return cost


# ------------------------------------------------------------------------------------------------------
# from a Hugging Face config (the command line, bench/)
# ------------------------------------------------------------------------------------------------------
def config_step_cost(config, batch: int, seq: int, *, dtype: str | None = None, passes=None,
                     device: str | GPU = "h100", layers: int | None = None, tensors: str = "auto",
                     per_pass: bool = True, overrides: dict | None = None) -> StepCost:
    """:func:`step_cost` of a causal LM built from a Hugging Face config (a config.json path, a dict or a
    ``PretrainedConfig``) with random weights, on ``input_ids = labels`` of shape ``(batch, seq)``.
    ``layers``: keep that many decoder layers; ``tensors``: ``"real"``, ``"fake"`` (shapes only: full-size
    models) or ``"auto"`` (fake above 2**28 parameter bytes); ``overrides``: config fields to set."""
    import transformers as tf

    from effpass.planning.cli import model_from_config
    from effpass.verification import apply_config_overrides, shrink_config

    if batch < 1 or seq < 1:
        raise ValueError(f"effpass cost: batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if tensors not in ("auto", "real", "fake"):
        raise ValueError(f"effpass cost: tensors={tensors!r} is not valid; choose one of ['auto', 'real', 'fake']")
    get_device(device)  # an unknown device fails before the model is built
    meta = model_from_config(config, dtype)
    cfg = meta.config
    torch_dtype = next(p.dtype for p in meta.parameters())
    if layers is not None:
        cfg = shrink_config(cfg, layers)
    apply_config_overrides(cfg, overrides, "effpass cost")
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    n_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    if layers is not None:
        per = getattr(meta.config, "num_hidden_layers", None) or 1
        n_bytes = n_bytes * min(layers, per) // per
    del meta
    fake = tensors == "fake" or (tensors == "auto" and n_bytes > 2 ** 28)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) or None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
            ids = torch.zeros(batch, seq, dtype=torch.long)
    else:
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab or 2, (batch, seq), generator=g)
    model.train()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    return step_cost(model, inputs, passes=passes, device=device, vocab=vocab, per_pass=per_pass)


def to_json(cost: StepCost) -> str:
    return json.dumps(cost.to_dict(), indent=1, default=str)

