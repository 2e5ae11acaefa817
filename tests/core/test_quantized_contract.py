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


def test_unregistered_wrapper_subclass_is_not_claimed():
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.zeros(4, 4), torch.ones(4, 4))
    assert storage_bytes(t) == 2 * 64
    assert not is_quantized(t)  # nobody registered TwoTensor: not claimed
    with pytest.raises(TypeError, match="no pass registered"):
        dequantize(t)


def test_quantize_linear_registers_every_format_it_makes():
    """Importing the pass's formats registers them (effpass's own and torchao's plain classes, which
    kernel="torchao" and 3-D expert weights make) with the core contract."""
    fmt = importlib.import_module("effpass.passes.quantize_linear.formats")
    nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    i8 = importlib.import_module("torchao.quantization.quantize_.workflows.int8.int8_tensor")
    from effpass.quantized import quantized_formats

    for cls in (fmt.Int8WeightTensor, fmt.NF4WeightTensor, fmt.Int4WeightTensor, nf4.NF4Tensor, i8.Int8Tensor):
        assert cls in quantized_formats(), cls
    w = torch.randn(64, 128)
    for q in (fmt.Int8WeightTensor.from_float(w), fmt.to_nf4_weight(w), fmt.to_nf4_weight(w, fast=False),
              fmt.Int4WeightTensor.from_float(w, 32)):
        assert is_quantized(q)
        d = dequantize(q)
        assert type(d) is torch.Tensor and d.shape == w.shape and (d - w).norm() / w.norm() < 0.15, type(q)
        assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
        assert storage_bytes(q) <= 1.1 * w.numel()  # about one byte per parameter or less (scales included)


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
