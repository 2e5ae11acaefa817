"""The pass interface, the pass registry and option validation.

The names live in three modules by responsibility (``pass_base``: the interface; ``pass_options``: option
checking and coercion; ``pass_registry``: the registries of passes, extensions, commands and cacheable functions)
and are imported from here.

A pass is a frozen dataclass whose fields are its options. It has a snake_case verb-phrase ``name`` and
one optional hook per phase it acts in:

========================  =====================================================================
phase                     hook and what it receives
========================  =====================================================================
``module``                ``prepare_module(model, ctx)``: the eager ``nn.Module`` before compile
                          (state that must exist before the optimizer: LoRA weights, quantized
                          weights, FSDP sharding). Reached through ``effpass.compile``/``prepare``.
``torch_ir``              ``transform_torch_ir(gm, ctx)``: the torch-IR graph Dynamo hands over.
``joint``                 ``transform_joint(gm, ctx)``: the joint forward+backward aten graph, before
                          the partitioner (also inference graphs, which have no tangents).
``post_grad``             ``transform_post_grad(gm, ctx)``: the partitioned forward and backward
                          graphs (``ctx.graph_kind`` says which).
========================  =====================================================================

Every hook returns a :class:`PassResult` (or ``None`` for "unchanged"). Passes never print, time or dump
themselves: the :class:`~effpass.manager.PassManager` does that around every hook.
"""
from __future__ import annotations

from .pass_base import PHASE_HOOKS, FunctionPass, Note, Pass, PassResult, Phase
from .pass_options import PassOptionError, UnknownPassOptionError, check_option_names
from .pass_registry import (_REGISTRY, BUILTIN_PACKAGE, Command, cacheable_functions, get_extension,
                            get_pass_class, make_pass, register_cacheable_function, register_command,
                            register_extension, register_pass, registered_commands, registered_passes,
                            reserved_pass_names)

__all__ = [
    "Phase", "PassResult", "Pass", "FunctionPass", "register_pass", "get_pass_class", "registered_passes",
    "reserved_pass_names", "make_pass", "PassOptionError", "register_extension", "register_command",
    "registered_commands", "Command", "register_cacheable_function", "cacheable_functions",
    "UnknownPassOptionError", "check_option_names", "Note",
]

#: importable from here too, outside ``__all__``: the phase -> hook table, the built-in passes' package, the
#: registry itself (tests register and remove passes) and the lookup behind ``effpass.<extension>``
_ALSO_EXPORTED = (PHASE_HOOKS, BUILTIN_PACKAGE, _REGISTRY, get_extension)
