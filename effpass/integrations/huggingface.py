"""effpass with Hugging Face ``Trainer``, TRL's ``SFTTrainer``, PEFT adapters and accelerate.

``effpass.compile(model, ...)`` compiles a model in place, so the model handed to ``Trainer`` is the
model itself (same class, ``forward`` signature, ``config``, ``save_pretrained``, ``generate``). For a
``transformers.PreTrainedModel`` it also calls :func:`attach`, which gives that one model instance (no
class, no library code is patched, except TRL's ``ORPOTrainer.concatenated_forward`` when TRL's ORPO module is
loaded: ``_trl_orpo`` routes it through fused log-probs for effpass-compiled models, TRL's method otherwise; and
TRL's ``add_fused_lm_head``: ``_trl_fused_head`` routes the head it adds to an effpass-compiled model, used by
DPO/KTO/GRPO/RLOO, through effpass's fused ops):

* **gradient checkpointing** taken over: ``model.gradient_checkpointing_enable()`` /
  ``activation_checkpointing_enable()`` (what ``Trainer`` calls for ``gradient_checkpointing=True``, TRL's
  default) add effpass's ``checkpoint_activations`` pass (``policy="full"``: per transformer block only the
  block's inputs are saved, Hugging Face's memory) to the pipeline and recompile, instead of wrapping each
  layer in ``torch.utils.checkpoint``, whose higher-order op hides the layer from the graph passes
  (attention is not fused, LoRA's q/k/v products are not merged). A pipeline that already holds
  ``checkpoint_activations`` keeps it (with its own policy or budget);
* **adapter saving**: with LoRA adapters (``inject_lora`` or ``effpass.lora.load``),
  ``model.save_pretrained(dir)``, and so ``trainer.save_model(dir)`` and every Trainer checkpoint, write
  PEFT's ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained(base,
  dir)`` loads them). In a Trainer checkpoint folder (``checkpoint-<step>``) the trainable parameters are
  also written as ``model.safetensors`` under the model's own names, which is what
  ``trainer.train(resume_from_checkpoint=...)`` reads for a model that is not a ``PeftModel``;
* **Trainer checks**: on the model's first call from inside a ``Trainer``, options that cannot work
  together raise a ``ValueError`` naming them (:func:`check_training_args`).

accelerate: ``TrainingArguments(torch_compile_backend="effpass")`` cannot work: accelerate turns the name
into its closed ``DynamoBackend`` enum and rejects any other. Compile with effpass before building the
``Trainer`` (accelerate leaves the model alone when ``torch_compile`` is off), or add
:class:`EffpassCallback`, which compiles the Trainer's model when the Trainer is built::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[EffpassCallback(passes=[InjectLoRA(rank=8)])])
"""
from __future__ import annotations

import os
import re
import sys
import types
from typing import Any

import torch

__all__ = ["attach", "set_hf_loss_type", "install_output_capturing_hooks", "check_training_args", "allow_trl_kernels", "EffpassCallback", "HF_CHECKPOINT_POLICY", "is_effpass_compiled"]

#: the checkpoint_activations options used when Hugging Face gradient checkpointing is turned on
HF_CHECKPOINT_POLICY = {"policy": "full"}
_CHECKPOINT_DIR = re.compile(r"checkpoint-\d+$")  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + step


def _pretrained_class():
    """transformers' ``PreTrainedModel`` if its module is loaded, else None: a model built from it has loaded it,
    so nothing is imported here (``transformers.modeling_utils`` costs seconds and imports torchao's prototypes,
    which log on a CPU build, for every plain module compiled after something imported ``transformers``)."""
    mod = sys.modules.get("transformers.modeling_utils")
    return getattr(mod, "PreTrainedModel", None)


def _backend(model):
    from ..backend import MODEL_BACKENDS

    return MODEL_BACKENDS.get(model)


def is_effpass_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` was compiled in place by ``effpass.compile``."""
    from ..backend import _CompiledCall

    return isinstance(getattr(model, "_compiled_call_impl", None), _CompiledCall)


def _pipeline_names(model) -> list[str]:
    from ..backend import pipeline_names

    be = _backend(model)
    return [] if be is None else pipeline_names(be)


# ------------------------------------------------------------------------------------------------------
# attach: the per-instance methods
# ------------------------------------------------------------------------------------------------------
def attach(model: torch.nn.Module) -> bool:
    """Give an effpass-compiled Hugging Face model effpass's gradient checkpointing, adapter saving and
    Trainer checks (instance attributes only). Returns False (and does nothing) for other modules."""
    pretrained = _pretrained_class()
    if pretrained is None:
        return False
    if not isinstance(model, pretrained):
        inner = _peft_base(model)
        if inner is None or not isinstance(inner, pretrained):
            return False
        # a PEFT model around a Hugging Face model: PEFT's own saving and checkpointing methods stay; the loss
        # type, the output-capturing hooks, the Trainer checks and TRL's routes (on the model inside) apply
        set_hf_loss_type(model)
        install_output_capturing_hooks(model)
        _install_first_call_check(model)
        _route_trl(inner)
        return True
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        setattr(model, name, types.MethodType(_checkpointing_enable, model))
    for name in ("gradient_checkpointing_disable", "activation_checkpointing_disable"):
        setattr(model, name, types.MethodType(_checkpointing_disable, model))
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    model.enable_input_require_grads = types.MethodType(_enable_input_require_grads, model)
    if getattr(model, "_require_grads_hooks", None) and hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()  # installed before effpass.compile: dropped for the same reason
        _note_input_require_grads(model)
    set_hf_loss_type(model)
    install_output_capturing_hooks(model)
    _install_first_call_check(model)
    _route_trl(model)
    return True


def _peft_base(model):
    """The model inside a PEFT wrapper (``PeftModel``: ``peft_config`` and ``get_base_model``), else None."""
    get_base = getattr(model, "get_base_model", None)
    if not callable(get_base) or not hasattr(model, "peft_config"):
        return None
    inner = get_base()
    return inner if inner is not model else None


def _route_trl(hf_model) -> None:
    """TRL's trainers without logits, when their modules are loaded: route ORPO's method and TRL's fused head
    (the head already on ``hf_model`` too: GRPO's reference, which TRL loads and patches itself)."""
    from . import _trl_fused_head, _trl_orpo

    _trl_orpo.route()
    _trl_fused_head.route()
    _trl_fused_head.install(hf_model)


def install_output_capturing_hooks(model: torch.nn.Module) -> list[str]:
    """Install transformers' output-capturing hooks now, on the Hugging Face models in ``model`` whose config
    asks for a captured output (``output_router_logits``: MoE load-balancing losses; ``output_hidden_states``,
    ``output_attentions``); returns their names.

    transformers 5 installs these hooks lazily, on the first forward that asks for them, under a
    ``threading.Lock``. Traced by Dynamo, that is a graph break (an unsupported context manager, then hook
    registration) in the middle of the model, and the graphs are cached with it: every call of an MoE model
    whose config asks for router logits then ran in pieces, with the head and the loss in a graph of their own
    (nothing fused there). Installing them before the first call, as that call would, keeps one graph.
    Feature-tested: nothing happens with a transformers without ``maybe_install_capturing_hooks``."""
    mod = sys.modules.get("transformers.utils.output_capturing")
    install = getattr(mod, "maybe_install_capturing_hooks", None)
    registry = getattr(mod, "_CAN_RECORD_REGISTRY", None)
    pretrained = _pretrained_class()
    if install is None or registry is None or pretrained is None:
        return []
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, pretrained) or getattr(m, "_output_capturing_hooks_installed", False):
            continue
        try:
            flags = registry.get(m) or {}
        except Exception:  # noqa: BLE001 - a model outside the registry: nothing to install
            continue
        if any(getattr(m.config, f"output_{k}", False) for k in flags):
            install(m)
            done.append(name or type(m).__name__)
    return done


def set_hf_loss_type(model: torch.nn.Module) -> list[str]:
    """Set ``loss_type = "ForCausalLM"`` on the Hugging Face models in ``model`` whose ``loss_type`` is
    unrecognised; returns their names. effpass.compile calls it for Hugging Face models (:func:`attach`).

    ``PreTrainedModel.__init__`` infers ``loss_type`` from the class name; for names matching none of
    transformers' loss kinds (``GPT2LMHeadModel``) it is ``None``, and the ``loss_function`` property then
    calls ``logger.warning_once`` on every call before returning ``ForCausalLMLoss``. Dynamo cannot trace
    a logger method ("logging.Logger method not supported"): the graph breaks between the head and the
    loss, and nothing can be fused. Setting the type the property falls back to anyway gives the same loss
    function without the warning, so the head and the loss stay in one graph. Models with their own
    ``loss_function`` (``_loss_function`` set) or a recognised type are left alone."""
    mapping = _hf_loss_mapping()
    if mapping is None or "ForCausalLM" not in mapping:
        return []
    from transformers import PreTrainedModel

    fixed, outer = [], []
    for name, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or any(name.startswith(o + ".") or o == "" for o in outer):
            continue  # only the outermost Hugging Face models compute the loss (not GPT2LMHeadModel.transformer)
        outer.append(name)
        if "_loss_function" not in vars(m) and getattr(m, "loss_type", None) not in mapping:
            m.loss_type = "ForCausalLM"
            fixed.append(name or type(m).__name__)
    return fixed


def _hf_loss_mapping() -> dict | None:
    """transformers' ``LOSS_MAPPING`` when transformers is imported (never imports it), else None."""
    import sys

    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover - older transformers
        return None
    return LOSS_MAPPING


def _install_first_call_check(model) -> None:
    call = getattr(model, "_compiled_call_impl", None)
    if hasattr(call, "first_call_checks"):
        call.first_call_checks.append(lambda: _check_calling_trainer(model))


def _recompile(model, extra_passes: tuple) -> None:
    """Compile ``model`` again in place with ``extra_passes`` added to its pipeline (a new backend object
    sharing the report: Dynamo's cache entries are per backend, so graphs compiled before are not reused)."""
    from ..backend import EffpassBackend, compile_in_place

    old = _backend(model)
    new = EffpassBackend(old.options, model=model, report=old.report)
    new.extra_passes = tuple(extra_passes)
    new._count = old._count
    new.manager = new._make_manager(old.options.passes)
    compile_in_place(model, new, **getattr(model, "_effpass_compile_kwargs", {}))
    _install_first_call_check(model)


def _note_input_require_grads(model) -> None:
    be = _backend(model)
    if be is not None:
        be.report.module.notes["input_require_grads"] = (
            "not installed: effpass's checkpointing recomputes inside the compiled graph and needs no embedding "
            "output that requires grad; the hook (Tensor.requires_grad_ on an intermediate) breaks the graph")


def _enable_input_require_grads(self):
    """What PEFT and TRL call with gradient checkpointing on a frozen embedding (``enable_input_require_grads``):
    a forward hook that makes the embeddings' output require grad, so that ``torch.utils.checkpoint``'s reentrant
    form, which only differentiates through inputs that require grad, reaches the adapters. effpass takes over
    gradient checkpointing with its own pass, which recomputes inside the compiled graph and needs no such input;
    the hook itself (``Tensor.requires_grad_`` on an intermediate) is a graph break under Dynamo, which split the
    model and could put the head and the loss in different graphs (nothing fused). So for an effpass-compiled
    model it installs nothing; every parameter's gradient is the same (tested), and the report says so
    (``module.notes["input_require_grads"]``)."""
    _note_input_require_grads(self)


def _checkpointing_enable(self, gradient_checkpointing_kwargs=None, activation_checkpointing_kwargs=None,
                          every_n_layers: int = 1, offload: bool = False, **_ignored):
    """effpass takes over Hugging Face gradient checkpointing: adds ``checkpoint_activations``
    (``policy="full"``) to this model's pipeline instead of wrapping layers in ``torch.utils.checkpoint``."""
    import effpass

    if offload and _backend(self) is not None:
        raise ValueError("effpass: activation offloading (offload=True) is not supported with effpass's "
                         "checkpointing; use offload=False (checkpoint_activations budget= keeps memory low)")
    if every_n_layers != 1 and _backend(self) is not None:
        raise ValueError(f"effpass: every_n_layers={every_n_layers} is not supported; effpass checkpoints every "
                         "block (use checkpoint_activations(budget=...) to trade memory for speed)")
    be = _backend(self)
    if be is None:  # a copy of an effpass model (copies are eager): Hugging Face's own checkpointing
        kwargs = activation_checkpointing_kwargs if activation_checkpointing_kwargs is not None else gradient_checkpointing_kwargs
        if hasattr(type(self), "_activation_checkpointing_enable"):  # transformers 5
            return type(self)._activation_checkpointing_enable(self, kwargs, every_n_layers, offload)
        return type(self).gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=kwargs)
    if "checkpoint_activations" in [p.name for p in be.options.passes] or any(
            p.name == "checkpoint_activations" for p in be.extra_passes):
        self._effpass_checkpointing = True
        return
    _recompile(self, (*be.extra_passes, effpass.make_pass("checkpoint_activations", dict(HF_CHECKPOINT_POLICY))))
    self._effpass_checkpointing = True


def _checkpointing_disable(self, **_ignored):
    be = _backend(self)
    if be is None:  # a copy of an effpass model: Hugging Face's own checkpointing
        if hasattr(type(self), "_activation_checkpointing_disable"):
            return type(self)._activation_checkpointing_disable(self)
        return type(self).gradient_checkpointing_disable(self)
    if be is not None and any(p.name == "checkpoint_activations" for p in be.extra_passes):
        _recompile(self, tuple(p for p in be.extra_passes if p.name != "checkpoint_activations"))
    self._effpass_checkpointing = False


def _save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
    """``save_pretrained`` of an effpass model: a PEFT adapter when the model has LoRA adapters (plus the
    trainable parameters as ``model.safetensors`` in a Trainer checkpoint folder, for resuming), else the
    model's own ``save_pretrained``."""
    import effpass

    lora = effpass.lora
    if not lora.lora_modules(self) and not lora.expert_lora_modules(self):
        return type(self).save_pretrained(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
    if not is_main_process:
        return None
    os.makedirs(save_directory, exist_ok=True)
    lora.save(self, save_directory)
    resume = kwargs.get("effpass_resume_state")
    if resume is None:
        resume = bool(_CHECKPOINT_DIR.search(os.path.basename(os.path.normpath(os.fspath(save_directory)))))
    if resume:
        from safetensors.torch import save_file

        trainable = {n: p.detach().contiguous().cpu() for n, p in self.named_parameters() if p.requires_grad}
        save_file(trainable, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})
    return None


# ------------------------------------------------------------------------------------------------------
# Trainer checks
# ------------------------------------------------------------------------------------------------------
def check_training_args(args: Any, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the options when ``TrainingArguments`` (or TRL's ``SFTConfig``) ``args``
    cannot train the effpass-compiled ``model``."""
    names = _pipeline_names(model)
    if getattr(args, "torch_compile", False):
        raise ValueError(
            "TrainingArguments(torch_compile=True) would compile the effpass-compiled model a second time with "
            f"accelerate's backend {getattr(args, 'torch_compile_backend', None) or 'inductor'!r}; the model is "
            "already compiled by effpass.compile: set torch_compile=False")
    if "scale_loss" in names:
        raise ValueError(
            "the scale_loss pass needs the optimizer step to unscale with effpass.loss_scaler(model), which "
            "Trainer's step does not do; remove scale_loss and use TrainingArguments(fp16=True) "
            "(Trainer's GradScaler) instead")
    if "step_in_backward" in names:
        # the optimizer steps each parameter inside backward: neither clipping by the global norm (it needs
        # every gradient at once) nor accumulation over micro-batches (a step per backward) can be exact
        bad = []
        if float(getattr(args, "max_grad_norm", 0.0) or 0.0) > 0:
            bad.append(f"max_grad_norm={args.max_grad_norm} (set max_grad_norm=0.0)")
        if int(getattr(args, "gradient_accumulation_steps", 1) or 1) != 1:
            bad.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} (set it to 1)")
        if bad:
            raise ValueError("the step_in_backward pass steps each parameter inside backward, which cannot be "
                             "exact with " + ", ".join(bad))
    be = _backend(model)
    autocast = next((p for p in (be.manager.active if be else []) if p.name == "apply_autocast"), None)
    if autocast is not None:
        want = getattr(autocast, "dtype", None)
        trainer_dtype = torch.bfloat16 if getattr(args, "bf16", False) else (
            torch.float16 if getattr(args, "fp16", False) else None)
        if trainer_dtype is not None and want is not None and want != trainer_dtype:
            raise ValueError(
                f"apply_autocast(dtype={want}) and TrainingArguments({'bf16' if trainer_dtype == torch.bfloat16 else 'fp16'}=True) "
                f"ask for two different mixed-precision dtypes; keep one of them")


def allow_trl_kernels() -> list[str]:
    """Let Dynamo put TRL's fused LM-head kernels in the graph as single calls.

    TRL's ``SFTTrainer`` replaces the model's ``forward`` with a fused LM head whose autograd function tiles
    its matmuls with ``torch.mm(..., out=tile)``, which Dynamo cannot trace: the step would graph-break
    there. ``torch.compiler.allow_in_graph`` (public torch API; TRL's code is not changed) makes Dynamo
    record the function as one call that AOTAutograd traces through (``out=`` is fine at that level),
    forward and backward exactly as TRL computes them. When TRL's kernel is the one it knows, the fused head
    calls it through an opaque custom op instead (``_trl_kernels``: no recompile per token count).
    Returns the names registered."""
    from . import _trl_kernels  # ChunkedLogProbFunction as an opaque custom op (no recompile per length)

    done = ["effpass::trl_chunked_logprob"] if _trl_kernels.install() else []
    kernels = sys.modules.get("trl.kernels")
    for name in ("ChunkedLogProbFunction",):
        fn = getattr(kernels, name, None) if kernels is not None else None
        if fn is not None:
            torch.compiler.allow_in_graph(fn)  # the fallback when the custom op is not installed
            done.append(f"trl.kernels.{name}")
    return done


def _check_trl_fused_head(model) -> None:
    """TRL's SFTTrainer replaces ``forward`` with a fused LM head that reads ``lm_head.weight`` directly: an
    adapter on the output head would never be trained (and has no ``.weight``)."""
    # model.forward may be wrapped (accelerate's mixed-precision wrapper around TRL's bound method)
    obj, fused = getattr(model, "forward", None), False
    for _ in range(8):
        if obj is None:
            break
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames:
            fused = True
            break
        obj = getattr(obj, "model_forward", None) or getattr(obj, "__wrapped__", None) or getattr(obj, "func", None)
    if not fused or getattr(model, "_effpass_fused_head", False):  # routed: the head is called as a module
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "lora_A") and hasattr(head, "base_layer"):
        raise ValueError("TRL's SFTTrainer computes the loss from lm_head.weight directly (its fused LM head), so a "
                         "LoRA adapter on lm_head would never be trained; leave it out: "
                         "InjectLoRA(..., exclude=['lm_head']) or targets that do not match 'lm_head'")


def _check_calling_trainer(model) -> None:
    """Called once, eagerly, before the model's first compiled call: when a ``transformers.Trainer`` is on
    the call stack, check its arguments against the model's pipeline."""
    from . import _trl_fused_head, _trl_orpo

    allow_trl_kernels()
    _trl_fused_head.route()
    late_orpo = not _trl_orpo.routed() and _trl_orpo.route()
    trainer_mod = sys.modules.get("transformers.trainer")
    if trainer_mod is None:
        return
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if trainer_cls is not None and isinstance(obj, trainer_cls):
            _trl_fused_head.install_in(obj, model)  # TRL's trainer module was imported after effpass.compile
            _check_trl_fused_head(model)
            check_training_args(obj.args, model)
            if late_orpo and isinstance(obj, _trl_orpo._STATE["cls"]):
                # this call is already inside TRL's own method: routed from the next step on
                _trl_orpo.note(obj, model, "unrouted_calls", "trl.experimental.orpo was imported after "
                               "effpass.compile: the first step ran TRL's own method (import it first)")
            return
        frame = frame.f_back
    _check_trl_fused_head(model)


# ------------------------------------------------------------------------------------------------------
# a Trainer callback: compile the Trainer's model with effpass (one line)
# ------------------------------------------------------------------------------------------------------
class _EffpassCallbackMethods:
    """``Trainer(..., callbacks=[EffpassCallback(passes=[...], **compile_options)])``: compiles the
    Trainer's model with ``effpass.compile`` when the Trainer is built (before its optimizer exists, so
    module-level passes such as ``inject_lora`` can add parameters), checks the arguments, and keeps the
    model's :func:`effpass.report` at ``callback.report`` after training.

    A model already compiled by effpass is only checked (not compiled again)."""

    def __init__(self, passes=None, **compile_options):
        self.passes, self.compile_options = passes, compile_options
        self.report = None
        self._model = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        import effpass

        if model is None:
            raise ValueError("EffpassCallback needs the Trainer's model (Trainer(model=...)); model_init is not supported")
        if not is_effpass_compiled(model):
            effpass.compile(model, self.passes, **self.compile_options)
        check_training_args(args, model)
        self._model = model
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import effpass

        if model is not None and is_effpass_compiled(model):
            self.report = effpass.report(model)
        return control


def __getattr__(name: str):
    """``EffpassCallback`` subclasses ``transformers.TrainerCallback``, built on first use: importing the
    Trainer stack (transformers' trainer utilities, peft) costs seconds, and this module is imported by
    passes that only need :func:`set_hf_loss_type`."""
    if name != "EffpassCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from transformers import TrainerCallback
    except Exception:  # pragma: no cover - transformers is optional
        TrainerCallback = object
    cls = type("EffpassCallback", (_EffpassCallbackMethods, TrainerCallback),
               {"__doc__": _EffpassCallbackMethods.__doc__, "__module__": __name__})
    globals()["EffpassCallback"] = cls
    return cls
