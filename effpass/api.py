"""The Python API: ``effpass.compile``, ``effpass.prepare`` and ``effpass.report``."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from .backend import MODEL_BACKENDS, EffpassBackend, compile_in_place, last_string_backend, string_backends
from .config import compile_options
from .pass_api import Pass
from .report import CompileReport

__all__ = ["compile", "prepare", "report", "backend_of"]

# model / compiled module -> the backend that compiled it (weak: effpass never keeps a model alive)
_BACKENDS = MODEL_BACKENDS


def checked_keywords(func):
    """``func`` with its keyword arguments checked before anything runs: an unknown one raises a ``TypeError``
    naming effpass's function, the bad keyword, the closest valid one and every valid one (Python's own error
    says only "unexpected keyword argument")."""
    import difflib
    import functools
    import inspect

    params = inspect.signature(func).parameters
    valid = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        bad = [k for k in kwargs if k not in params]
        if bad:
            close = difflib.get_close_matches(bad[0], valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"effpass.{func.__name__}: unknown keyword argument {bad[0]!r}{hint}; valid: "
                            f"{', '.join(valid)}")
        return func(*args, **kwargs)

    return wrapper


def _device_of_model(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@checked_keywords
def prepare(model: torch.nn.Module, passes: Sequence[Pass | str] | dict | None = None, *,
            dump_dir: str | None = None, lowering: str = "inductor", strict: bool = False,
            allow_fallback: bool = False,
            bisect: int | None = None, disable: Iterable[str] = (), inductor_config: dict | None = None,
            mode: str | None = None, detailed_stats: bool = False) -> torch.nn.Module:
    """Run the module-level phase of the pipeline on ``model`` in place and return it (as PEFT does).

    After this, the eager model computes what the compiled one will (reference semantics), and state
    that must exist before the optimizer is built (adapters, quantized weights, sharding) exists.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass expects an nn.Module, got {type(model).__name__}")
    opts = compile_options(passes=passes, dump_dir=dump_dir, lowering=lowering, strict=strict,
                           allow_fallback=allow_fallback, bisect=bisect,
                           disable=disable, inductor_config=inductor_config, detailed_stats=detailed_stats,
                           mode=mode, device=_device_of_model(model))
    backend = EffpassBackend(opts, model=model)
    _run_module_phase(model, backend)
    _BACKENDS[model] = backend
    return model


def _run_module_phase(model: torch.nn.Module, backend: EffpassBackend, compile_kwargs: dict | None = None):
    import os

    report = backend.report.module
    if backend.options.dump_dir:
        report.dump_path = os.path.join(backend.options.dump_dir, "module")
        os.makedirs(report.dump_path, exist_ok=True)
    ctx = backend.manager.run_module_phase(
        model, report, device=_device_of_model(model), lowering=backend.options.lowering,
        backend_factory=lambda: backend, compile_kwargs=dict(compile_kwargs or {}))
    if backend.dump and report.dump_path:
        backend.dump.write_index(report)
    return ctx


@checked_keywords
def compile(model: torch.nn.Module, passes: Sequence[Pass | str] | dict | None = None, *,
            dump_dir: str | None = None, lowering: str = "inductor", strict: bool = False,
            allow_fallback: bool = False,
            bisect: int | None = None, disable: Iterable[str] = (), inductor_config: dict | None = None,
            mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
            detailed_stats: bool = False, memory_budget: str | int | None = None, allow: Iterable[str] = (),
            example_inputs: Any = None, optimizer: str | None = "adamw", world_size: int = 1,
            verify: bool = False) -> torch.nn.Module:
    """Prepare ``model`` in place with the module-level passes, then compile it in place with the rest.

    Like ``nn.Module.compile()``, the model itself is compiled and returned: the same object and class,
    with its ``forward`` signature, ``config``, ``save_pretrained``, ``generate``, ``.to()`` and
    ``state_dict`` keys, so Hugging Face ``Trainer``/TRL and optimizers see the model they expect.
    ``passes=None`` runs the default pipeline (chosen per graph from the graph's inputs' device and
    dtype), ``passes=[]`` none. A Hugging Face model also gets effpass's take on gradient checkpointing
    and adapter saving (:mod:`effpass.integrations.huggingface`).

    ``memory_budget="24GiB"``: the memory planner adds the passes that fit the step into the budget with the
    least extra compute, lossy ones only if named in ``allow``; with ``example_inputs=`` of one training step
    it plans before compiling, without them on the first call (options that act on graphs only: one that
    must change the eager model first, a quantized base or sharding, raises asking for ``example_inputs``);
    ``effpass.report(model).memory_plan`` says what and why (docs/memory_planner.md).

    ``verify=True``: on the first call, check the pipeline against the eager model on that call's inputs
    (:func:`effpass.verify`; each pass alone and all together, forward, loss and gradients) and turn a failing
    graph pass off with a warning naming it (``strict=True`` raises). It keeps a copy of the unprepared model
    until the first call and compiles the model once per pass plus twice more on that call (docs/verify.md).

    >>> model = effpass.compile(model, passes=[FuseAttention(), ApplyAutocast(dtype=torch.bfloat16)])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("effpass.compile got a torch.compile'd module (OptimizedModule); pass the model itself "
                        "(its ._orig_mod): effpass compiles it in place")
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {type(verify).__name__} {verify!r}")
    original = None
    if verify:
        import copy

        original = copy.deepcopy(model)  # before any pass changes it: verification's reference
    plan = None
    deferred = False
    if memory_budget is not None:  # the memory planner chooses the pipeline (effpass/planning)
        from .planning import planner

        if example_inputs is None:  # planned on the first call (graph options only); raises if not enough
            planner.check_plan_without_inputs(model, passes, allow, optimizer, world_size)
            from .config import parse_size

            parse_size(memory_budget, "memory_budget")
            deferred = True
        else:
            passes, plan = planner.plan_for_compile(model, passes, memory_budget, allow, example_inputs,
                                                    optimizer=optimizer, world_size=world_size, lowering=lowering,
                                                    strict=strict, disable=disable)
    opts = compile_options(passes=passes, dump_dir=dump_dir, lowering=lowering, strict=strict,
                           allow_fallback=allow_fallback, bisect=bisect,
                           disable=disable, inductor_config=inductor_config, detailed_stats=detailed_stats,
                           mode=mode, device=_device_of_model(model))
    backend = EffpassBackend(opts, model=model)
    backend.report.memory_plan = plan
    ctx = _run_module_phase(model, backend, {"fullgraph": fullgraph, "dynamic": dynamic})
    _BACKENDS[model] = backend
    _check_targets_now(model, backend)
    if not ctx.compile_root:  # a module-level pass compiled the units itself (e.g. FSDP per block)
        return model
    compile_in_place(model, backend, fullgraph=fullgraph, dynamic=dynamic)
    if original is not None:
        _verify_on_first_call(model, backend, original, passes)
    if deferred:  # after verification's hook: the plan is made first on the first call, then verification
        planner.plan_on_first_call(model, passes, memory_budget, allow, optimizer, world_size, lowering=lowering,
                                   strict=strict, disable=disable,
                                   on_backend=lambda b: _BACKENDS.__setitem__(model, b))
    import sys

    if "transformers" in sys.modules:  # a Hugging Face model implies transformers is imported
        from .integrations import huggingface

        huggingface.attach(model)
    return model


def _check_targets_now(model: torch.nn.Module, backend: EffpassBackend) -> None:
    """Every pass's ``targets``/``exclude`` globs against the prepared model's module names, before
    ``effpass.compile`` returns: the check graph passes make when their first graph is compiled (the same
    ``Scope`` check, recorded per model so it is not repeated), made here so that a glob that matches no module
    raises ``TargetMatchError`` now rather than inside Dynamo's wrapper on the first call."""
    from .scope import Scope

    for p in backend.manager.active:
        if getattr(p, "targets", None) or getattr(p, "exclude", None):
            Scope(p.name, p.targets, p.exclude, root=model)


def _verify_on_first_call(model, backend: EffpassBackend, original, passes) -> None:
    import dataclasses

    from .verification import FirstCallVerifier

    def recompile(bad: list[str]):
        opts = dataclasses.replace(backend.options, disable=tuple(backend.options.disable) + tuple(bad))
        new = EffpassBackend(opts, model=model, report=backend.report)
        compile_in_place(model, new, **getattr(model, "_effpass_compile_kwargs", {}))
        return model._compiled_call_impl

    verifier = FirstCallVerifier(original, passes, lowering=backend.options.lowering, strict=backend.options.strict,
                                 recompile=recompile)
    model._compiled_call_impl.first_input_checks.append(verifier)
    backend.report.verifier = verifier


def backend_of(model: torch.nn.Module | None = None) -> EffpassBackend | None:
    """The backend ``effpass.compile``/``prepare`` made for ``model`` (or, with no model, the last string
    backend)."""
    if model is None:
        return last_string_backend()
    be = _BACKENDS.get(model)
    if be is None and hasattr(model, "_orig_mod"):
        be = _BACKENDS.get(model._orig_mod)
    return be


def report(model: torch.nn.Module | None = None) -> CompileReport:
    """What effpass did to ``model``, however it was compiled (``effpass.compile``, ``effpass.prepare``,
    ``torch.compile(model, backend="effpass")`` or ``model.compile(backend="effpass")``), and to that model
    only: the graphs compiled while it was called, and string-backend graphs that Dynamo reused for it (a model
    of the same class and shapes compiled with the same options runs the first one's graphs; NOTE(shared
    graphs) in effpass/backend.py). With no argument: the last string-backend compile."""
    if model is None:
        be = last_string_backend()
        if be is None:
            raise ValueError("no model has been compiled with backend='effpass' yet; pass the model: "
                             "effpass.report(model)")
        return be.report
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass.report expects an nn.Module, got {type(model).__name__}")
    be = backend_of(model)
    if be is not None and be.dump and be.report.module.dump_path and any(
            r.live_stats is not None for r in be.report.module.records):
        be.dump.write_index(be.report.module)  # live statistics (per-step counters) into the dump, read now
    graphs = [g for b in string_backends() for g in b.report.for_model(model).graphs]
    if be is not None:  # effpass.compile / prepare (then perhaps torch.compile(backend="effpass"))
        return be.report if not graphs else CompileReport(module=be.report.module, graphs=be.report.graphs + graphs)
    if not graphs:
        raise ValueError(f"effpass has compiled no graph of this {type(model).__name__}: compile it with "
                         "effpass.compile(model) or torch.compile(model, backend='effpass') and call it first")
    return CompileReport(graphs=graphs)
