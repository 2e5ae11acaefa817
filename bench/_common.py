"""Shared by the bench/ scripts: timing one step the same way on every device."""
from __future__ import annotations

import time
from typing import Callable

import torch


def timed(step: Callable[[], object], cuda: bool) -> float:
    """Seconds one call of ``step`` takes: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    step()
    return time.perf_counter() - t
