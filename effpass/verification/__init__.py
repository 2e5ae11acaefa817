"""``effpass verify``: check a pipeline against reference semantics on a model, bisecting to the pass at fault.

Reference semantics (the project's promise): after effpass prepares a model, the *eager* prepared model
computes the same function as the compiled one. :func:`verify` checks it on the user's model (or a Hugging
Face config shrunk to two layers) with one batch:

1. each pass of the pipeline alone, then the whole pipeline: forward outputs, the loss and every parameter
   gradient of the compiled model against the eager prepared model in fp32, within the pass's stated bound
   (:meth:`effpass.Pass.verify_tolerance`: 1e-5 relative for lossless passes; an autocast pass states its
   dtype's bound), errors measured as ``||a - b|| / ||b||`` per tensor;
2. packed rows (when the pipeline packs sequences, or ``packed=True``): each example of a packed row
   (``position_ids`` restarting at every example, as ``DataCollatorWithFlattening`` gives) against the same
   example run alone by the eager model: logits within the bound;
3. on a mismatch of the whole pipeline it bisects (the first N passes of the ordered pipeline) to the first
   failing pass and names the site: the tensor that differs most and the module it belongs to.

``effpass.compile(model, verify=True)`` runs the same check on the first call's inputs (docs/verify.md
gives its time and memory cost) and turns a failing graph pass off with a warning; ``strict=True`` raises.

    report = effpass.verify(model, example_inputs)        # or: effpass verify CONFIG.json
    assert report.ok, report.to_text()
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .hf import apply_config_overrides, hf_inputs, model_from_hf_config, shrink_config  # noqa: F401 (public here)

__all__ = ["verify", "VerifyReport", "Check", "VerifyError", "shrink_config", "model_from_hf_config"]


class VerifyError(RuntimeError):
    """A pipeline failed verification and could not be turned off safely (or ``strict=True``)."""


@dataclass
class Check:
    """One comparison of a compiled model against its eager reference."""

    label: str                      #: "pipeline", "fuse_attention alone", "packed rows", "first 2 passes"
    passes: list[str]
    bound: float
    ok: bool = True
    #: worst relative error per kind: "output", "loss", "grad"
    errors: dict[str, float] = field(default_factory=dict)
    worst: str = ""                 #: the tensor that differs most ("grad model.layers.0.mlp.up_proj.weight")
    error: str | None = None        #: an exception raised by the compiled or the reference run
    #: outputs the eager model returns and the compiled one does not (by design, e.g. the fused head's
    #: logits in training: the loss and every gradient are still compared)
    not_returned: list[str] = field(default_factory=list)

    def line(self) -> str:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in self.errors.items())
        status = "ok" if self.ok else "FAIL"
        detail = f"raised {self.error}" if self.error else f"{errs or 'no tensors'} (bound {self.bound:.0e})"
        if not self.ok and self.worst and not self.error:
            detail += f"; worst: {self.worst}"
        if self.not_returned:
            detail += f"; not returned by the compiled model: {', '.join(self.not_returned)}"
        return f"{status:4}  {self.label}: {detail}"


@dataclass
class VerifyReport:
    checks: list[Check] = field(default_factory=list)
    #: the first failing pass found by bisection (None when the pipeline passed)
    failing_pass: str | None = None
    #: where it fails: the tensor and module that differ most
    site: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failing_passes(self) -> list[str]:
        """Passes whose check alone failed, and the bisected one."""
        out = [c.passes[0] for c in self.checks if not c.ok and c.label.endswith(" alone")]
        if self.failing_pass and self.failing_pass not in out:
            out.append(self.failing_pass)
        return out

    def to_text(self) -> str:
        lines = [c.line() for c in self.checks]
        if self.failing_pass:
            lines.append(f"first failing pass: {self.failing_pass}" + (f" at {self.site}" if self.site else ""))
        lines.append(("verified: " if self.ok else "NOT verified: ") + f"{len(self.checks)} checks in {self.seconds:.1f} s")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
def _tensors(out, prefix: str = "output") -> dict[str, torch.Tensor]:
    """The floating tensors of a model output, by a readable path (loss first)."""
    found: dict[str, torch.Tensor] = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                found[path] = x.detach().float()
        elif isinstance(x, dict) or hasattr(x, "items"):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(out, prefix)
    return found


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) else math.inf
    return float((a - b).norm() / max(float(b.norm()), floor))


def _compare(check: Check, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], kind_of: Callable[[str], str]):
    # NOTE(floor): an error is relative to the tensor's norm, but no less than 1e-3 of the largest norm of its
    # kind: some gradients are zero in exact arithmetic (a key projection's bias: softmax ignores a constant
    # added to every score) and are rounding noise in both models
    largest: dict[str, float] = {}
    for name, r in ref.items():
        largest[kind_of(name)] = max(largest.get(kind_of(name), 0.0), float(r.float().norm()))
    worst = -1.0
    for name, r in ref.items():
        g = got.get(name)
        kind = kind_of(name)
        floor = max(1e-3 * largest[kind], 1e-12)
        if g is None and kind == "output":
            check.not_returned.append(name)
            continue
        err = math.inf if g is None else _rel(g, r, floor)
        check.errors[kind] = max(check.errors.get(kind, 0.0), err)
        if err > worst:
            worst, check.worst = err, f"{name} (relative error {err:.1e})"
    missing = [n for n in got if n not in ref and kind_of(n) == "grad"]
    if missing:  # a gradient the reference does not have: the compiled model trains something else
        check.errors["grad"] = math.inf
        check.worst = f"{missing[0]} has a gradient only in the compiled model"
    check.ok = all(v <= check.bound for v in check.errors.values())


def _kind(name: str) -> str:
    if name.startswith("grad "):
        return "grad"
    return "loss" if name.endswith(".loss") or name == "output.loss" else "output"


def loss_of(out) -> torch.Tensor:
    """A scalar loss from a model output: HF ``ModelOutput.loss``, a ``(loss, ...)`` tuple, or a sum."""
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    if isinstance(out, (tuple, list)):
        return out[0] if out[0].dim() == 0 else out[0].float().sum()
    if hasattr(out, "logits"):
        return out.logits.float().pow(2).mean()
    return out.float().pow(2).mean()


def _run(model: torch.nn.Module, inputs, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    found = _tensors(out)
    loss = loss_of(out)
    if loss.requires_grad:
        loss.backward()
    found.setdefault("output.loss", loss.detach().float())
    for n, p in model.named_parameters():
        if p.grad is not None:
            found[f"grad {n}"] = p.grad.detach().float()
    return found


def _bound(passes: Sequence[Any]) -> float:
    return max([1e-5] + [float(p.verify_tolerance()) for p in passes if hasattr(p, "verify_tolerance")])


def _site(worst: str) -> str:
    """'grad model.layers.0.mlp.up_proj.weight (...)' -> that, plus the module it belongs to."""
    name = worst.split(" (", 1)[0]
    if name.startswith("grad "):
        param = name[5:]
        return f"{name} (module {param.rsplit('.', 1)[0] or '(root)'})"
    return name


def _with_boundaries(inputs, passes):
    """Packing passes refuse training calls without example boundaries, and several rows per call where a
    mask cannot be proven per example: check them on one row holding one example (the packed-rows check
    covers several examples per row)."""
    if not isinstance(inputs, dict) or not any(p.name == "pack_sequences" for p in passes):
        return inputs
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return inputs
    b, n = ids.shape
    one = {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b else v)
           for k, v in inputs.items()}
    one.setdefault("position_ids", torch.arange(n).unsqueeze(0))
    return one


def _check(model: torch.nn.Module, inputs, passes: list, label: str, *, lowering: str, seed: int,
           bisect: int | None = None) -> Check:
    import effpass

    effpass_compile = effpass.compile

    names = [p.name for p in passes][: bisect if bisect is not None else None]
    check = Check(label=label, passes=names, bound=_bound(passes[: len(names)]))
    inputs = _with_boundaries(inputs, passes[: len(names)])
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    try:
        compiled = effpass_compile(m, passes=list(passes), lowering=lowering, bisect=bisect)
        reference = copy.deepcopy(m)  # the eager prepared model (a copy of an effpass-compiled model is eager)
        ref = _run(reference, inputs, seed)
        got = _run(compiled, inputs, seed)
    except Exception as e:  # noqa: BLE001 - reported as a failed check, with the error
        check.ok, check.error = False, _error_text(e)
        return check
    finally:
        m = compiled = reference = None  # noqa: F841  (free both models before the next check)
        _release()
    _compare(check, got, ref, _kind)
    return check


def _error_text(e: Exception) -> str:
    e = getattr(e, "inner_exception", e)  # Dynamo wraps what a backend raises
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _release() -> None:
    import gc

    torch._dynamo.reset()
    gc.collect()


# ------------------------------------------------------------------------------------------------------
def _packed_inputs(inputs: dict, lengths: Sequence[int] | None):
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("the packed-rows check needs `input_ids` of shape (batch, seq) in the example inputs")
    flat = ids.reshape(-1)
    n = flat.numel()
    if lengths is None:  # three examples of unequal lengths
        a = max(2, n // 3 - 1)
        b = max(2, (n - a) // 2 + 1)
        lengths = [a, b, n - a - b]
    if sum(lengths) != n or min(lengths) < 1:
        raise ValueError(f"packed lengths {list(lengths)} must be positive and sum to {n} tokens")
    pos = torch.cat([torch.arange(k) for k in lengths]).unsqueeze(0)
    return flat.unsqueeze(0), pos, list(lengths)


def _packed_check(model, inputs, passes, *, lowering, seed, lengths=None) -> Check:
    import effpass

    effpass_compile = effpass.compile

    check = Check(label="packed rows", passes=[p.name for p in passes], bound=_bound(passes))
    row, pos, lengths = _packed_inputs(inputs, lengths)
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    try:
        compiled = effpass_compile(m, passes=list(passes), lowering=lowering)
        reference = copy.deepcopy(m)
        reference.eval()  # examples alone: no dropout either way (the compiled model runs in train mode)
        torch.manual_seed(seed)
        # labels make it a training call as trainers make it (boundaries come from position_ids)
        out = compiled(input_ids=row, position_ids=pos, labels=row.clone())
        logits = getattr(out, "logits", None)
        if logits is None:  # the fused head returns no logits in training: ask again without labels
            out = compiled(input_ids=row, position_ids=pos)
            logits = out.logits
        got, ref = {}, {}
        start = 0
        with torch.no_grad():
            for i, k in enumerate(lengths):
                alone = reference(input_ids=row[:, start:start + k],
                                  position_ids=torch.arange(k).unsqueeze(0)).logits
                got[f"example {i} logits"] = logits[:, start:start + k].detach().float()
                ref[f"example {i} logits"] = alone.float()
                start += k
    except Exception as e:  # noqa: BLE001
        check.ok, check.error = False, _error_text(e)
        return check
    finally:
        m = compiled = reference = None  # noqa: F841
        _release()
    _compare(check, got, ref, lambda n: "output")
    return check


def resolve_pipeline(model: torch.nn.Module, passes) -> list:
    """The ordered pass objects ``effpass.compile(model, passes=passes)`` would run (the default pipeline for
    the model's device and dtype when ``passes`` is None)."""
    from ..config import default_pipeline, parse_options
    from ..manager import order_passes

    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    if passes is None:
        return order_passes(default_pipeline(device, p.dtype if p is not None else None))
    return order_passes(list(parse_options({"passes": passes}, device=device).passes))


def verify(model: torch.nn.Module, example_inputs: Any, passes=None, *, lowering: str = "eager",
           alone: bool = True, packed: bool | None = None, packed_lengths: Sequence[int] | None = None,
           seed: int = 0, progress: bool | None = None) -> VerifyReport:
    """Check ``passes`` (default: the default pipeline) on ``model`` with ``example_inputs`` (a dict of keyword
    arguments or a tuple of positional ones). ``model`` is not changed (every check works on a copy).

    ``alone``: also check each pass by itself. ``packed``: also check packed rows against examples alone
    (default: when the pipeline has ``pack_sequences``). Returns a :class:`VerifyReport`; it never raises for
    a mismatch (read ``report.ok``)."""
    import time

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass.verify expects an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (dict, tuple, list)):
        raise TypeError("example_inputs must be a dict of keyword arguments or a tuple of positional ones, got "
                        f"{type(example_inputs).__name__}")
    t0 = time.perf_counter()
    pipeline = resolve_pipeline(model, passes)
    names = [p.name for p in pipeline]
    if packed is None:
        packed = "pack_sequences" in names
    was_training = model.training
    model = copy.deepcopy(model).train()
    total = (len(pipeline) if alone and len(pipeline) > 1 else 0) + 1 + (1 if packed else 0)
    from ..progress import progress as _progress

    bar = _progress(total, "effpass verify", progress)
    report = VerifyReport()
    try:
        if alone and len(pipeline) > 1:
            for p in pipeline:
                bar.set_postfix_str(p.name)
                report.checks.append(_check(model, example_inputs, [p], f"{p.name} alone", lowering=lowering, seed=seed))
                bar.update()
        bar.set_postfix_str("pipeline")
        whole = _check(model, example_inputs, pipeline, "pipeline", lowering=lowering, seed=seed)
        report.checks.append(whole)
        bar.update()
        if not whole.ok and pipeline:
            report.failing_pass, report.site = _bisect(model, example_inputs, pipeline, whole,
                                                       lowering=lowering, seed=seed)
        if packed:
            if not isinstance(example_inputs, dict):
                raise TypeError("the packed-rows check needs keyword example inputs (input_ids=...)")
            bar.set_postfix_str("packed rows")
            pc = _packed_check(model, example_inputs, pipeline, lowering=lowering, seed=seed, lengths=packed_lengths)
            report.checks.append(pc)
            bar.update()
            if not pc.ok and report.failing_pass is None:
                report.failing_pass = "pack_sequences" if "pack_sequences" in names else None
                report.site = _site(pc.worst) if pc.worst else None
    finally:
        bar.close()
        model.train(was_training)
    report.seconds = time.perf_counter() - t0
    return report


def _bisect(model, inputs, pipeline, whole: Check, *, lowering, seed) -> tuple[str, str | None]:
    """The first N such that the first N passes fail; returns (pass N, the site of its worst mismatch)."""
    lo, hi = 1, len(pipeline)  # the first hi passes fail (the whole pipeline did)
    failing = whole
    while lo < hi:
        mid = (lo + hi) // 2
        c = _check(model, inputs, pipeline, f"first {mid} passes", lowering=lowering, seed=seed, bisect=mid)
        if c.ok:
            lo = mid + 1
        else:
            hi, failing = mid, c
    site = None if failing.error else _site(failing.worst)
    if failing.error:
        site = failing.error
    return pipeline[hi - 1].name, site


# ------------------------------------------------------------------------------------------------------
# verify=True in effpass.compile: the check on the first call's inputs
# ------------------------------------------------------------------------------------------------------
class FirstCallVerifier:
    """Runs :func:`verify` on the first call's inputs against a copy of the model taken before effpass
    prepared it, then frees the copy. A failing pass that acts on graphs only is turned off (the model is
    compiled again without it) with a warning naming it and the error; a failing pass that changed the eager
    model (module phase) cannot be undone in place: it raises :class:`VerifyError`, as ``strict=True`` does."""

    def __init__(self, original: torch.nn.Module, passes, *, lowering: str, strict: bool, recompile: Callable):
        self.original, self.passes, self.lowering, self.strict = original, passes, lowering, strict
        self.recompile = recompile
        self.pipeline = resolve_pipeline(original, passes)
        self.report: VerifyReport | None = None

    def __call__(self, args, kwargs):
        import warnings

        from ..pass_api import Phase

        original, self.original = self.original, None
        if original is None:
            return
        inputs = dict(kwargs) if not args else tuple(args)
        if args and kwargs:
            raise VerifyError("verify=True needs the first call's inputs all positional or all keyword")
        self.report = rep = verify(original, inputs, self.passes, lowering=self.lowering)
        del original
        if rep.ok:
            return
        bad = rep.failing_passes or ["(pipeline)"]
        msg = f"effpass verify=True: the first call failed verification:\n{rep.to_text()}"
        pipeline = {p.name: p for p in self.pipeline}
        module_level = [n for n in bad if n in pipeline and Phase.MODULE in type(pipeline[n]).phases()]
        if self.strict or module_level or bad == ["(pipeline)"]:
            raise VerifyError(msg + (f"\npasses {module_level} changed the eager model and cannot be turned off "
                                     "in place: compile again without them" if module_level else ""))
        warnings.warn(msg + f"\nturning off {bad} for this model (strict=True raises instead)", RuntimeWarning,
                      stacklevel=4)
        return self.recompile(bad)
