"""effpass in Axolotl: turn it on from the YAML config (Axolotl users never hold the model object).

    # axolotl config.yml
    plugins:
      - effpass.integrations.axolotl.EffpassPlugin
    effpass:
      passes: {fuse_attention: {}, fuse_cross_entropy: {}, checkpoint_activations: {policy: full}}
      lowering: inductor          # or eager
      memory_budget: 24GiB        # optional: the planner adds passes to fit (planned on the first step)
      allow: [nf4]                # lossy techniques the planner may use
      verify: false               # check the pipeline against eager on the first step
      dump_dir: effpass-dump      # optional: dumps and an HTML report (report.html) after training

Axolotl builds the model (and its PEFT adapters), then asks each plugin for Trainer callbacks before
creating the Trainer: :class:`EffpassPlugin` returns an
:class:`~effpass.integrations.huggingface.EffpassCallback`, which compiles the model with
``effpass.compile`` when the Trainer is built (before its optimizer exists) and checks the training
arguments (Axolotl's own ``torch_compile: true`` would compile the model a second time, bypassing effpass:
that is an error naming the option). ``effpass:`` absent or ``enabled: false``: the plugin does nothing.

Axolotl switches its own fused LoRA kernels on for ``adapter: lora`` when the config sets none of the
``lora_*_kernel`` options; Dynamo cannot trace its QKV and O kernels, so :meth:`EffpassPlugin.register` (which
gets the raw config before Axolotl validates it) sets the four options to false, and ``lora_qkv_kernel: true``
or ``lora_o_kernel: true`` is an error naming the option (:func:`disable_auto_lora_kernels`).

The plugin subclasses Axolotl's ``BasePlugin`` (``axolotl.integrations.base``) when Axolotl is importable.
Tested with the real Axolotl 0.19.0 (the last release that allows Python 3.11), torch 2.13.0 CPU,
transformers 5.16.1, peft 0.20.0: tests/integrations/test_axolotl_real.py (run by scripts/axolotl_check.sh, which builds
that environment) trains a tiny Llama with LoRA through Axolotl's CLI entry point for 2 steps, with and
without the plugin: the model is compiled (attention and loss fused) and the losses match (1e-5 relative).
Not tested: Axolotl on a GPU, ``lowering: inductor``, QLoRA, sample packing, ``memory_budget``/``verify``
through Axolotl, Axolotl 0.20+ (Python >= 3.12). tests/integrations/test_axolotl_plugin.py (in CI, without Axolotl)
drives the hooks in the order Axolotl's ``PluginManager`` calls them. Axolotl 0.19.0 calls ``post_train``
twice (after ``trainer.train`` and at the end of ``train``): the report is written twice, the same.
"""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["EffpassPlugin", "EffpassArgs", "parse_effpass_config", "disable_auto_lora_kernels", "OPTIONS"]

#: the keys of the ``effpass:`` section, with what each means
OPTIONS = {
    "enabled": "false turns the plugin off (default: true when the section exists)",
    "passes": "the pipeline: a list of pass names or {name: {option: value}} (default: the default pipeline)",
    "lowering": "'inductor' (default) or 'eager'",
    "memory_budget": "bytes or a string such as '24GiB': the planner adds passes to fit the step",
    "allow": "lossy techniques the planner may use (e.g. ['nf4'])",
    "verify": "check the pipeline against the eager model on the first step (effpass verify)",
    "strict": "raise when a pass fails instead of skipping it",
    "dump_dir": "write dumps there, and report.html after training",
}


#: Axolotl's fused LoRA kernel options (``axolotl.kernels.lora``), which it switches on by itself for LoRA
LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")
#: those effpass refuses: Dynamo fails to trace the backward of Axolotl 0.19.0's ``LoRA_QKV`` and ``LoRA_O``
#: (torch 2.13, checked on CPU, where these kernels need no Triton); ``lora_mlp_kernel`` (Triton SwiGLU, CUDA only)
#: and ``lora_embedding_kernel`` were not tried under effpass: allowed when set, with a warning
REFUSED_LORA_KERNELS = ("lora_qkv_kernel", "lora_o_kernel")

LOG = logging.getLogger(__name__)


def _base():
    try:
        from axolotl.integrations.base import BasePlugin

        return BasePlugin
    except Exception:  # Axolotl absent (or unimportable here): the interface is duck-typed
        return object


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def parse_effpass_config(cfg) -> dict[str, Any] | None:
    """The validated ``effpass:`` section of an Axolotl config (a dict or Axolotl's ``DictDefault``), or None
    when effpass is off. Unknown keys and wrong types raise ``ValueError`` naming them and the valid ones."""
    section = _get(cfg, "effpass")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"effpass: the 'effpass' section must be a mapping, got {type(section).__name__} {section!r}; "
                         f"valid keys: {sorted(OPTIONS)}")
    section = dict(section)
    unknown = sorted(set(section) - set(OPTIONS))
    if unknown:
        raise ValueError(f"effpass: unknown key(s) {unknown} in the 'effpass' section; valid keys: {sorted(OPTIONS)}")
    if section.pop("enabled", True) is False:
        return None
    for key in ("verify", "strict"):
        if key in section and not isinstance(section[key], bool):
            raise ValueError(f"effpass: '{key}' must be true or false, got {section[key]!r}")
    if "lowering" in section and section["lowering"] not in ("inductor", "eager"):
        raise ValueError(f"effpass: lowering {section['lowering']!r} is not one of ['eager', 'inductor']")
    if "allow" in section and not (isinstance(section["allow"], list) and all(isinstance(a, str) for a in section["allow"])):
        raise ValueError(f"effpass: 'allow' must be a list of technique names, got {section['allow']!r}")
    passes = section.get("passes")
    if passes is not None and not isinstance(passes, (list, dict)):
        raise ValueError(f"effpass: 'passes' must be a list of names or a mapping name -> options, got {passes!r}")
    if passes is not None:  # validated now, with the registry's error naming the bad pass or option
        from ..config import parse_options

        parse_options({"passes": passes})
    if _get(cfg, "torch_compile") is True:
        raise ValueError("effpass: the Axolotl option torch_compile: true would compile the model a second time "
                         "with Inductor and bypass effpass; set torch_compile: false (effpass compiles the model)")
    untried = [k for k in LORA_KERNELS if k not in REFUSED_LORA_KERNELS and _get(cfg, k) is True]
    if untried:
        LOG.warning("effpass: %s: Axolotl's fused LoRA kernels are autograd.Functions; these were not tried under "
                    "effpass (its QKV and O kernels fail in Dynamo); set them to false if compiling fails",
                    ", ".join(k + ": true" for k in untried))
    on = [k for k in REFUSED_LORA_KERNELS if _get(cfg, k) is True]
    if on:
        raise ValueError(f"effpass: the Axolotl option(s) {', '.join(k + ': true' for k in on)} replace PEFT's LoRA "
                         f"layers with a torch.autograd.Function that Dynamo cannot trace (torch 2.13: 'An "
                         f"intermediate tensor ... aliases an input or output'), so effpass cannot compile the model; "
                         f"set {', '.join(k + ': false' for k in on)} (effpass compiles PEFT's LoRA layers as they are)")
    return section


def disable_auto_lora_kernels(cfg) -> list[str]:
    """Axolotl (0.19) switches its fused LoRA kernels on by itself for ``adapter: lora``/``qlora`` when the config
    sets none of the ``lora_*_kernel`` options; Dynamo cannot trace its QKV and O kernels (see
    :data:`REFUSED_LORA_KERNELS`). Called on the raw config before Axolotl validates it: sets each unset option
    to false, so that Axolotl leaves PEFT's LoRA layers in place, and returns the options it set."""
    if _get(cfg, "adapter") not in ("lora", "qlora"):
        return []
    unset = [k for k in LORA_KERNELS if _get(cfg, k) is None]
    if len(unset) < len(LORA_KERNELS):  # the user chose: Axolotl does not auto-enable; explicit true is refused
        return []
    for k in unset:
        cfg[k] = False
    return unset


class EffpassPlugin(_base()):
    """Axolotl plugin: ``plugins: [effpass.integrations.axolotl.EffpassPlugin]`` plus an ``effpass:`` section."""

    def __init__(self):
        super().__init__()
        self.options: dict[str, Any] | None = None
        self.callback = None

    def get_input_args(self) -> str:
        return "effpass.integrations.axolotl.EffpassArgs"

    def register(self, cfg) -> None:
        """Axolotl calls this with the raw config, before validating it."""
        self.options = parse_effpass_config(cfg)
        if self.options is not None:
            turned_off = disable_auto_lora_kernels(cfg)
            if turned_off:
                LOG.warning("effpass: set %s to false: Axolotl would switch its fused LoRA kernels on by itself, "
                            "and Dynamo cannot trace its QKV and O kernels; effpass compiles PEFT's LoRA layers instead",
                            ", ".join(turned_off))

    def pre_model_load(self, cfg) -> None:
        if self.options is None:
            self.options = parse_effpass_config(cfg)

    def add_callbacks_pre_trainer(self, cfg, model) -> list:
        self.options = parse_effpass_config(cfg)
        if self.options is None:
            return []
        from .huggingface import EffpassCallback

        opts = dict(self.options)
        passes = opts.pop("passes", None)
        if "allow" in opts:
            opts["allow"] = tuple(opts["allow"])
        self.callback = EffpassCallback(passes=passes, **opts)
        return [self.callback]

    def post_train(self, cfg, model) -> None:
        if self.options is None or not self.options.get("dump_dir"):
            return
        import os

        import effpass

        effpass.report(model).to_html(os.path.join(self.options["dump_dir"], "report.html"))


try:  # Axolotl merges each plugin's pydantic model into its config schema
    from pydantic import BaseModel

    class EffpassArgs(BaseModel):
        """The ``effpass:`` section of an Axolotl config (validated again by :func:`parse_effpass_config`)."""

        effpass: dict[str, Any] | None = None
except ImportError:  # pragma: no cover - pydantic comes with Axolotl
    EffpassArgs = None
