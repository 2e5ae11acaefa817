"""The quantized-weight contract between passes, and storage-true byte counts (core).

A pass that puts a quantized tensor subclass into a model (``quantize_linear``) registers its format here;
every other part of effpass (``fuse_cross_entropy``'s head, the memory planner, reports) asks through these
functions and never imports the pass that made the weight:

* :func:`is_quantized` - is this tensor a registered quantized format?
* :func:`dequantize` - the high-precision tensor it stands for
* :func:`storage_bytes` - bytes a tensor really holds: plain tensors by their storage, traceable wrapper
  subclasses (torchao NF4 / int8, effpass's own formats, fp8 wrappers) by their inner tensors, recursively,
  each storage once. ``numel() * element_size()`` is wrong for them: they report their logical dtype.

    from effpass.quantized import register_quantized_format
    register_quantized_format(MyInt8Tensor, dequantize=lambda t, dtype: t.dequantize(dtype))
"""
from __future__ import annotations

import contextlib as _contextlib
import logging as _logging
from typing import Callable, Iterable, Optional

import torch

__all__ = ["register_quantized_format", "is_quantized", "dequantize", "storage_bytes", "inner_tensors",
           "quantized_formats", "quiet_torchao_import"]

_FORMATS: dict[type, Callable[[torch.Tensor, Optional[torch.dtype]], torch.Tensor]] = {}


def register_quantized_format(cls: type, *, dequantize: Callable[[torch.Tensor, Optional[torch.dtype]], torch.Tensor]
                              ) -> type:
    """Declare ``cls`` (a tensor subclass) a quantized weight format; ``dequantize(t, dtype)`` returns the
    plain tensor it stands for (``dtype=None``: its nominal dtype). Subclasses of ``cls`` are covered too
    unless registered themselves. Returns ``cls`` (usable as a decorator factory's target)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"register_quantized_format: {cls!r} is not a torch.Tensor subclass")
    if not callable(dequantize):
        raise TypeError(f"register_quantized_format: dequantize must be callable, got {dequantize!r}")
    _FORMATS[cls] = dequantize
    return cls


def quantized_formats() -> tuple[type, ...]:
    """The registered formats (for reports and tests)."""
    return tuple(_FORMATS)


def _handler(t) -> Optional[Callable]:
    for klass in type(t).__mro__:
        fn = _FORMATS.get(klass)
        if fn is not None:
            return fn
    return None


def is_quantized(t) -> bool:
    """True when ``t`` is an instance of a registered quantized format."""
    return isinstance(t, torch.Tensor) and _handler(t) is not None


def dequantize(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The high-precision tensor ``t`` stands for (plain tensors: detached, cast to ``dtype`` if given)."""
    fn = _handler(t)
    if fn is not None:
        return fn(t, dtype)
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and _is_wrapper(t):
        raise TypeError(f"dequantize: {type(t).__qualname__} is a tensor subclass that no pass registered as a "
                        f"quantized format (registered: {[c.__qualname__ for c in _FORMATS] or 'none'})")
    return t.detach().to(dtype or t.dtype)


def _is_wrapper(t) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s data: itself for a plain tensor, else its flattened inner tensors
    (recursively, for wrappers of wrappers)."""
    if not _is_wrapper(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            out += inner_tensors(inner)
    return out


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[object, int]:
    try:
        st = t.untyped_storage()
        # NOTE: _cdata, not data_ptr(): fake and meta tensors (planner replays) share no real pointer
        return st._cdata, st.nbytes()
    except Exception:  # tensors without a storage (rare): count their logical bytes
        return id(t), t.numel() * t.element_size()


def storage_bytes(tensors: torch.Tensor | Iterable, seen: Optional[set] = None) -> int:
    """Bytes held by ``tensors`` (one tensor or an iterable of them; non-tensors ignored), each storage
    counted once (also across calls that pass the same ``seen`` set)."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for inner in inner_tensors(t):
            key, n = _storage_key_and_bytes(inner)
            if key in seen:
                continue
            seen.add(key)
            total += n
    return total


# ------------------------------------------------------------------------------------------------------
# importing torchao quietly (passes import it lazily, when they need it)
# ------------------------------------------------------------------------------------------------------
class _KnownImportNoise(_logging.Filter):
    """Drops the two known messages torchao's import logs on a CPU build: its CUDA-only extension
    libraries failing to load (``Failed to load .../_C_*.so``) and torch's deprecation of pytree
    ``register_constant`` on Enum classes, which torchao calls. Everything else passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Failed to load") and "_C" in msg and ".so" in msg:
            return False
        return "is an Enum subclass and is now natively supported" not in msg


@_contextlib.contextmanager
def quiet_torchao_import():
    """Import torchao inside this context to keep its known import-time noise off stderr."""
    f = _KnownImportNoise()
    loggers = [_logging.getLogger("torchao"), _logging.getLogger("torch.utils._pytree")]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(f)
