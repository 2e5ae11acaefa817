"""effpass: a torch.compile backend that makes transformer training faster and leaner with graph passes.

    import effpass
    compiled = torch.compile(model, backend="effpass")                  # the default pipeline
    model = effpass.compile(model, passes=[...], dump_dir="effpass-dump")  # Python API

``import effpass`` is light: the public names below are loaded on first use (PEP 562), so importing the
package costs little beyond ``import torch`` and writes nothing (the backend, which needs Dynamo and
Inductor, loads when first named or when ``torch.compile(backend="effpass")`` finds it by entry point;
torchao loads only when a pass that uses it runs).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

__version__ = "0.1.0"


def _source_files() -> tuple[str, ...]:
    """Every ``.py`` file of effpass (the core, its tools) and of the built-in passes, at any depth: a change in
    any pass package's private module must change the cache keys too."""
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [here]
    spec = importlib.util.find_spec("effpass.passes")
    if spec and spec.submodule_search_locations:
        roots += [r for r in spec.submodule_search_locations if not os.path.abspath(r).startswith(here + os.sep)]
    files = []
    for root in roots:
        for d, subdirs, names in os.walk(root):
            subdirs[:] = sorted(s for s in subdirs if s != "__pycache__" and not s.startswith("."))
            files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return tuple(sorted(files))


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """A hash of effpass's own source (core, tools and built-in passes): part of every cache key. The files'
    contents are hashed by torch's helper (``torch._inductor.custom_graph_pass.get_hash_for_files``, what
    custom Inductor passes use for their ``uuid``)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    files = _source_files()
    here = os.path.dirname(os.path.abspath(__file__))
    # NOTE: the helper hashes contents only; the relative names go into `extra` so a rename changes the key
    names = ",".join(os.path.relpath(f, os.path.dirname(here)) for f in files)
    return get_hash_for_files(files, extra=f"{__version__}:{names}").hex()


#: public name -> the submodule that defines it (loaded on first attribute access)
_LAZY = {
    **dict.fromkeys(["Pass", "PassResult", "Phase", "register_pass", "registered_passes", "make_pass",
                     "get_pass_class", "reserved_pass_names", "PassOptionError", "register_extension",
                     "register_command", "register_cacheable_function", "Note"], ".pass_api"),
    "register_attention_op": ".attention",
    "Fact": ".facts",
    **dict.fromkeys(["MemoryOption", "register_memory_option", "register_optimizer", "register_flop_formula",
                     "register_device_kernel"], ".memory_options"),
    **dict.fromkeys(["skip", "only", "TargetMatchError"], ".scope"),
    **dict.fromkeys(["PassContext", "PipelineError", "EffpassPassError", "WrongResultError", "order_passes"],
                    ".manager"),
    **dict.fromkeys(["parse_options", "default_pipeline"], ".config"),
    **dict.fromkeys(["CompileReport", "GraphReport", "PassRecord"], ".report"),
    **dict.fromkeys(["compile", "prepare", "report", "backend_of"], ".api"),
    "EffpassBackend": ".backend",
    "export_onnx": ".export",
    **dict.fromkeys(["HostOffloadAdamW", "takes_gradients"], ".host_optim"),
    **dict.fromkeys(["estimate_memory", "plan_memory", "MemoryBudgetError"], ".planning"),
}

def verify(model, example_inputs, passes=None, **kwargs):
    """Check a pipeline against reference semantics on ``model`` (see :mod:`effpass.verification`)."""
    from .verification import verify as _verify

    return _verify(model, example_inputs, passes, **kwargs)



def __getattr__(name: str):
    """Public names load their submodule on first use; other names are helpers that passes register
    (``effpass.loss_scaler``, ``effpass.lora``), loaded on first use too."""
    if name.startswith("__"):
        raise AttributeError(name)
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
        globals()[name] = value
        # NOTE: registers CompileReport.to_html (the tool package; the core must not import it itself)
        importlib.import_module(".inspect.html", __name__)
        return value
    from .pass_api import get_extension

    return get_extension(name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """``effpass.report`` is the function ``effpass.report(model)``, as before lazy loading; importing the
    submodule ``effpass/report.py`` (which sets the package attribute) must not replace it."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "compile", "prepare", "report", "backend_of", "register_pass", "registered_passes", "make_pass",
    "get_pass_class", "skip", "only", "Pass", "PassResult", "PassContext", "Phase", "EffpassBackend",
    "parse_options", "default_pipeline", "order_passes", "CompileReport", "GraphReport", "PassRecord",
    "PipelineError", "EffpassPassError", "WrongResultError", "TargetMatchError", "PassOptionError", "reserved_pass_names",
    "register_extension", "register_command", "register_cacheable_function", "export_onnx",
    "estimate_memory", "plan_memory",
    "MemoryBudgetError", "verify", "MemoryOption", "register_memory_option", "register_optimizer",
    "register_flop_formula", "register_device_kernel", "Note", "Fact", "register_attention_op",
    "HostOffloadAdamW", "takes_gradients",
]
