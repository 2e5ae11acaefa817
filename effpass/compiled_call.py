"""Compiling a module in place (``effpass.compile(model)``): the compiled call installed as the model's
``_compiled_call_impl`` (what ``nn.Module.compile()`` installs, in a wrapper that copies and pickles leave behind),
and which backend compiled which model. ``effpass.backend`` re-exports these names."""
from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

#: an ``effpass.backend.EffpassBackend`` (not imported here: the backend imports this module)
_Backend = Any

__all__ = ["MODEL_BACKENDS", "compile_in_place", "compiled_backend", "pipeline_names"]


#: model -> the backend effpass.compile / effpass.prepare made for it (weak: effpass keeps no model alive)
MODEL_BACKENDS: "weakref.WeakKeyDictionary[torch.nn.Module, _Backend]" = weakref.WeakKeyDictionary()


class _CompiledCall:
    """``model._compiled_call_impl`` for a model effpass compiled in place (what ``nn.Module.compile()``
    installs, in a wrapper that a copy or a pickle of the model leaves behind).

    NOTE(copies): ``copy.deepcopy`` copies a plain function by reference, so a deep copy of a model
    compiled with ``nn.Module.compile()`` would still run the *original* model's compiled code. A copy of
    an effpass-compiled model is the eager, prepared model instead (it computes the same function).
    """

    def __init__(self, fn, backend: _Backend):
        self.fn, self.backend = fn, backend
        #: callables run (once, eagerly) before the first call: integrations' checks of the caller
        self.first_call_checks: list = []
        #: callables ``check(args, kwargs)`` run (once, eagerly) on the first call's inputs (``verify=True``);
        #: one may return a new compiled call to run instead (the model compiled again without a pass)
        self.first_input_checks: list = []

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            self._compiled_again()
        if self.first_call_checks:
            self._run_checks()
        if "torch.distributed.fsdp" in sys.modules and self._sharded_since_compile():
            model = self.backend.model
            return model._call_impl(*args, **kwargs)  # FSDP2's hooks, then the forwards compiled per unit
        if self.first_input_checks:
            replacement = self._run_input_checks(args, kwargs)
            if replacement is not None:
                return replacement(*args, **kwargs)
        return self.fn(*args, **kwargs)

    @torch._dynamo.disable
    def _sharded_since_compile(self) -> bool:
        """NOTE(FSDP2 after compile): accelerate's FSDP2 plugin shards a model that effpass.compile already
        compiled in place. Compiled as a whole, FSDP2's hooks (which Dynamo skips) would split the graph at
        every unit and no pass would see an attention or the head. The first call that finds the model
        sharded recompiles it the way wrap_fsdp does (inside each unit, the root around them: the
        ``adopt_fsdp`` extension wrap_fsdp registers) and hands the model back its hooked ``_call_impl``."""
        from torch.distributed.fsdp import FSDPModule

        model = self.backend.model
        if model is None or not isinstance(model, FSDPModule):
            return False
        from .pass_api import get_extension

        stats = get_extension("adopt_fsdp")(model, self.backend, getattr(model, "_effpass_compile_kwargs", {}))
        self.backend.report.module.notes["adopted_fsdp"] = stats
        model._compiled_call_impl = None
        return True

    @torch._dynamo.disable
    def _run_input_checks(self, args, kwargs):
        checks, self.first_input_checks = self.first_input_checks, []
        replacement = None
        for check in checks:
            replacement = check(args, kwargs) or replacement
        return replacement

    @torch._dynamo.disable
    def _run_checks(self):
        # NOTE(dynamo): disabled, so an outer torch.compile tracing this call runs the checks eagerly
        # (they walk the Python stack) instead of tracing them.
        for check in self.first_call_checks:
            check()
        self.first_call_checks = []

    @torch._dynamo.disable
    def _compiled_again(self):
        # An outer torch.compile (e.g. accelerate for TrainingArguments(torch_compile=True)) traces into
        # the effpass-compiled call: Dynamo would inline it and compile the plain model, effpass's passes
        # silently not running. Run the caller's checks (they name the option), else say it plainly.
        self._run_checks()
        raise RuntimeError("this model was compiled in place by effpass.compile and is being compiled again by "
                           "an outer torch.compile, which would bypass effpass; call the model directly (do not "
                           "wrap it in torch.compile again)")

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (_none, ())


def _none():
    return None


def compiled_backend(model: torch.nn.Module) -> _Backend | None:
    """The backend of a model ``effpass.compile`` compiled in place (None for any other model, and for a copy of
    one, which keeps the compiled call but not the registration)."""
    if not isinstance(getattr(model, "_compiled_call_impl", None), _CompiledCall):
        return None
    return MODEL_BACKENDS.get(model)


def pipeline_names(backend: _Backend) -> list[str]:
    """The names of the passes ``backend`` runs: its pipeline and the passes added to it (e.g. by Hugging Face
    gradient checkpointing)."""
    return [p.name for p in backend.manager.active] + [p.name for p in backend.extra_passes]


def compile_in_place(model: torch.nn.Module, backend: _Backend, *, fullgraph: bool = False,
                     dynamic: bool | None = None) -> None:
    """Compile ``model`` in place with ``backend`` (``nn.Module.compile``'s mechanism), replacing an
    earlier effpass compile. Used again when the pipeline changes (e.g. gradient checkpointing is turned
    on through Hugging Face's API after compiling)."""
    fn = torch.compile(model._call_impl, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    model._compiled_call_impl = _CompiledCall(fn, backend)
    model._effpass_compile_kwargs = {"fullgraph": fullgraph, "dynamic": dynamic}
    MODEL_BACKENDS[model] = backend
