"""The GPUs the cost model estimates a step's time on, and the roofline that does it.

Every constant carries its source (docs/cost_model.md repeats them in a table). Nothing here was measured on
the device by effpass: when a GPU is lent, ``bench/`` compares these estimates with measured times.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

__all__ = ["GPU", "DEVICES", "get_device", "kernel_seconds", "targeting", "device_type_for"]


@dataclass(frozen=True)
class GPU:
    """What the roofline needs to know about one GPU (dense, no sparsity)."""

    name: str
    #: dense bf16/fp16 tensor-core peak, FLOP/s (NVIDIA H100 SXM5 / H200 SXM datasheets: 989.4 TFLOP/s without
    #: sparsity; the datasheets print 1,979 "with sparsity")
    bf16_peak_flops: float
    #: what a large bf16 GEMM reaches in practice, FLOP/s (~790 TFLOP/s: the figure issue 36 quotes as measured on
    #: H100/H200 with cuBLAS; not measured by effpass). Matmul and attention kernels in bf16/fp16 use this
    matmul_flops: float
    #: fp32 without tensor cores, FLOP/s (datasheets: 67 TFLOP/s); torch's default for fp32 matmuls on CUDA
    #: (``torch.backends.cuda.matmul.allow_tf32`` is False by default)
    fp32_flops: float
    #: HBM bandwidth, bytes/s (datasheets: H100 SXM5 HBM3 3.35 TB/s, H200 HBM3e 4.8 TB/s)
    hbm_bytes_per_s: float
    #: fixed cost of one kernel launch, seconds (a few microseconds for an eager launch from Python through the
    #: dispatcher; 4 us taken here, an order of magnitude, not measured by effpass)
    launch_s: float = 4e-6
    #: extra cost of one host synchronisation, seconds (a device-to-host copy of a scalar and the stream wait,
    #: ~10 us; order of magnitude, not measured by effpass; the launches it stops from overlapping are not modelled)
    sync_s: float = 10e-6
    #: host link, bytes/s per direction (device-to-host and host-to-device each; full duplex): what offloaded
    #: activations and optimizer states cross. PCIe 5.0 x16 (H100/H200 SXM and PCIe boards): 32 GT/s x 16 lanes
    #: = 63 GB/s raw per direction, ~55 GB/s effective (the figure issue 39 states; not measured by effpass).
    #: GH200: NVLink-C2C, 900 GB/s total = 450 GB/s per direction (NVIDIA GH200 datasheet; not measured)
    host_bytes_per_s: float = 55e9
    #: what the host link is, for notes
    host_link: str = "PCIe 5.0 x16"


DEVICES: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM5 80GB", bf16_peak_flops=989.4e12, matmul_flops=790e12, fp32_flops=67e12,
                hbm_bytes_per_s=3.35e12),
    "h200": GPU("NVIDIA H200 SXM 141GB", bf16_peak_flops=989.4e12, matmul_flops=790e12, fp32_flops=67e12,
                hbm_bytes_per_s=4.8e12),
    # GH200 (Grace Hopper): the H100 GPU with 96 GB HBM3 at 4.0 TB/s (NVIDIA GH200 datasheet), joined to the Grace
    # CPU's LPDDR5X by NVLink-C2C
    "gh200": GPU("NVIDIA GH200 96GB", bf16_peak_flops=989.4e12, matmul_flops=790e12, fp32_flops=67e12,
                 hbm_bytes_per_s=4.0e12, host_bytes_per_s=450e9, host_link="NVLink-C2C"),
}


def get_device(name: str | GPU) -> GPU:
    """The :class:`GPU` called ``name`` (case-insensitive), or ``name`` itself when it is one."""
    if isinstance(name, GPU):
        return name
    key = str(name).lower().strip()
    if key not in DEVICES:
        raise ValueError(f"effpass cost: device {name!r} is not known; choose one of {sorted(DEVICES)}")
    return DEVICES[key]


_LOW = (torch.bfloat16, torch.float16)


def kernel_seconds(gpu: GPU, flops: int, nbytes: int, dtype: torch.dtype | None) -> float:
    """Roofline time of one kernel: the larger of its compute time (``flops`` at the matmul ceiling for bf16/fp16
    operands, the fp32 rate otherwise) and its memory time (``nbytes`` at the HBM bandwidth), plus one launch."""
    rate = gpu.matmul_flops if dtype in _LOW else gpu.fp32_flops
    return max(flops / rate if flops else 0.0, nbytes / gpu.hbm_bytes_per_s) + gpu.launch_s


# ------------------------------------------------------------------------------------------------------
# the device a computation is planned for
# ------------------------------------------------------------------------------------------------------
_TARGET: contextvars.ContextVar = contextvars.ContextVar("effpass_target_device_type", default=None)


@contextlib.contextmanager
def targeting(device_type: str | None):
    """Inside, code that picks its kernels by device (``fuse_cross_entropy``'s Triton tiles on CUDA) picks those of
    ``device_type`` (``"cuda"``) even on CPU tensors: the cost model estimates a GPU step on a CPU this way. Kernels
    declared with :func:`effpass.register_device_kernel` then run their CPU reference (or fake) implementation and
    are counted as the device's kernel."""
    token = _TARGET.set(device_type)
    try:
        yield
    finally:
        _TARGET.reset(token)


def device_type_for(t: torch.Tensor | None = None) -> str:
    """The device type code on ``t`` runs for: the one set by :func:`targeting`, else ``t``'s own (``"cpu"``
    without a tensor)."""
    target = _TARGET.get()
    if target:
        return target
    return t.device.type if isinstance(t, torch.Tensor) else "cpu"
