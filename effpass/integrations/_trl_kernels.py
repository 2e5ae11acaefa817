"""TRL's fused LM-head kernel (``trl.kernels.ChunkedLogProbFunction``) as an opaque torch custom op.

TRL 1.16's ``SFTTrainer`` replaces the model's ``forward`` with a fused output head that calls
``ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size, softcap,
logit_scale, outputs)``. Its forward and backward loop in Python over ``TOKEN_CHUNK_SIZE`` token chunks, so
a graph that traces through them (``allow_in_graph``: AOTAutograd traces the Python loop) is specialised
on the token count: with ``SFTTrainer(padding_free=True)`` every packed length recompiles, until Dynamo's
recompile limit makes the frame run eagerly without a word.

Here the kernel is two ``torch.library.custom_op``s, ``effpass::trl_chunked_logprob`` (forward) and
``effpass::trl_chunked_logprob_backward``, whose fake implementations give the outputs' shapes from the
(symbolic) sizes of the inputs: the graph holds one call each, and a dynamic token count needs one
recompile, not one per length. Their real implementations run TRL's own ``forward`` and ``backward``
(the static methods of TRL's Function, called with a small stand-in for autograd's ``ctx``), so the
numbers are TRL's, bit for bit. TRL's files and its Function are not changed: :func:`install` replaces
the name ``trl.trainer.utils._ChunkedLogProbFunction`` (what the fused head calls) with
:class:`ChunkedLogProb`, whose ``apply`` calls TRL's Function unchanged when not compiling and the custom
op while Dynamo traces.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from typing import Optional

import torch

__all__ = ["install", "installed", "ChunkedLogProb", "chunked_logprob", "CALLS"]

# the kernel's per-token outputs besides the log-probabilities (TRL's OPTIONAL_OUTPUTS), in its order
_OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_FORWARD_PARAMS = ["ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                   "final_logit_softcapping", "logit_scale", "outputs"]
_STATE: dict = {"fn": None, "installed": False}
#: how many times the ops' real implementations ran (TRL's forward / backward through the op)
CALLS = {"forward": 0, "backward": 0}


def _trl_function():
    """TRL's Function when its kernel module is importable and has the expected shape, else None."""
    if "trl" not in sys.modules:
        return None  # the user has not imported TRL: nothing of it to route (and importing it costs seconds)
    mod = sys.modules.get("trl.kernels.chunked_logprob")
    if mod is None:
        try:
            import trl.kernels.chunked_logprob as mod  # noqa: F811
        except Exception:
            return None
    fn = getattr(mod, "ChunkedLogProbFunction", None)
    if fn is None or tuple(getattr(mod, "OPTIONAL_OUTPUTS", ())) != _OPTIONAL:
        return None
    try:
        params = list(inspect.signature(fn.forward).parameters)
        bparams = list(inspect.signature(fn.backward).parameters)
    except (TypeError, ValueError):
        return None
    if params != _FORWARD_PARAMS or bparams[:1] != ["ctx"]:
        return None
    return fn


class _Ctx:
    """What TRL's forward/backward use of autograd's ``ctx``: attributes, saved tensors, flags."""

    def __init__(self, **attrs):
        self.saved_tensors = ()
        self.__dict__.update(attrs)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


def _kernel_args(temperature, softcap, logit_scale):
    # what TRL's forward stores as ctx.kernel_args (checked against it by the self-test in install())
    return {"logit_scale": logit_scale, "softcap": softcap or 1.0, "inv_t": 1 / temperature,
            "HAS_SOFTCAP": softcap is not None}


def _autocast(device_type: str, dtype: Optional[torch.dtype]):
    # the autocast state of the caller, made explicit: a compiled graph runs its ops without it
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


# ------------------------------------------------------------------------------------------------------
# the ops
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::trl_chunked_logprob", mutates_args=())
def _forward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                temperature: float, chunk_size: int, softcap: Optional[float], logit_scale: float,
                outputs: str, autocast_dtype: Optional[torch.dtype]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, log_z, entropy, log_sum_sq_probs, mean_logits, is_top1): TRL's forward; an output not named
    in ``outputs`` (comma-separated names) is an empty placeholder."""
    fn = _STATE["fn"]
    CALLS["forward"] += 1
    ctx = _Ctx()
    with torch.no_grad(), _autocast(hidden.device.type, autocast_dtype):
        res = fn.forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale,
                         tuple(outputs.split(",")))
    log_z = ctx.saved_tensors[4]
    logprobs, rest = res[0], list(res[1:])
    rest = [x if x is not None else hidden.new_empty((0,), dtype=torch.bool if name == "is_top1" else torch.float32)
            for name, x in zip(_OPTIONAL, rest)]
    log_z = log_z.clone() if any(log_z is x for x in res) else log_z  # outputs must not alias each other
    return (logprobs, log_z, *rest)


@_forward_op.register_fake
def _(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, autocast_dtype):
    n, outputs = hidden.shape[0], outputs.split(",")
    per_token = hidden.new_empty((n,), dtype=torch.float32)

    def opt(name, dtype=torch.float32):
        return hidden.new_empty((n,) if name in outputs else (0,), dtype=dtype)

    return (per_token, hidden.new_empty((n,), dtype=torch.float32), opt("entropy"), opt("log_sum_sq_probs"),
            opt("mean_logits"), opt("is_top1", torch.bool))


@torch.library.custom_op("effpass::trl_chunked_logprob_backward", mutates_args=())
def _backward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                 log_z: torch.Tensor, entropy: torch.Tensor, grad_logprobs: Optional[torch.Tensor],
                 grad_entropy: Optional[torch.Tensor], temperature: float, chunk_size: int,
                 softcap: Optional[float], logit_scale: float, compute_dtype: torch.dtype,
                 needs_hidden: bool, needs_weight: bool, needs_bias: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias): TRL's backward; a gradient not needed is an empty placeholder."""
    fn = _STATE["fn"]
    CALLS["backward"] += 1
    ctx = _Ctx(saved_tensors=(hidden, weight, bias, targets, log_z, entropy), compute_dtype=compute_dtype,
               chunk_size=chunk_size, kernel_args=_kernel_args(temperature, softcap, logit_scale),
               needs_input_grad=(needs_hidden, needs_weight, needs_bias) + (False,) * 6)
    with torch.no_grad():
        g = fn.backward(ctx, grad_logprobs, grad_entropy)
    out = []
    for x, like in zip(g[:3], (hidden, weight, bias)):
        out.append(x if x is not None else hidden.new_empty((0,), dtype=like.dtype if like is not None else hidden.dtype))
    return tuple(out)


@_backward_op.register_fake
def _(hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy, temperature, chunk_size, softcap,
      logit_scale, compute_dtype, needs_hidden, needs_weight, needs_bias):
    def grad(t, needed):
        if t is None:
            return hidden.new_empty((0,))
        return torch.empty_like(t, memory_format=torch.contiguous_format) if needed else t.new_empty((0,))

    return grad(hidden, needs_hidden), grad(weight, needs_weight), grad(bias, needs_bias and bias is not None)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, autocast_dtype = inputs
    outputs = outputs.split(",")
    log_z, entropy = output[1], output[2]
    ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if "entropy" in outputs else log_z)
    ctx.args = (temperature, chunk_size, softcap, logit_scale)
    # TRL's compute dtype: the autocast dtype in effect at the forward, else the hidden states' dtype
    ctx.compute_dtype = autocast_dtype if autocast_dtype is not None else hidden.dtype
    ctx.has_bias = bias is not None
    ctx.has_entropy = "entropy" in outputs
    ctx.mark_non_differentiable(output[1], *output[3:], *(() if ctx.has_entropy else output[2:3]))
    # like TRL's Function: an output that got no gradient (entropy used for logging only) is None, not zeros
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logprobs, grad_log_z, grad_entropy, *_):
    hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
    temperature, chunk_size, softcap, logit_scale = ctx.args
    nh, nw, nb = ctx.needs_input_grad[:3]
    nb = nb and ctx.has_bias
    grad_entropy = grad_entropy if ctx.has_entropy else None
    gh, gw, gb = torch.ops.effpass.trl_chunked_logprob_backward(
        hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy, temperature, chunk_size,
        softcap, logit_scale, ctx.compute_dtype, nh, nw, nb)
    return (gh if nh else None, gw if nw else None, gb if nb else None) + (None,) * 7


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _register_flops() -> None:
    """FLOP formulas for the memory planner's replay (``effpass.register_flop_formula``): TRL's forward
    projects every token through the head (2*N*H*V); its backward projects again and computes one matmul per
    gradient asked for (hidden, weight)."""
    from effpass.memory_options import register_flop_formula

    def fwd(hidden, weight, *a, out_val=None, **k):
        return 2 * hidden.shape[0] * hidden.shape[-1] * weight.shape[0]

    def bwd(hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy, temperature, chunk_size,
            softcap, logit_scale, compute_dtype, needs_hidden, needs_weight, needs_bias, out_val=None, **k):
        return fwd(hidden, weight) * (1 + int(bool(needs_hidden)) + int(bool(needs_weight)))

    register_flop_formula(torch.ops.effpass.trl_chunked_logprob, fwd)
    register_flop_formula(torch.ops.effpass.trl_chunked_logprob_backward, bwd)


_register_flops()


# ------------------------------------------------------------------------------------------------------
# the stand-in for TRL's Function
# ------------------------------------------------------------------------------------------------------
def chunked_logprob(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                    logit_scale=1.0, outputs=_OPTIONAL):
    """``ChunkedLogProbFunction.apply``'s arguments and results, through the custom op."""
    device_type = hidden.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    softcap = None if final_logit_softcapping is None else float(final_logit_softcapping)
    res = torch.ops.effpass.trl_chunked_logprob(hidden, weight, bias, targets, float(temperature), int(chunk_size),
                                                softcap, float(logit_scale), ",".join(outputs), autocast_dtype)
    logprobs, _log_z, *rest = res
    return (logprobs, *(x if name in outputs else None for name, x in zip(_OPTIONAL, rest)))


class ChunkedLogProb:
    """Takes the place of ``trl.trainer.utils._ChunkedLogProbFunction``: ``apply`` runs TRL's own Function
    when called eagerly, and the opaque custom op while ``torch.compile`` traces."""

    original = None  # TRL's Function

    @staticmethod
    def apply(*args, **kwargs):
        if torch.compiler.is_compiling():
            return chunked_logprob(*args, **kwargs)
        return ChunkedLogProb.original.apply(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------
# install
# ------------------------------------------------------------------------------------------------------
def _self_test(fn) -> str | None:
    """Runs TRL's Function and the op on a tiny CPU problem (every output, softcap, bias, two token chunks
    would be too big: one chunk, two vocabulary tiles); returns why they differ, or None."""
    calls = dict(CALLS)
    try:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(5, 8, generator=g, dtype=torch.float64)
        w = torch.randn(11, 8, generator=g, dtype=torch.float64)
        b = torch.randn(11, generator=g, dtype=torch.float64)
        t = torch.randint(0, 11, (5,), generator=g)
        ctx = _Ctx()
        fn.forward(ctx, h, w, b, t, 0.7, 4, 3.0, 1.3, _OPTIONAL)
        if getattr(ctx, "kernel_args", None) != _kernel_args(0.7, 3.0, 1.3):
            return "TRL's forward keeps different kernel arguments than effpass expects"
        want_grads, got_grads = [], []
        for run, grads in ((fn.apply, want_grads), (chunked_logprob, got_grads)):
            x, y, z = (v.clone().requires_grad_() for v in (h, w, b))
            with torch.enable_grad():
                out = run(x, y, z, t, 0.7, 4, 3.0, 1.3, _OPTIONAL)
                (out[0].sum() + 0.5 * out[1].sum()).backward()
            grads.extend([*(o.detach() for o in out), x.grad, y.grad, z.grad])
        for a, c in zip(want_grads, got_grads):
            if not torch.equal(a, c):
                return "the custom op's results differ from TRL's Function"
    except Exception as e:  # noqa: BLE001 - any failure means: do not install
        return f"{type(e).__name__}: {e}"
    finally:
        CALLS.update(calls)
    return None


def installed() -> bool:
    return _STATE["installed"]


def install() -> bool:
    """Routes TRL's fused LM head through the custom op. Returns False (nothing changed) when TRL's kernel
    is missing or not the one this wrapper knows (its signature, its outputs, or a self-test on a tiny
    problem differ); the caller then falls back to ``torch.compiler.allow_in_graph``."""
    if _STATE["installed"]:
        return True
    utils = sys.modules.get("trl.trainer.utils")
    fn = _trl_function()
    if utils is None or fn is None or getattr(utils, "_ChunkedLogProbFunction", None) is not fn:
        return False
    _STATE["fn"] = fn
    why = _self_test(fn)
    if why is not None:
        _STATE["fn"] = None
        warnings.warn(f"effpass: TRL's ChunkedLogProbFunction is not wrapped as a custom op ({why}); it is "
                      "let into the graph with allow_in_graph instead, which recompiles for every new token count",
                      UserWarning, stacklevel=3)
        return False
    ChunkedLogProb.original = fn
    utils._ChunkedLogProbFunction = ChunkedLogProb
    _STATE["installed"] = True
    return True
