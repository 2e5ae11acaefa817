"""The Python API: ``effpass.compile``, ``effpass.prepare`` and ``effpass.report``."""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch

from .backend import EffpassBackend, last_string_backend
from .config import parse_options
from .pass_api import Pass
from .report import CompileReport

__all__ = ["compile", "prepare", "report", "backend_of"]

# model / compiled module -> the backend that compiled it (weak: effpass never keeps a model alive)
_BACKENDS: "weakref.WeakKeyDictionary[torch.nn.Module, EffpassBackend]" = weakref.WeakKeyDictionary()


def _options(passes, dump_dir, lowering, strict, bisect, disable, inductor_config, mode, device):
    opts: dict[str, Any] = {"lowering": lowering, "strict": strict}
    if passes is not None:
        opts["passes"] = passes
    if dump_dir is not None:
        opts["dump_dir"] = dump_dir
    if bisect is not None:
        opts["bisect"] = bisect
    if disable:
        opts["disable"] = list(disable)
    if inductor_config:
        opts["inductor_config"] = inductor_config
    return parse_options(opts, mode=mode, device=device)


def _device_of_model(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def prepare(model: torch.nn.Module, passes: Sequence[Pass | str] | dict | None = None, *,
            dump_dir: str | None = None, lowering: str = "inductor", strict: bool = False,
            bisect: int | None = None, disable: Iterable[str] = (), inductor_config: dict | None = None,
            mode: str | None = None) -> torch.nn.Module:
    """Run the module-level phase of the pipeline on ``model`` in place and return it (as PEFT does).

    After this, the eager model computes what the compiled one will (reference semantics), and state
    that must exist before the optimizer is built (adapters, quantized weights, sharding) exists.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass expects an nn.Module, got {type(model).__name__}")
    opts = _options(passes, dump_dir, lowering, strict, bisect, disable, inductor_config, mode,
                    _device_of_model(model))
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


def compile(model: torch.nn.Module, passes: Sequence[Pass | str] | dict | None = None, *,
            dump_dir: str | None = None, lowering: str = "inductor", strict: bool = False,
            bisect: int | None = None, disable: Iterable[str] = (), inductor_config: dict | None = None,
            mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
            memory_budget: str | int | None = None, allow: Iterable[str] = (), example_inputs: Any = None,
            optimizer: str | None = "adamw", world_size: int = 1) -> torch.nn.Module:
    """Prepare ``model`` in place with the module-level passes, then compile it with the rest.

    Returns the compiled module; it wraps the same parameters as ``model``, so an optimizer built from
    either sees the same tensors. ``passes=None`` runs the default pipeline, ``passes=[]`` none.

    ``memory_budget="24GiB"`` (with ``example_inputs=`` of one training step): the memory planner adds the
    passes that fit the step into the budget with the least extra compute, lossy ones only if named in
    ``allow`` (``effpass.report(model).memory_plan`` says what and why; docs/memory_planner.md).

    >>> model = effpass.compile(model, passes=[FuseAttention(), ApplyAutocast(dtype=torch.bfloat16)])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"effpass.compile expects an nn.Module, got {type(model).__name__}")
    plan = None
    if memory_budget is not None:  # the memory planner chooses the pipeline (effpass/planning)
        from .planning.planner import plan_for_compile

        passes, plan = plan_for_compile(model, passes, memory_budget, allow, example_inputs, optimizer=optimizer,
                                        world_size=world_size, lowering=lowering, strict=strict, disable=disable)
    opts = _options(passes, dump_dir, lowering, strict, bisect, disable, inductor_config, mode,
                    _device_of_model(model))
    backend = EffpassBackend(opts, model=model)
    backend.report.memory_plan = plan
    ctx = _run_module_phase(model, backend, {"fullgraph": fullgraph, "dynamic": dynamic})
    _BACKENDS[model] = backend
    if not ctx.compile_root:  # a module-level pass compiled the units itself (e.g. FSDP per block)
        return model
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    _BACKENDS[compiled] = backend
    return compiled


def backend_of(model: torch.nn.Module | None = None) -> EffpassBackend | None:
    if model is None:
        return last_string_backend()
    be = _BACKENDS.get(model)
    if be is None and hasattr(model, "_orig_mod"):
        be = _BACKENDS.get(model._orig_mod)
    return be


def report(model: torch.nn.Module | None = None) -> CompileReport:
    """What effpass did to ``model`` (or, with no argument, to the last string-backend compile)."""
    be = backend_of(model)
    if be is None:
        raise ValueError("this model was not compiled or prepared by effpass")
    return be.report
