"""effpass: a torch.compile backend that makes transformer training faster and leaner with graph passes.

    import effpass
    compiled = torch.compile(model, backend="effpass")                  # the default pipeline
    model = effpass.compile(model, passes=[...], dump_dir="effpass-dump")  # Python API
"""
from __future__ import annotations

import functools
import hashlib
import os

__version__ = "0.1.0"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """A hash of effpass's own source (core and built-in passes): part of every cache key."""
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [here]
    try:
        import importlib.util

        spec = importlib.util.find_spec("effpass.passes")
        if spec and spec.submodule_search_locations:
            roots += list(spec.submodule_search_locations)
    except Exception:  # pragma: no cover
        pass
    h = hashlib.sha256(__version__.encode())
    for root in roots:
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


from .pass_api import (Pass, PassResult, Phase, register_pass, registered_passes, make_pass,  # noqa: E402
                       get_pass_class, reserved_pass_names, PassOptionError, register_extension,
                       register_command, register_cacheable_function, Note)
from .scope import skip, only, TargetMatchError  # noqa: E402
from .attention import register_attention_op  # noqa: E402
from .manager import PassContext, PipelineError, EffpassPassError, WrongResultError, order_passes  # noqa: E402
from .config import parse_options, default_pipeline  # noqa: E402
from .report import CompileReport, GraphReport, PassRecord  # noqa: E402
from .api import compile, prepare, report, backend_of  # noqa: E402
from .backend import EffpassBackend  # noqa: E402
from .inspect import html as _html_renderer  # noqa: E402,F401  (registers CompileReport.to_html)
from .export import export_onnx  # noqa: E402
from .planning import estimate_memory, plan_memory, MemoryBudgetError  # noqa: E402
from .memory_options import MemoryOption, register_memory_option, register_optimizer, register_flop_formula  # noqa: E402,E501


def verify(model, example_inputs, passes=None, **kwargs):
    """Check a pipeline against reference semantics on ``model`` (see :mod:`effpass.verification`)."""
    from .verification import verify as _verify

    return _verify(model, example_inputs, passes, **kwargs)



def __getattr__(name: str):
    """Helpers that passes register (``effpass.loss_scaler``, ``effpass.lora``), loaded on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from .pass_api import get_extension

    return get_extension(name)


__all__ = [
    "compile", "prepare", "report", "backend_of", "register_pass", "registered_passes", "make_pass",
    "get_pass_class", "skip", "only", "Pass", "PassResult", "PassContext", "Phase", "EffpassBackend",
    "parse_options", "default_pipeline", "order_passes", "CompileReport", "GraphReport", "PassRecord",
    "PipelineError", "EffpassPassError", "WrongResultError", "TargetMatchError", "PassOptionError", "reserved_pass_names",
    "register_extension", "register_command", "register_cacheable_function", "export_onnx",
    "estimate_memory", "plan_memory",
    "MemoryBudgetError", "verify", "MemoryOption", "register_memory_option", "register_optimizer",
    "register_flop_formula", "Note", "register_attention_op",
]
