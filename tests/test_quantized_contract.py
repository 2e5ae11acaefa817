"""The core quantized-weight contract (effpass.quantized): storage-true bytes and format dispatch."""
import importlib

import pytest
import torch

from effpass.quantized import (dequantize, inner_tensors, is_quantized, register_quantized_format,
                               storage_bytes)


def test_plain_tensors_count_each_storage_once():
    a = torch.zeros(10, 10)
    assert storage_bytes(a) == 400
    assert storage_bytes([a, a.view(100), a[0], 3, None]) == 400
    seen: set = set()
    assert storage_bytes(a, seen) == 400 and storage_bytes(a, seen) == 0
    assert not is_quantized(a) and not is_quantized(torch.nn.Parameter(a))
    assert torch.equal(dequantize(a, torch.float64), a.double())


def test_nf4_weight_counts_inner_tensors_not_logical_dtype():
    nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    w = torch.randn(128, 256)
    q = nf4.to_nf4(w, 64, 256)
    logical = q.numel() * q.element_size()
    real = storage_bytes(q)
    assert logical == 128 * 256 * 4
    # 4 bits per value + double-quantized scales: about 0.52 bytes per parameter
    assert 0.5 <= real / q.numel() <= 0.55, real
    assert len(inner_tensors(q)) > 1
    assert not is_quantized(q)  # nobody registered torchao's class here: not claimed
    with pytest.raises(TypeError, match="no pass registered"):
        dequantize(q)


def test_registered_format_dispatches_and_rejects_bad_input():
    nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

    class MyNF4(nf4.NF4Tensor):
        pass

    register_quantized_format(MyNF4, dequantize=lambda t, dtype: t.get_original_weight().to(dtype or t.dtype))
    w = torch.randn(128, 128)
    q = nf4.to_nf4(w, 64, 256)
    q.__class__ = MyNF4
    assert is_quantized(q)
    d = dequantize(q)
    assert d.shape == w.shape and (d - w).norm() / w.norm() < 0.15
    with pytest.raises(TypeError, match="not a torch.Tensor subclass"):
        register_quantized_format(int, dequantize=lambda t, d: t)
    with pytest.raises(TypeError, match="must be callable"):
        register_quantized_format(MyNF4, dequantize=None)
