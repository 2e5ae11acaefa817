"""Rank processes for the distributed tests, started from a preloaded fork server.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch, transformers and
effpass again (~7 CPU-s per rank on this 2-core machine, ~85 CPU-s per suite run over the 2- and 4-rank
spawns). Here the ranks fork from a fork server that imported them once per test process (Python's
``forkserver`` start method: the server is single-threaded, so forking it is safe, unlike forking a pytest
worker that has run OpenMP). A rank still starts clean: its own interpreter state, no Dynamo caches, no
process group. The caller's environment at the time of the call is applied in the rank (the fork server's
own environment is the one it started with).
"""
from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

#: what every rank imports anyway (the fork server imports it once)
PRELOAD = ["torch", "torch.distributed.fsdp", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "effpass", "effpass.passes"]
_PRELOADED = [False]


def _entry(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn_ranks(fn, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` on ``world`` ranks; raises (as ``mp.spawn`` does) when a rank fails."""
    if not _PRELOADED[0]:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _PRELOADED[0] = True
    mp.start_processes(_entry, args=(dict(os.environ), fn, *args), nprocs=world, join=True,
                       start_method="forkserver")
