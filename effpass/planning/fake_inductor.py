"""Replaying Inductor's generated code on fake tensors: a compiled graph's generated Python wrapper runs with
fake allocations and no kernels (:func:`fake_wrapper`), which replays the real allocation sequence (its fused
buffers, reuse and frees). :func:`effpass.planning.patches.replay_patches` installs it for a replay."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["fake_wrapper", "FAKE_WRAPPER_CODE"]


class _NoKernel:
    """Stands in for a generated kernel (C++ or Triton): kernels write into buffers the wrapper allocated,
    so skipping them changes no allocation."""

    def __call__(self, *args, **kwargs):
        return None

    def run(self, *args, **kwargs):
        return None


def _noop(*args, **kwargs):
    return None


#: the code objects of the fake wrappers made so far -> their generated file (for "where is the peak")
FAKE_WRAPPER_CODE: dict[Any, str] = {}


def fake_wrapper(compiled_graph, device, cache: dict):
    """The ``call`` of Inductor's generated Python wrapper for ``compiled_graph`` with fake allocations.

    The wrapper allocates every buffer (``empty_strided_cpu/cuda``), runs kernels into them, reuses them
    (``buf5 = buf2; del buf2  # reuse``) and frees them (``del buf3``, ``args.clear()``) in exactly the
    order of the real run. Run with its globals swapped (allocators make fake tensors, kernels do nothing,
    ``reinterpret_tensor`` is ``as_strided``), under the fake mode and the tracker, it replays the real
    allocation sequence; extern kernels (``extern_kernels.mm(..., out=buf)``) and ATen fallbacks
    (``aten._scaled_dot_product_flash_attention_for_cpu``) run as fake ops. The module itself is not
    changed (a real run of the same code in this process still works): a copy of ``call`` gets new globals.
    """
    import types

    from torch._inductor.codecache import PyCodeCache

    key = compiled_graph.cache_key
    if key in cache:
        return cache[key]
    mod = PyCodeCache.load_by_key_path(key, compiled_graph.write_to_disk())
    g = dict(mod.__dict__)

    def empty(size, stride, dtype, *_a, _dev=device, **_k):
        return torch.empty_strided(size, stride, dtype=dtype, device=_dev)

    for name, value in list(g.items()):
        if name.startswith("empty_strided"):
            g[name] = empty
        elif name.startswith(("cpp_", "triton_")) and not isinstance(value, type(torch)):
            g[name] = _NoKernel()
    g["reinterpret_tensor"] = lambda t, size, stride, offset: t.as_strided(size, stride, t.storage_offset() + offset)
    g["assert_size_stride"] = _noop
    g["assert_alignment"] = _noop
    call = mod.call
    if isinstance(call, types.MethodType):  # torch >= 2.11: a Runner object's bound method
        f = call.__func__
        fn = types.MethodType(types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__),
                              call.__self__)
        code = f.__code__
    else:
        fn = types.FunctionType(call.__code__, g, call.__name__, call.__defaults__, call.__closure__)
        code = call.__code__
    FAKE_WRAPPER_CODE[code] = getattr(mod, "__file__", key)
    cache[key] = fn
    return fn
